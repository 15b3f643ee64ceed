#!/usr/bin/env bash
# Issue 56's first speed target on the compiled path: the shipped EAGLE-3 heads beside the shipped eagle heads,
# transformers and speculation off, generate(compile=True), one process, both prompt sets (ab.py). A training job is
# stopped for the timed prompts by ab.py itself.
# Usage: bash experiments/2026-12-07-eagle3-compiled/run.sh   # from the repository root
set -euo pipefail
HERE=experiments/2026-12-07-eagle3-compiled
uptime
MEDUSA_SPEC_STEP_COSTS=0 .venv/bin/python "$HERE/ab.py" --heads heads/smollm2-135m-instruct \
  heads/smollm2-135m-instruct-eagle3 --output "$HERE/ab" 2>&1 | grep --line-buffered -v "Warn\|Loading weights" \
  > "$HERE/ab.log"
uptime
