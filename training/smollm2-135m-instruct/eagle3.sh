#!/usr/bin/env bash
# The shipped EAGLE-3 heads (heads/smollm2-135m-instruct-eagle3/, speculators' format) rebuilt from the committed data:
# eagle3 heads (speculators' architecture: a Llama layer of SmolLM2's shape over its layers 2, 15 and 27, a 4096-token
# draft vocabulary) trained over 3 TTT steps on soft targets (the base's own distribution), fp32, run 6's 40 held-out
# conversations left out; 560 planned steps under a 70-minute deadline on a 2-core x86 CPU without AVX-512 (bf16 is
# emulated there, 8x slower than fp32), with speculators' model-config norms (all off), as they were trained before
# `train` took its trainer's (experiments/2026-12-08-eagle3-norms/). Killed? Rerun: it resumes from its last checkpoint.
# NO_SHIP=1 keeps the adapter in RUN; otherwise it is written to heads/ as a speculators folder.
# Usage: bash training/smollm2-135m-instruct/eagle3.sh [RUN]   # RUN: runs/eagle3
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RUN=${1:-runs/eagle3}
RESUME=()
[ ! -d "$RUN/checkpoints" ] || RESUME=(--resume)
if [ ! -f "$RUN/medusa_config.json" ]; then
  medusa-spec train --data "$ROOT/training/data/smollm2-135m-instruct" --head-type eagle3 --draft-vocab 4096 \
    --num-heads 3 --max-length 512 --batch-size 4 --max-conversations 6000 --eval-examples 40 --eval-ranks 8 \
    --max-steps 560 --time-limit 70 --lr 1e-3 --warmup-steps 30 --save-every 50 --log-every 10 \
    --mixed-precision no --heads-target teacher --no-norm-before-fc --no-norm-before-residual --no-norm-output \
    --exclude "$ROOT/training/smollm2-135m-instruct/held_out_run6.txt" \
    --output "$RUN" "${RESUME[@]}"
fi
if [ -z "${NO_SHIP:-}" ]; then
  medusa-spec convert "$RUN" "$ROOT/heads/smollm2-135m-instruct-eagle3" --to speculators --weights-dtype bfloat16
fi
