#!/usr/bin/env bash
# The session's closing measurements, on a quiet machine (nothing else running), from the repository root:
# bench on MT-bench (1 prompt per category) and on the other task types (1 each): transformers, speculation off,
# the shipped heads alone and with the lookup chain, and llama.cpp's plain greedy decoding of an F32 GGUF of the
# same weights (made from the package's Q4_1 file with llama_cpp.llama_model_quantize, LLAMA_FTYPE_ALL_F32);
# then scripts/bench_batch.py (tree=None against tree=[] at batch 1, 4 and 8, warm and first calls).
# Usage: bash experiments/2026-12-06-bench/run.sh F32.gguf
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
GGUF=$1
METHODS=(hf_greedy medusa_off medusa_greedy medusa_lookup llama_cpp)
medusa-spec bench --prompts medusa_spec/data/mt_bench_question.jsonl --per-category 1 --methods "${METHODS[@]}" \
  --gguf "$GGUF" --output "$HERE/mt-bench"
medusa-spec bench --prompts medusa_spec/data/other_tasks_question.jsonl --per-category 1 --methods "${METHODS[@]}" \
  --gguf "$GGUF" --output "$HERE/other-tasks"
python scripts/bench_batch.py | tee "$HERE/batch.txt"
