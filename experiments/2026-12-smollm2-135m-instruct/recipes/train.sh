#!/usr/bin/env bash
# Stages 2-3 of the SmolLM2-135M-Instruct heads recipe: dependent (Hydra-style) heads over a 4096-token
# draft vocabulary on the distilled conversations (frozen base, hidden states cached so the base runs
# once per row), then the tree calibrated from the held-out rank accuracies, then the adapter copied
# to heads/. The shipped heads: 1,600 of the conversations (a seeded sample, MAX_CONVERSATIONS; empty
# for all of them), 3 epochs. Filling the hidden-state cache is most of the time: 1,080 rows took about
# 47 minutes on a 2-core AVX2 CPU in fp32, the two epochs after it 12. Killed? Rerun with RESUME=--resume.
# HEAD_TYPE=medusa trains the plain-heads comparison, DRAFT_VOCAB=full the full-vocabulary one.
# Usage: bash train.sh [DATA] [RUN_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)  # moved to experiments/ on 2026-12-06
DATA=${1:-$ROOT/training/data/smollm2-135m-instruct}
RUN=${2:-runs/smollm2-dependent}
MODEL=$(python -c "from medusa_spec import default_model; print(default_model.prepare())")
medusa-spec train --model "$MODEL" --data "$DATA" --output "$RUN" ${RESUME:-} \
  --head-type ${HEAD_TYPE:-dependent} $([ "${DRAFT_VOCAB:-4096}" = full ] || echo --draft-vocab "${DRAFT_VOCAB:-4096}") \
  --num-heads 3 --num-layers 1 --share-lm-head --max-length 512 --batch-size 4 \
  $([ -z "${MAX_CONVERSATIONS-1600}" ] || echo --max-conversations "${MAX_CONVERSATIONS-1600}") --epochs ${EPOCHS:-3} \
  --lr 2e-3 --warmup-steps 20 --cache-hidden --eval-examples 40 --eval-ranks 8 --save-every 40 --log-every 5 --eval-every 340 ${EXTRA:-}
medusa-spec tree --heads "$RUN" --nodes 8
if [ -z "${NO_SHIP:-}" ]; then
  mkdir -p "$ROOT/heads/smollm2-135m-instruct"
  cp "$RUN/medusa_config.json" "$RUN/medusa_heads.safetensors" "$RUN/trained_conversations.txt" \
    "$ROOT/heads/smollm2-135m-instruct/"
fi
