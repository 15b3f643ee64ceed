#!/usr/bin/env bash
# The twelfth session's bench --compile beside transformers and llama.cpp, after two cuts to the compiled step's
# overheads: graphs that guard their arguments only (../2026-12-07-guards/) and the prompt's last token through the
# one-node graph. The eleventh session's command (../2026-12-07-cpp-wrapper/run.sh); any training job is stopped
# (kill -STOP) for the run. The F32 GGUF: see ../2026-12-06-bench/NOTES.md.
# Usage: bash experiments/2026-12-07-step-overheads/run.sh   # from the repository root
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
