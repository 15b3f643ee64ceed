#!/usr/bin/env bash
# The shipped EAGLE-3 heads (heads/smollm2-135m-instruct-eagle3/) continued: eagle3.sh's fp32 heads (FROM) trained on
# over a 1,100-step schedule, on conversations they have not seen plus a replay of 1,600 they have, fp32, run 6's 40
# held-out conversations left out; its adapter at step 1,049, where its last call's time limit stopped it (calls over
# three sessions, resumed each time: 160, 105 and 118 minutes and a short one, all paused for benchmarks much of the
# time; 2-core x86 CPU), is what eagle3-continue2.sh, the shipped heads' third stage, starts from.
# Rerun to resume from its last checkpoint. NO_SHIP=1 keeps the adapter in RUN; otherwise it is written to heads/ as
# a speculators folder.
# Usage: bash training/smollm2-135m-instruct/eagle3-continue.sh [RUN] [FROM]
#   RUN: runs/eagle3-continued; FROM: eagle3.sh's run, runs/eagle3
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RUN=${1:-runs/eagle3-continued}
FROM=${2:-runs/eagle3}
RESUME=()
[ ! -d "$RUN/checkpoints" ] || RESUME=(--resume)
medusa-spec train --data "$ROOT/training/data/smollm2-135m-instruct" --init-heads "$FROM" --replay 1600 \
  --exclude "$FROM/trained_conversations.txt" "$ROOT/training/smollm2-135m-instruct/held_out_run6.txt" \
  --max-length 512 --batch-size 4 --max-conversations 8000 --eval-examples 40 --eval-ranks 8 --max-steps 1100 \
  --time-limit 160 --lr 1e-3 --warmup-steps 30 --save-every 25 --log-every 10 --mixed-precision no \
  --heads-target teacher --output "$RUN" "${RESUME[@]}"
if [ -z "${NO_SHIP:-}" ]; then
  medusa-spec convert "$RUN" "$ROOT/heads/smollm2-135m-instruct-eagle3" --to speculators --weights-dtype bfloat16
fi
