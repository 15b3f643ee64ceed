#!/usr/bin/env bash
# Stage 1 of the SmolLM2-135M-Instruct heads recipe: self-distilled answers, greedy, in rounds.
# Each round raises every file's prompt count, so a run stopped at any point holds a balanced
# mix (chat, code, math) rather than the longest prompts of one file. Rerun to resume: prompts
# already answered in $OUT are skipped. Usage: bash distill.sh [OUT] [ROUNDS]
set -euo pipefail
OUT=${1:-/work/data/smollm2-distill.jsonl}
ROUNDS=${2:-4}
TRAIN=$(cd "$(dirname "$0")/../../.." && pwd)/shared/data/train
MODEL=$(python -c "from medusa_spec import default_model; print(default_model.prepare())")
# name:prompts to take in total (GSM8K and MBPP capped: the pool is mostly math otherwise)
MIX="oasst1_val_prompts_qlora_oa_questions.jsonl:900 oasst_prompt_lottery_en_250.jsonl:250 oasst_en_100_text.jsonl:100
arena_hard_v0.1_question.jsonl:400 arena_hard_v2.0_question.jsonl:400 self_instruct_user_oriented_instructions.jsonl:400
self_instruct_seed_tasks.jsonl:300 gsm8k_train.jsonl:300 mbpp.jsonl:200"
for round in $(seq 1 "$ROUNDS"); do
  specs=()
  for entry in $MIX; do
    specs+=("$TRAIN/${entry%%:*}:$(( ${entry##*:} * round / ROUNDS ))")
  done
  medusa-spec distill --model "$MODEL" --prompts "${specs[@]}" --output "$OUT" \
    --batch-size 24 --max-new-tokens 320 --max-prompt-tokens 400
done
