#!/bin/bash
# Same-process A/B of the shipped EAGLE-3 heads (the fourth stage, not timed when it shipped) against the shipped eagle
# heads: transformers, speculation off and both adapters with tree=None, eager, per prompt in rotating order, MT-bench
# and the other task types, on a quiet machine (a training job of this session is stopped for the run).
# Usage: bash experiments/2026-12-07-eagle3-ab/run.sh   # from the repository root
cd "$(dirname "$0")/../.."
HERE=experiments/2026-12-07-eagle3-ab
PIDS=$(pgrep -f "medusa-spec train")
if [ -n "$PIDS" ]; then
  kill -STOP $PIDS
  trap 'kill -CONT $PIDS' EXIT
fi
sleep 5
uptime
for set in mt:medusa_spec/data/mt_bench_question.jsonl other:medusa_spec/data/other_tasks_question.jsonl; do
  .venv/bin/python experiments/2026-12-06-eagle3/ab_heads.py --heads heads/smollm2-135m-instruct \
    heads/smollm2-135m-instruct-eagle3 --prompts "${set#*:}" --per-category 1 --output "$HERE/ab-${set%%:*}.json" \
    2>&1 | grep --line-buffered -v "Warn\|Loading weights\|warnings.warn" > "$HERE/ab-${set%%:*}.log"
done
uptime
