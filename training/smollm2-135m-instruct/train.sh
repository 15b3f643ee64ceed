#!/usr/bin/env bash
# Stages 2-3 of the SmolLM2-135M-Instruct heads recipe: Medusa-1 heads on the distilled
# conversations (frozen base, hidden states cached so the base runs once per row), then the
# tree calibrated from the held-out rank accuracies, then the adapter copied to heads/.
# Killed? Rerun with RESUME=--resume. Usage: bash train.sh [DATA] [RUN_DIR]
set -euo pipefail
DATA=${1:-/work/data/smollm2-distill.jsonl}
RUN=${2:-runs/smollm2-medusa1}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=$(python -c "from medusa_spec import default_model; print(default_model.prepare())")
medusa-spec train --model "$MODEL" --data "$DATA" --output-dir "$RUN" ${RESUME:-} \
  --num-heads 3 --num-layers 1 --share-lm-head --max-length 512 --batch-size 4 --epochs ${EPOCHS:-2} \
  --lr 2e-3 --warmup-steps 20 --cache-hidden --eval-examples 40 --top-k 8 --save-every 20 --log-every 5 ${EXTRA:-}
medusa-spec tree --adapter "$RUN" --nodes 8
mkdir -p "$ROOT/heads/smollm2-135m-instruct"
cp "$RUN/medusa_config.json" "$RUN/medusa_heads.safetensors" "$ROOT/heads/smollm2-135m-instruct/"
