#!/usr/bin/env bash
# Stage 4 of the SmolLM2-135M-Instruct heads recipe: the heads train.sh made (1,600 conversations, 3 epochs) trained
# on for one pass over MAX_CONVERSATIONS more of the distilled conversations (a seeded sample of all of them, the
# held-out 40 left out; about a quarter of it is conversations train.sh's sample holds too), then the tree and the
# copy to heads/. One pass: no hidden-state cache, the base runs once per row anyway. 2,400 conversations (1,610 rows
# of 512 tokens) took 73 minutes on a 2-core AVX2 CPU at 137-168 tokens/s. Killed? Rerun with RESUME=--resume.
# Run it after train.sh, whose heads it reads from heads/ (HEADS); it replaces them there with the ones it trains.
# Usage: bash continue.sh [HEADS] [DATA] [RUN_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HEADS=${1:-$ROOT/heads/smollm2-135m-instruct}
DATA=${2:-$ROOT/training/data/smollm2-135m-instruct}
RUN=${3:-runs/smollm2-dependent-continued}
medusa-spec train --data "$DATA" --output "$RUN" ${RESUME:-} --init-heads "$HEADS" --max-length 512 --batch-size 4 \
  --max-conversations "${MAX_CONVERSATIONS:-2400}" --epochs 1 --lr 1e-3 --warmup-steps 20 --eval-examples 40 \
  --eval-ranks 8 --save-every 40 --log-every 5 --eval-every 200
medusa-spec tree --heads "$RUN" --nodes 8
if [ -z "${NO_SHIP:-}" ]; then
  mkdir -p "$ROOT/heads/smollm2-135m-instruct"
  cp "$RUN/medusa_config.json" "$RUN/medusa_heads.safetensors" "$ROOT/heads/smollm2-135m-instruct/"
fi
