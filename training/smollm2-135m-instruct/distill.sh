#!/usr/bin/env bash
# Stage 1 of the SmolLM2-135M-Instruct heads recipe: self-distilled answers (greedy; bf16 weights where the
# CPU or GPU computes bf16 natively, else fp32) into a folder of gzipped chunks in this repository, so any
# machine continues it.
# Round 1 answers every prompt pool of training/data/prompts (GSM8K capped: the pools are mostly math
# otherwise; duplicates across pools are answered once). Then tasks over documents: summaries,
# extraction, rewriting and answers from given documents over the model's own earlier answers, and
# the OpenAssistant pool's non-English turns to translate into English (scripts/document_prompts.py;
# the pool is written once, DOC_TASKS document tasks, and kept in OUT). Round 2 has the model write
# its own user prompts (Magpie) and answers those. A share of single-turn conversations gets a model-written
# follow-up turn, answered again. Round 2 goes in steps of STEP prompts (write them, answer them), so
# a run stopped at any time keeps answers for nearly every prompt written. Rerun to resume:
# conversations already stored are skipped.
# Usage: bash distill.sh [OUT] [SELF_PROMPTS] [EXTRA distill flags, e.g. --device cuda --batch-size 256]
# Environment: DOC_TASKS (default 1000, read once, when the document pool is written), STEP (default 1000).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-$HERE/../data/smollm2-135m-instruct}
SELF=${2:-20000}
shift $(( $# > 2 ? 2 : $# ))
TRAIN=$(bash "$HERE/../data/prompts/unpack.sh" "$(mktemp -d)")  # the pools, as distill reads them
MODEL=$(python -c "from medusa_spec import default_model; print(default_model.prepare())")
POOLS=()
for f in "$TRAIN"/*.jsonl; do
  case $(basename "$f") in gsm8k_train.jsonl) POOLS+=("$f:2000");; *) POOLS+=("$f");; esac
done
COMMON=(--model "$MODEL" --output "$OUT" --batch-size 128 --max-new-tokens 512
        --max-prompt-tokens 640 --follow-ups 0.25)
medusa-spec distill "${COMMON[@]}" --prompts "${POOLS[@]}" "$@"
DOCS=$OUT/document_prompts.jsonl
[ -f "$DOCS" ] || python "$HERE/../../scripts/document_prompts.py" "$OUT" "$DOCS" --tasks "${DOC_TASKS:-1000}" \
  --translate "$TRAIN/oasst1_val_prompts_qlora_oa_questions.jsonl"
POOLS+=("$DOCS")
medusa-spec distill "${COMMON[@]}" --prompts "${POOLS[@]}" "$@"
STEP=${STEP:-1000}
# Resume at the step of the last prompt already written: a step answers every unanswered prompt up to its number,
# so the steps before it would only load the model again (14 of them took about 20 minutes here).
WRITTEN=$( (gunzip -c "$OUT/self_prompts.jsonl.gz" 2>/dev/null; cat "$OUT/self_prompts.jsonl" 2>/dev/null) | wc -l)
FIRST=$(( WRITTEN - WRITTEN % STEP > STEP ? WRITTEN - WRITTEN % STEP : STEP ))
for ((n = FIRST < SELF ? FIRST : SELF; n < SELF + STEP; n += STEP)); do
  medusa-spec distill "${COMMON[@]}" --prompts "${POOLS[@]}" --self-prompts $((n < SELF ? n : SELF)) "$@"
done
