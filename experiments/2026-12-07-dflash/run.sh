#!/usr/bin/env bash
# The first DFlash draft trained here (training/smollm2-135m-instruct/dflash.sh, RUN runs/dflash) against the shipped
# eagle heads, eager, one process per prompt set (ab_dflash.py): transformers, speculation off, the heads (tree=None),
# the draft's chain and trees of 4 and 6 nodes grown from its held-out rank accuracies; 128 new tokens, 1 prompt per
# category of MT-bench and of the other task types. On a quiet machine: a training job is stopped (kill -STOP) for
# the run and continued after it.
# Usage: bash experiments/2026-12-07-dflash/run.sh [DRAFT]   # from the repository root; DRAFT: runs/dflash
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DRAFT=${1:-runs/dflash}
PIDS=$(pgrep -f "medusa-spec train" || true)
if [ -n "$PIDS" ]; then
  kill -STOP $PIDS
  trap 'kill -CONT $PIDS' EXIT
fi
sleep 5
uptime
export MEDUSA_SPEC_STEP_COSTS=0  # the heads' step costs timed in this process, as in every A/B here
for set in mt:medusa_spec/data/mt_bench_question.jsonl other:medusa_spec/data/other_tasks_question.jsonl; do
  .venv/bin/python "$HERE/ab_dflash.py" --dflash "$DRAFT" --trees 4 6 --prompts "${set#*:}" --per-category 1 \
    --output "$HERE/ab-${set%%:*}.json" 2>&1 | grep --line-buffered -v "Warn\|Loading weights\|warn" \
    > "$HERE/ab-${set%%:*}.log"
done
uptime
