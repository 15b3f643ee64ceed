#!/usr/bin/env bash
# The shipped heads (heads/smollm2-135m-instruct/) rebuilt from the committed data: eagle heads (a draft layer, MLP
# 576, features of layers 2 and 15 fused, a 4096-token draft vocabulary) trained in seven runs, each from the last
# one's heads (--init-heads) over conversations they have not read (--exclude its trained_conversations.txt), run 6's
# 40 held-out conversations left out of all; the seventh grows them from 3 heads to 4. Each run ends at its deadline
# (--time-limit): 618 minutes in all on a 2-core x86 CPU, in bf16 autocast, 11.2M answer tokens
# (logs: experiments/2026-12-smollm2-135m-instruct/eagle-cpu/train_log*.jsonl). A faster machine runs more of each
# run's planned steps by the same deadline. The data folder has changed since those runs (more conversations, then
# Arena-Hard's removed), so the seeded samples, and the weights, are not the shipped ones bit for bit.
# Killed? Rerun the same command: finished runs are kept, the one under way resumes from its last checkpoint.
# NO_SHIP=1 keeps the last adapter in RUNS; otherwise it is copied to heads/, naming its base model by its Hub name.
# Usage: bash training/smollm2-135m-instruct/eagle.sh [RUNS]   # RUNS: runs/eagle
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DATA=$ROOT/training/data/smollm2-135m-instruct
HELD_OUT=$ROOT/training/smollm2-135m-instruct/held_out_run6.txt
RUNS=${1:-runs/eagle}
COMMON=(--data "$DATA" --head-type eagle --draft-vocab 4096 --num-layers 1 --feature-layers 2 15
        --draft-layer-mlp 576 --max-length 512 --batch-size 4 --max-conversations 100000 --eval-examples 40
        --eval-ranks 8 --eval-every 1000 --save-every 250 --log-every 25 --mixed-precision bf16)
# run, heads, planned steps, deadline (minutes), peak learning rate, warm-up steps; the seed is the run's number - 1
STAGES=("1 3 2000 106 1e-3 60" "2 3 1700 95 5e-4 40" "3 3 560 31 2e-4 20" "4 3 1750 100 4e-4 40"
        "5 3 1350 72 3e-4 40" "6 3 2150 114 3e-4 40" "7 4 1700 100 3e-4 40")
PREV=
for stage in "${STAGES[@]}"; do
  read -r n heads steps minutes lr warmup <<< "$stage"
  OUT=$RUNS/run$n
  if [ ! -f "$OUT/medusa_config.json" ]; then
    FROM=(--exclude "$HELD_OUT")
    [ -z "$PREV" ] || FROM=(--init-heads "$PREV" --exclude "$PREV/trained_conversations.txt" "$HELD_OUT")
    RESUME=()
    [ ! -d "$OUT/checkpoints" ] || RESUME=(--resume)
    medusa-spec train "${COMMON[@]}" --output "$OUT" "${RESUME[@]}" --num-heads "$heads" --max-steps "$steps" \
      --time-limit "$minutes" --lr "$lr" --warmup-steps "$warmup" --seed $((n - 1)) "${FROM[@]}"
  fi
  PREV=$OUT
done
if [ -z "${NO_SHIP:-}" ]; then
  HEADS=$ROOT/heads/smollm2-135m-instruct
  # bfloat16 weights: half the size, and the same tokens per step on every eval prompt as fp32 (the card).
  SHIP=$(mktemp -d)/heads
  medusa-spec convert "$PREV" "$SHIP" --to medusa_spec --weights-dtype bfloat16
  cp "$SHIP/medusa_heads.safetensors" "$PREV/trained_conversations.txt" "$HEADS/"
  python - "$SHIP/medusa_config.json" "$HEADS/medusa_config.json" <<'EOF'
import json, sys
from medusa_spec import default_model
config = json.load(open(sys.argv[1]))
config["base_model_name_or_path"] = default_model.HUB_NAME  # training named the local folder it loaded
open(sys.argv[2], "w").write(json.dumps(config, indent=2) + "\n")
EOF
fi
