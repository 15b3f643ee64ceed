#!/usr/bin/env bash
# generate(compile=True) with the attention window (one graph per rows x block, attending to the text's slots), on
# SmolLM2-135M-Instruct with the shipped eagle heads: medusa-spec bench --compile beside transformers and llama.cpp,
# on a quiet machine. The F32 GGUF: see experiments/2026-12-06-bench/NOTES.md.
# Usage: bash experiments/2026-12-06-compiled-step/run.sh [OUT]   # OUT: the folder of mt-bench/, other-tasks/ (here)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE}
GGUF=${GGUF:-runs/gguf/SmolLM2-135M-Instruct.F32.gguf}
METHODS=(hf_greedy medusa_off medusa_greedy medusa_lookup llama_cpp)
medusa-spec bench --compile --per-category 1 --max-new-tokens 128 --methods "${METHODS[@]}" --gguf "$GGUF" \
  --output "$OUT/mt-bench"
medusa-spec bench --compile --prompts medusa_spec/data/other_tasks_question.jsonl --per-category 1 \
  --max-new-tokens 128 --methods "${METHODS[@]}" --gguf "$GGUF" --output "$OUT/other-tasks"
