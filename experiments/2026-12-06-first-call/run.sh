#!/bin/bash
# bench_batch.py on a quiet machine: a training job of this session (medusa-spec train) is stopped for the run and
# continued after it. Output: batch-*.log here.
cd "$(dirname "$0")/../.."
PID=$(pgrep -f "medusa-spec train" | head -1)
if [ -n "$PID" ]; then
  kill -STOP "$PID"
  trap 'kill -CONT $PID' EXIT
fi
sleep 5
uptime
.venv/bin/python scripts/bench_batch.py --batches 1 4 8 --rounds 2 2>&1 | grep -v "Warn\|Loading weights"
uptime
