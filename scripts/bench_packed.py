"""Packed weights on and off (`MedusaModel.packed_weights`), alternating prompt by prompt in one process.

    python scripts/bench_packed.py [--heads DIR] [--prompts FILE] [--per-category 1] [--max-new-tokens 128]
                                   [--lookup 10] [--batch 1]

For each prompt (MT-bench first turns by default, `--per-category` per category), greedy, `tree=None`: the heads
alone and the heads with a lookup chain of `--lookup` tokens (the CLI default), each with the packed copies and
without (`packed_weights = None`: column-wise products only), in turns. With `--batch N`, N prompts at a time
(left-padded). Prints seconds, tokens per step and the speed-up of packed over column-wise for each method, and
checks that both give the same tokens. `tree=None`'s tables are measured first for both, outside the timings. Run
it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, read_eval_prompts
from medusa_spec.columnwise import PackedWeights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default=str(default_model.shipped_heads()))
    parser.add_argument("--prompts", type=Path, default=MT_BENCH)
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--lookup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    path = default_model.prepare()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    modes = {"column-wise": MedusaModel.from_pretrained(model, args.heads),
             "packed": MedusaModel.from_pretrained(model, args.heads)}
    modes["column-wise"].packed_weights = None
    modes["packed"].packed_weights = PackedWeights()
    prompts = [text for _, text in read_eval_prompts(args.prompts, per_category=args.per_category)]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for mm in modes.values():  # tables measured (and packing done) outside the timings
        mm.tree_table(args.batch)
        mm.generate(tokenizer(texts[:1], return_tensors="pt").input_ids, max_new_tokens=4)
    methods = {"heads alone": 0, f"heads + lookup {args.lookup}": args.lookup}
    seconds = {(m, p): 0.0 for m in methods for p in modes}
    steps = dict.fromkeys(seconds, 0)
    new_tokens, same = dict.fromkeys(methods, 0), dict.fromkeys(methods, 0)
    for start in range(0, len(texts), args.batch):
        batch = tokenizer(texts[start: start + args.batch], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        for method, lookup in methods.items():
            outputs = {}
            for name, mm in modes.items():
                began = time.perf_counter()
                out = mm.generate(batch.input_ids, batch.attention_mask, max_new_tokens=args.max_new_tokens,
                                  pad_token_id=pad, lookup_tokens=lookup)
                seconds[method, name] += time.perf_counter() - began
                steps[method, name] += out.stats.steps
                outputs[name] = out.sequences
            new_tokens[method] += int((outputs["packed"][:, batch.input_ids.shape[1]:] != pad).sum())
            same[method] += int(torch.equal(outputs["packed"], outputs["column-wise"]))
    batches = -(-len(texts) // args.batch)
    for method in methods:
        col, packed = seconds[method, "column-wise"], seconds[method, "packed"]
        print(f"{method}: column-wise {col:.1f} s ({steps[method, 'column-wise']} steps), packed {packed:.1f} s "
              f"({steps[method, 'packed']} steps), packed {col / packed:.3f}x; {new_tokens[method]} new tokens, "
              f"{same[method]}/{batches} batches identical")


if __name__ == "__main__":
    main()
