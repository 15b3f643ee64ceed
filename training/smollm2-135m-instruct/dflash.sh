#!/usr/bin/env bash
# A DFlash block drafter for SmolLM2-135M-Instruct (medusa-spec train --head-type dflash, as speculators trains one):
# 2 Qwen3-shaped layers reading layers 2, 15 and 27, blocks of 8 (the anchor and 7 drafted tokens), the 4,096 most
# frequent answer tokens (as the eagle heads), 256 blocks per 512-token row, fp32, on the committed data with run 6's
# 40 held-out conversations left out. The first run finished its 340 steps in 76 minutes on a 2-core x86 CPU (the
# tenth session's experiments/2026-12-07-dflash/). Rerun to resume from its last checkpoint. TIME_LIMIT: minutes (100).
# Usage: bash training/smollm2-135m-instruct/dflash.sh [RUN]   (RUN: runs/dflash)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RUN=${1:-runs/dflash}
RESUME=()
[ ! -d "$RUN/checkpoints" ] || RESUME=(--resume)
medusa-spec train --head-type dflash --data "$ROOT/training/data/smollm2-135m-instruct" \
  --exclude "$ROOT/training/smollm2-135m-instruct/held_out_run6.txt" --num-layers 2 --block-size 8 \
  --draft-vocab 4096 --max-anchors 256 --max-length 512 --batch-size 4 --max-conversations 8000 --eval-examples 40 \
  --max-steps 340 --time-limit "${TIME_LIMIT:-100}" --lr 1e-3 --warmup-steps 20 --save-every 50 --log-every 10 \
  --eval-every 300 --mixed-precision no --output "$RUN" "${RESUME[@]}"
