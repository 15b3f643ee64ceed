"""Packed weights against plain ones, in one run: `MedusaModel.generate` from oneDNN-packed weights (the default on an
x86 CPU in fp32, columnwise.PackedWeights) and from the plain weights, alternating per prompt.

    python scripts/bench_packed.py [--heads DIR] [--max-new-tokens 128] [--batch 4] [--rounds 2]

Greedy, MT-bench first turns (one per category): each prompt alone, then the first `--batch` of them as one
left-padded batch for `--rounds` rounds; `tree=None` (each model measures its own tree table first, untimed) and the
root alone (no speculation). Every output is checked token-identical to transformers' greedy `generate`. Prints
tokens/s of each, packed over plain, tokens/step and the mean tree size. Run it with nothing else on the machine.
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
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    path = default_model.prepare()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    models = {"packed": MedusaModel.from_pretrained(model, args.heads),
              "plain": MedusaModel.from_pretrained(model, args.heads)}
    models["plain"]._packed_weights = None  # the loop then computes from the plain weights, as before packing
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
               for _, text in read_eval_prompts(MT_BENCH, per_category=1)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trees = {"tree=None": None, "root alone": []}
    runs = [("batch 1", [[p] for p in prompts], 1), (f"batch {args.batch}", [prompts[: args.batch]], args.rounds)]
    for label, batches, rounds in runs:
        for mm in models.values():
            mm.default_choices(len(batches[0]))  # the tree table, measured once per batch size, untimed
        seconds, new, steps, nodes, identical, rows = {}, {}, {}, {}, {}, 0
        for number, texts in enumerate(batches * rounds):
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                reference = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                           pad_token_id=pad)
            rows += len(texts)
            order = list(models) if number % 2 == 0 else list(models)[::-1]  # alternate who goes first
            for name in order:
                for tree_name, tree in trees.items():
                    key = (name, tree_name)
                    start = time.perf_counter()
                    out = models[name].generate(inputs.input_ids, inputs.attention_mask,
                                                max_new_tokens=args.max_new_tokens, pad_token_id=pad, tree=tree)
                    seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
                    width = min(reference.shape[1], out.sequences.shape[1])
                    identical[key] = identical.get(key, 0) + sum(
                        torch.equal(a[:width], b[:width]) for a, b in zip(reference, out.sequences))
                    new[key] = new.get(key, 0) + sum(out.stats.new_tokens)
                    steps[key] = steps.get(key, 0) + sum(out.stats.row_steps)
                    nodes.setdefault(key, []).extend(out.stats.tree_sizes or [])
        print(f"{label}, {len(batches) * rounds} generate calls, {args.max_new_tokens} new tokens:")
        for tree_name in trees:
            rates = {name: new[name, tree_name] / seconds[name, tree_name] for name in models}
            for name in models:
                key = (name, tree_name)
                size = f", mean tree {sum(nodes[key]) / len(nodes[key]):.2f} nodes" if nodes[key] else ""
                print(f"  {tree_name}, {name}: {rates[name]:.1f} tok/s, {new[key] / steps[key]:.2f} tokens/step per "
                      f"row{size}, {identical[key]}/{rows} rows identical")
            print(f"  {tree_name}: packed / plain {rates['packed'] / rates['plain']:.2f}x")


if __name__ == "__main__":
    main()
