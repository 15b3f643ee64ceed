#!/usr/bin/env bash
# The shipped EAGLE-3 heads' third stage: eagle3-continue.sh's fp32 heads (FROM, its step 1,049) trained on over a
# new 1,100-step schedule at half its peak learning rate, on conversations neither earlier stage read, fp32, run 6's
# 40 held-out conversations left out. The shipped heads are this run's adapter where its 120-minute limit stopped it
# (one call, paused for benchmarks part of the time; 2-core x86 CPU). Rerun to resume from its last checkpoint.
# NO_SHIP=1 keeps the adapter in RUN; otherwise it is written to heads/ as a speculators folder. TIME_LIMIT: minutes
# (120). FROM may also be a heads folder: the fourth stage ran `TIME_LIMIT=105 NO_SHIP=1 bash eagle3-continue2.sh
# runs/eagle3-stage4 heads/smollm2-135m-instruct-eagle3` (its trained_conversations.txt keeps the stages apart).
# Usage: bash training/smollm2-135m-instruct/eagle3-continue2.sh [RUN] [FROM]
#   RUN: runs/eagle3-continued2; FROM: eagle3-continue.sh's run, runs/eagle3-continued
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RUN=${1:-runs/eagle3-continued2}
FROM=${2:-runs/eagle3-continued}
RESUME=()
[ ! -d "$RUN/checkpoints" ] || RESUME=(--resume)
medusa-spec train --data "$ROOT/training/data/smollm2-135m-instruct" --init-heads "$FROM" \
  --exclude "$FROM/trained_conversations.txt" "$ROOT/training/smollm2-135m-instruct/held_out_run6.txt" \
  --max-length 512 --batch-size 4 --max-conversations 8000 --eval-examples 40 --eval-ranks 8 --max-steps 1100 \
  --time-limit "${TIME_LIMIT:-120}" --lr 5e-4 --warmup-steps 20 --save-every 25 --log-every 10 --mixed-precision no \
  --heads-target teacher --output "$RUN" "${RESUME[@]}"
if [ -z "${NO_SHIP:-}" ]; then
  medusa-spec convert "$RUN" "$ROOT/heads/smollm2-135m-instruct-eagle3" --to speculators --weights-dtype bfloat16
fi
