#!/usr/bin/env bash
# generate(compile=True) on SmolLM2-135M-Instruct with the shipped eagle heads: medusa-spec bench --compile (this
# library's methods verify through compiled graphs; transformers and llama.cpp as they are), on a quiet machine.
# The F32 GGUF: see experiments/2026-12-06-bench/NOTES.md. Usage: bash experiments/2026-12-06-compiled/run.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
GGUF=${GGUF:-runs/gguf/SmolLM2-135M-Instruct.F32.gguf}
METHODS=(hf_greedy medusa_off medusa_greedy medusa_lookup llama_cpp)
medusa-spec bench --compile --per-category 1 --max-new-tokens 128 --methods "${METHODS[@]}" --gguf "$GGUF" \
  --output "$HERE/mt-bench"
medusa-spec bench --compile --prompts medusa_spec/data/other_tasks_question.jsonl --per-category 1 \
  --max-new-tokens 128 --methods "${METHODS[@]}" --gguf "$GGUF" --output "$HERE/other-tasks"
