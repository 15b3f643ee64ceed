#!/usr/bin/env bash
# The fourth session's bench (../2026-12-06-compiled-step/run.sh: bench --compile beside transformers and llama.cpp,
# MT-bench and the other task types) on this session's code: compiled blocks of 2 and 4 nodes, drafting that stops
# where no deeper candidate could enter the tree. On a quiet machine.
# Usage: bash experiments/2026-12-06-drafting/run.sh
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
bash "$HERE/../2026-12-06-compiled-step/run.sh" "$HERE"
