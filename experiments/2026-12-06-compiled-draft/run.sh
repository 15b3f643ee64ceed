#!/bin/bash
# ab.py on a quiet machine: a training job of this session (medusa-spec train) is stopped for the run and continued
# after it. Output: ab.log here.
cd "$(dirname "$0")/../.."
PID=$(pgrep -f "medusa-spec train" | head -1)
if [ -n "$PID" ]; then
  kill -STOP "$PID"
  trap 'kill -CONT $PID' EXIT
fi
sleep 5
uptime
TORCH_LOGS=recompiles .venv/bin/python experiments/2026-12-06-compiled-draft/ab.py "$@" 2>&1 | grep --line-buffered -v "Warn\|Loading weights\|warnings.warn"
uptime
