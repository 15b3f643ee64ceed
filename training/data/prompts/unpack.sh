#!/usr/bin/env bash
# The prompt pools that distill.sh and the recipes read, unpacked from the gzipped copies beside this script into DIR
# (default runs/prompts), each under its own name: distill names a stored conversation FILE_NAME:LINE, so names and
# line numbers stay as they are. Sources, licences and attribution: ../NOTICE. Prints DIR.
# Usage: bash training/data/prompts/unpack.sh [DIR]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${1:-runs/prompts}
mkdir -p "$DIR"
for f in "$HERE"/*.jsonl.gz; do
  gunzip -c "$f" > "$DIR/$(basename "$f" .gz)"
done
echo "$DIR"
