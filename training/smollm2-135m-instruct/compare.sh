#!/usr/bin/env bash
# The heads card's side-by-side: plain vs dependent heads, each with the full vocabulary and with a
# 4096-token draft vocabulary, trained on the same rows for the same number of steps (the base's hidden
# states are cached once and shared by the four runs), then calibrated (8-node tree) and benchmarked
# against transformers greedy on MT-bench, one prompt per category. Killed? Rerun with RESUME=--resume.
# Usage: bash compare.sh [DATA] [STEPS] [OUT]
set -euo pipefail
DATA=${1:-/work/data/smollm2-distill.jsonl}
STEPS=${2:-60}
OUT=${3:-runs/compare}
MODEL=$(python -c "from medusa_spec import default_model; print(default_model.prepare())")
mkdir -p "$OUT/hidden_cache"
for variant in medusa:4096 dependent:4096 medusa:full dependent:full; do
  head_type=${variant%%:*}
  vocab=${variant##*:}
  run="$OUT/$head_type-$vocab"
  mkdir -p "$run"
  [ -e "$run/hidden_cache" ] || ln -s "$(cd "$OUT/hidden_cache" && pwd)" "$run/hidden_cache"
  vocab_flags=()
  [ "$vocab" = full ] || vocab_flags=(--draft-vocab "$vocab")
  medusa-spec train --model "$MODEL" --data "$DATA" --output-dir "$run" ${RESUME:-} \
    --head-type "$head_type" "${vocab_flags[@]}" \
    --num-heads 3 --num-layers 1 --share-lm-head --max-length 512 --batch-size 4 --max-steps "$STEPS" \
    --lr 2e-3 --warmup-steps 10 --cache-hidden --eval-examples 40 --top-k 8 --save-every 20 --log-every 5
  medusa-spec tree --adapter "$run" --nodes 8
  medusa-spec bench --heads "$run" --per-category 1 --max-new-tokens 128 --tree auto \
    --methods hf_greedy medusa_greedy --out "$run/bench"
done
