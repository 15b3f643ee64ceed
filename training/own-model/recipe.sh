#!/usr/bin/env bash
# Heads for a model nobody here tuned for, chat or base: distill (the model answers prompts) -> train -> bench (speed
# and exactness against transformers' greedy generate) -> convert (the folder a serving engine reads). Each step
# prints progress with an ETA (distill's and bench's bars, train's log lines) and resumes where it stopped: rerun the
# same command. Time and data it needs: README.md beside this script. CI runs it end to end on a tiny random Gemma 3
# (tests/test_own_model_recipe.py).
# Usage: bash training/own-model/recipe.sh MODEL_DIR OUT [PROMPT_FILE[:N] ...]
#   MODEL_DIR  a transformers folder (save_pretrained layout, tokenizer included); nothing is downloaded
#   OUT        the run's folder: conversations.jsonl, heads/, bench/, serve/
#   PROMPTS    default: 1,000 prompts of the committed pools (training/data/prompts, unpacked into OUT/prompts)
# Environment (defaults sized for a 2-core CPU; on a GPU e.g. BATCH=256 DEVICE=cuda MINUTES=60):
#   PLAIN_TEXT      1: the plain "User: ...\n\nAssistant: ..." format, after the tokenizer's BOS (a base model);
#                   0: the model's chat template; default 1 where the tokenizer has no chat template, else 0.
#                   Set PLAIN_TEXT=1 for a base model whose tokenizer ships a chat template anyway.
#   HEAD_TYPE       eagle3 (default: vLLM serves it, OUT/serve in speculators' format), medusa (OUT/serve in vLLM's
#                   Medusa format) or eagle (this library's fastest on a CPU; no serving format: OUT/heads is it)
#   NUM_HEADS 3  DRAFT_VOCAB 4096 (eagle3/eagle; 0: the whole vocabulary)  MAX_NEW_TOKENS 256  BATCH 64 (distill's
#   rows)  EPOCHS 2  MINUTES 120 (train's --time-limit)  BENCH_PROMPTS FILE (prompt JSONL; default MT-bench's)
#   BENCH_N 8 (bench's prompts: the first turn of the first of each category, then the next ones)
#   DEVICE          cpu or cuda (default: cuda where there is one)
#   DISTILL_FLAGS, TRAIN_FLAGS, BENCH_FLAGS: more flags for that step (`medusa-spec COMMAND --help`)
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MODEL=$1 OUT=$2
shift 2
mkdir -p "$OUT"
say() { echo "[recipe $(date -u +%H:%M:%S)] $*"; }

if [ -z "${PLAIN_TEXT:-}" ]; then  # a chat template lives in chat_template.jinja or tokenizer_config.json
  PLAIN_TEXT=1
  if [ -f "$MODEL/chat_template.jinja" ] || grep -qs '"chat_template"' "$MODEL/tokenizer_config.json"; then
    PLAIN_TEXT=0
  fi
fi
FORMAT=()
[ "$PLAIN_TEXT" = 1 ] && FORMAT=(--plain-text)
DEVICE_FLAG=()
[ -n "${DEVICE:-}" ] && DEVICE_FLAG=(--device "$DEVICE")
HEAD_TYPE=${HEAD_TYPE:-eagle3}
read -r -a DISTILL_EXTRA <<< "${DISTILL_FLAGS:-}"
read -r -a TRAIN_EXTRA <<< "${TRAIN_FLAGS:-}"
read -r -a BENCH_EXTRA <<< "${BENCH_FLAGS:-}"

PROMPTS=("$@")
if [ ${#PROMPTS[@]} -eq 0 ]; then  # the committed pools, chat, instructions, code and math: 1,000 prompts
  P=$(bash "$ROOT/training/data/prompts/unpack.sh" "$OUT/prompts")
  PROMPTS=("$P/oasst_prompt_lottery_en_250.jsonl" "$P/self_instruct_user_oriented_instructions.jsonl:250"
           "$P/self_instruct_seed_tasks.jsonl" "$P/oasst1_val_prompts_qlora_oa_questions.jsonl:125"
           "$P/mbpp.jsonl:100" "$P/gsm8k_train.jsonl:100")
fi

say "1/4 distill: the model answers ${#PROMPTS[@]} prompt file(s) (format: $([ "$PLAIN_TEXT" = 1 ] && echo plain text \
|| echo its chat template)); stops by itself if most answers are degenerate"
medusa-spec distill --model "$MODEL" --prompts "${PROMPTS[@]}" --output "$OUT/conversations.jsonl" "${FORMAT[@]}" \
  --max-new-tokens "${MAX_NEW_TOKENS:-256}" --batch-size "${BATCH:-64}" "${DEVICE_FLAG[@]}" "${DISTILL_EXTRA[@]}"

HEAD_FLAGS=(--head-type "$HEAD_TYPE" --num-heads "${NUM_HEADS:-3}")
case $HEAD_TYPE in
  eagle3) HEAD_FLAGS+=(--heads-target teacher);;
  eagle|medusa) ;;
  *) echo "HEAD_TYPE: eagle3, medusa or eagle, not $HEAD_TYPE" >&2; exit 2;;
esac
if [ "$HEAD_TYPE" != medusa ] && [ "${DRAFT_VOCAB:-4096}" != 0 ]; then HEAD_FLAGS+=(--draft-vocab "${DRAFT_VOCAB:-4096}"); fi
RESUME=()
[ -d "$OUT/heads/checkpoints" ] && RESUME=(--resume)
if [ -f "$OUT/heads/medusa_config.json" ]; then
  say "2/4 train: $OUT/heads is trained already (delete it to train again)"
else
  say "2/4 train: $HEAD_TYPE heads on the answers, at most ${EPOCHS:-2} epochs or ${MINUTES:-120} minutes"
  medusa-spec train --model "$MODEL" --data "$OUT/conversations.jsonl" --output "$OUT/heads" "${FORMAT[@]}" \
    "${HEAD_FLAGS[@]}" --max-length 512 --batch-size 4 --epochs "${EPOCHS:-2}" --time-limit "${MINUTES:-120}" \
    --lr 5e-4 --warmup-steps 30 --eval-examples 40 --eval-ranks 8 --save-every 50 --log-every 10 \
    --mixed-precision no "${RESUME[@]}" "${TRAIN_EXTRA[@]}"  # the device: accelerate's (a GPU where there is one)
fi

# bench tokenizes a prompt with the chat template, else as it is: for the plain format, write the prompts in it.
BENCH_FILE=$OUT/bench_prompts.jsonl
python3 - "${BENCH_PROMPTS:-$ROOT/medusa_spec/data/mt_bench_question.jsonl}" "$BENCH_FILE" "$PLAIN_TEXT" \
  "${BENCH_N:-8}" <<'EOF'
import json, sys
source, target, plain, n = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
records = [json.loads(line) for line in open(source) if line.strip()]
first = {}
for record in records:
    first.setdefault(record.get("category"), record)
chosen = (list(first.values()) + [r for r in records if r not in first.values()])[:n]
with open(target, "w") as f:
    for record in chosen:
        text = record["turns"][0] if "turns" in record else record["prompt"]
        text = f"User: {text}\n\nAssistant:" if plain else text
        f.write(json.dumps({"category": record.get("category") or "prompts", "prompt": text}) + "\n")
EOF
say "3/4 bench: transformers' greedy generate against the heads, on $(wc -l < "$BENCH_FILE") prompts"
medusa-spec bench --model "$MODEL" --heads "$OUT/heads" --prompts "$BENCH_FILE" --output "$OUT/bench" \
  --methods hf_greedy medusa_off medusa_greedy --lookup 0 "${DEVICE_FLAG[@]}" "${BENCH_EXTRA[@]}"
python3 - "$OUT/bench/bench.json" <<'EOF'
import json, sys
overall = json.load(open(sys.argv[1]))["summary"]["overall"]
equal = overall["medusa_greedy"]["equal_to_reference"]
print(f"heads: {overall['medusa_greedy']['tokens_per_step']} tokens/step, {overall['medusa_greedy']['speedup']}x "
      f"transformers' greedy generate; outputs identical: {equal:.0%}")
if equal < 1:  # a near-tie of the top two logits (~1e-6 in fp32) may go either way: README, Limits; else a bug
    print("WARNING: some outputs differ from transformers' greedy generate: compare them in bench.json's records")
EOF

case $HEAD_TYPE in
  eagle3) TO=speculators;;
  medusa) TO=vllm;;
  *) TO=;;
esac
if [ -n "$TO" ]; then
  rm -rf "$OUT/serve"
  say "4/4 convert: $OUT/serve in the $TO format"
  medusa-spec convert "$OUT/heads" "$OUT/serve" --to "$TO" --model "$MODEL"
else
  say "4/4 convert: $HEAD_TYPE heads have no serving format; medusa-spec generate --heads $OUT/heads runs them"
fi
say "done: heads $OUT/heads, report $OUT/bench/bench.md${TO:+, serving folder $OUT/serve}"
