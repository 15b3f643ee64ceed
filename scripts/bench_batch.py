"""Batched greedy decoding: the heads alone against transformers' `generate` on the same left-padded batch.

    python scripts/bench_batch.py [--heads DIR] [--batch 4] [--max-new-tokens 128] [--rounds 2]

The first `--batch` MT-bench first turns (one per category) form one batch; each round times transformers'
greedy `generate` and `MedusaModel.generate` (no tree given: the library's own default) on it, alternating,
and checks every row is token-identical. Prints tokens/s of each, the speed-up and tokens per step, measured
in this one run. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=str(default_model.shipped_heads()))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    path = default_model.prepare()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mm = MedusaModel.from_pretrained(model, args.heads)
    prompts = [text for _, text in read_eval_prompts(MT_BENCH, per_category=1)][: args.batch]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    new, seconds, per_step = 0, {"hf": 0.0, "medusa": 0.0}, []
    identical = rows = 0
    for _ in range(args.rounds):
        start = time.perf_counter()
        with torch.inference_mode():
            reference = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad)
        seconds["hf"] += time.perf_counter() - start
        start = time.perf_counter()
        out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
        seconds["medusa"] += time.perf_counter() - start
        width = min(reference.shape[1], out.sequences.shape[1])
        identical += sum(torch.equal(a[:width], b[:width]) for a, b in zip(reference, out.sequences))
        rows += len(prompts)
        new += sum(out.stats.new_tokens)  # transformers' too, where the rows are identical
        per_step.append(out.stats.tokens_per_step)
    rate = {k: new / s for k, s in seconds.items()}
    print(f"batch {len(prompts)}, {args.max_new_tokens} new tokens, {args.rounds} rounds: transformers "
          f"{rate['hf']:.1f} tok/s, medusa_spec {rate['medusa']:.1f} tok/s, {rate['medusa'] / rate['hf']:.2f}x, "
          f"{sum(per_step) / len(per_step):.2f} tokens/step per row, {identical}/{rows} rows identical")


if __name__ == "__main__":
    main()
