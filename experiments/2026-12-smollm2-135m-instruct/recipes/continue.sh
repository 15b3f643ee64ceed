#!/usr/bin/env bash
# Stage 4 of the SmolLM2-135M-Instruct heads recipe: the shipped heads trained on for one pass over MAX_CONVERSATIONS
# distilled conversations they have not learned from (a seeded sample of those that the trained_conversations.txt
# beside them does not list; the held-out 40 left out), then the tree and the copy to heads/. Rerun it, with a new
# RUN_DIR, as the data grows: each run adds its sample to the list it copies there. One pass: no hidden-state cache,
# the base runs once per row anyway. 2,400 conversations (1,610 rows of 512 tokens) took 73 minutes on a 2-core AVX2
# CPU at 137-168 tokens/s. Killed? Rerun with RESUME=--resume. REPLAY=N also trains on the conversations beginning as
# N of those the heads learned from (`--replay`, a seeded sample; the run takes longer by their rows), so the heads
# keep what they learned; LR sets the peak learning rate. The card's run 7 came before --replay and ran its own command
# (the card's recipe); REPLAY=1600 LR=5e-4 MAX_CONVERSATIONS=100000 with run 5's heads as HEADS comes closest, with
# another sample, its 40 held out from the new conversations only, and no other run's held-out set kept out.
# Run it after train.sh, whose heads it reads from heads/ (HEADS); it replaces them there with the ones it trains.
# (Its first run, before --exclude existed, sampled all conversations: 664 of its 2,400 were train.sh's too.)
# Usage: bash continue.sh [HEADS] [DATA] [RUN_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)  # moved to experiments/ on 2026-12-06
HEADS=${1:-$ROOT/heads/smollm2-135m-instruct}
DATA=${2:-$ROOT/training/data/smollm2-135m-instruct}
RUN=${3:-runs/smollm2-dependent-continued}
medusa-spec train --data "$DATA" --output "$RUN" ${RESUME:-} --init-heads "$HEADS" --exclude "$HEADS/trained_conversations.txt" \
  --max-length 512 --batch-size 4 \
  --max-conversations "${MAX_CONVERSATIONS:-2400}" --replay "${REPLAY:-0}" --epochs 1 --lr "${LR:-1e-3}" \
  --warmup-steps 20 --eval-examples 40 \
  --eval-ranks 8 --save-every 40 --log-every 5 --eval-every 200
medusa-spec tree --heads "$RUN" --nodes 8
if [ -z "${NO_SHIP:-}" ]; then
  mkdir -p "$ROOT/heads/smollm2-135m-instruct"
  cp "$RUN/medusa_config.json" "$RUN/medusa_heads.safetensors" "$RUN/trained_conversations.txt" \
    "$ROOT/heads/smollm2-135m-instruct/"
fi
