#!/bin/bash
# The same-process A/B of the EAGLE-3 heads trained on (runs/eagle3-run4, this session's continuation) against the
# shipped EAGLE-3 and eagle heads, eager, MT-bench and the other task types, on a quiet machine (a training job of
# this session is stopped for the run and continued after it). Output: ab-*.log / ab-*.json here.
# Usage: bash run.sh [CANDIDATE] [OUTPUT FOLDER]: the eighth session ran `bash run.sh runs/eagle3-stage4
# experiments/2026-12-06-eagle3-stage4` for the fourth stage.
cd "$(dirname "$0")/../.."
CANDIDATE=${1:-runs/eagle3-run4}
HERE=${2:-experiments/2026-12-06-eagle3-continued}
PID=$(pgrep -f "medusa-spec train" | head -1)
if [ -n "$PID" ]; then
  kill -STOP "$PID"
  trap 'kill -CONT $PID' EXIT
fi
sleep 5
uptime
for set in mt:medusa_spec/data/mt_bench_question.jsonl other:medusa_spec/data/other_tasks_question.jsonl; do
  .venv/bin/python experiments/2026-12-06-eagle3/ab_heads.py --heads heads/smollm2-135m-instruct \
    heads/smollm2-135m-instruct-eagle3 "$CANDIDATE" --prompts "${set#*:}" --per-category 1 \
    --output "$HERE/ab-${set%%:*}.json" 2>&1 | grep --line-buffered -v "Warn\|Loading weights\|warnings.warn" \
    > "$HERE/ab-${set%%:*}.log"
done
uptime
