#!/usr/bin/env bash
# The thirteenth session's bench --compile beside transformers and llama.cpp, after the commit keeps an accepted path
# already in place (no gather of every layer's cache) and the compiled loop's base copy stops checking packed weights.
# The command of ../2026-12-07-step-overheads/run.sh; MEDUSA_SPEC_STEP_COSTS=0 as there. Any training job is stopped
# (kill -STOP) for the run. The F32 GGUF: see ../2026-12-06-bench/NOTES.md.
# Usage: [ONLY=mt-bench] bash experiments/2026-12-07-commit-in-place/run.sh [SUFFIX]   # from the repository root;
# ONLY: that prompt set alone, SUFFIX: appended to the output folders' names
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PIDS=$(pgrep -f "medusa-spec train" || true)
if [ -n "$PIDS" ]; then
  kill -STOP $PIDS
  trap 'kill -CONT $PIDS' EXIT
fi
sleep 5
uptime
GGUF=${GGUF:-runs/gguf/SmolLM2-135M-Instruct.F32.gguf}
METHODS=(hf_greedy medusa_off medusa_greedy llama_cpp)
for set in "mt-bench:medusa_spec/data/mt_bench_question.jsonl" "other-tasks:medusa_spec/data/other_tasks_question.jsonl"; do
  [ -z "${ONLY:-}" ] || [ "${set%%:*}" = "$ONLY" ] || continue
  medusa-spec bench --compile --prompts "${set#*:}" --per-category 1 --max-new-tokens 128 --methods "${METHODS[@]}" \
    --gguf "$GGUF" --output "$HERE/${set%%:*}${1:-}"
done
uptime
