#!/usr/bin/env bash
# The fifteenth session's same-process A/B after the one-row attention fix: transformers' greedy generate, speculation
# off (tree=[]), the shipped eagle heads and the shipped EAGLE-3 heads (tree=None), all of this library's methods
# compiled, and llama.cpp's plain greedy decoding of the F32 GGUF of the same weights (see ../2026-12-06-bench/NOTES.md
# for how it is made), per prompt in rotating order, one prompt per category, 128 new tokens
# (../2026-12-07-eagle3-compiled/ab.py). Alone on the machine.
# Usage: bash experiments/2026-12-07-verify-profile/ab.sh   # from the repository root
set -euo pipefail
HERE=experiments/2026-12-07-verify-profile
GGUF=${GGUF:-runs/gguf/SmolLM2-135M-Instruct.F32.gguf}
uptime
MEDUSA_SPEC_STEP_COSTS=0 .venv/bin/python experiments/2026-12-07-eagle3-compiled/ab.py --heads heads/smollm2-135m-instruct \
  heads/smollm2-135m-instruct-eagle3 --gguf "$GGUF" --output "$HERE/ab" 2>&1 \
  | grep --line-buffered -v "Warn\|Loading weights\|Converting\|Writing model" > "$HERE/ab.log"
uptime
