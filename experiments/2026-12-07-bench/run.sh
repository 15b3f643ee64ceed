#!/usr/bin/env bash
# The ninth session's bench --compile beside transformers and llama.cpp (the fourth session's command,
# ../2026-12-06-compiled-step/run.sh) on this code: compiled draft graphs, per-row trees and the settled-size stop
# landed since the last such run (../2026-12-06-drafting/). On a quiet machine: a training job of this session is
# stopped (kill -STOP) for the run and continued after it. The F32 GGUF: see ../2026-12-06-bench/NOTES.md.
# Usage: bash experiments/2026-12-07-bench/run.sh   # from the repository root
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PIDS=$(pgrep -f "medusa-spec train" || true)
if [ -n "$PIDS" ]; then
  kill -STOP $PIDS
  trap 'kill -CONT $PIDS' EXIT
fi
sleep 5
uptime
bash "$HERE/../2026-12-06-compiled-step/run.sh" "$HERE"
uptime
