#!/usr/bin/env bash
# The eleventh session's bench --compile with inductor's C++ wrapper (compiled.compile_options) beside transformers
# and llama.cpp: the ninth session's command (../2026-12-07-bench/) without medusa_lookup, whose 16-slot graphs take
# minutes more to compile and which no target names. A training job of this session is stopped (kill -STOP) for the
# run and continued after it. The F32 GGUF: see ../2026-12-06-bench/NOTES.md.
# Usage: bash experiments/2026-12-07-cpp-wrapper/run.sh   # from the repository root
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
medusa-spec bench --compile --per-category 1 --max-new-tokens 128 --methods "${METHODS[@]}" --gguf "$GGUF" \
  --output "$HERE/mt-bench"
medusa-spec bench --compile --prompts medusa_spec/data/other_tasks_question.jsonl --per-category 1 \
  --max-new-tokens 128 --methods "${METHODS[@]}" --gguf "$GGUF" --output "$HERE/other-tasks"
uptime
