"""Held-out accuracy of several adapters on the same conversations, none of which any of them trained on.

The held-out set is the one `medusa-spec train` holds out (--eval-examples, --seed) from the conversations in --data,
less the conversations an earlier run trained on (--trained-on), so an adapter trained on other data than the
newest run's is not measured on its own training answers. For each adapter: per-head top-1 and top-8 accuracy
against the base's greedy tokens, and the expected tokens per step of the best 4- and 8-node trees grown from them.

    python scripts/compare_heads.py --data training/data/smollm2-135m-instruct \\
        --heads heads/smollm2-135m-instruct runs/smollm2-dependent-continued --trained-on 5854:1600

--trained-on FIRST:COUNT: a run trained on COUNT conversations sampled from the first FIRST conversations of --data,
as `train` sampled them before held-out beginnings were filtered (the seeded shuffle's items 40 .. 40 + COUNT).
"""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator

from medusa_spec import MedusaModel, default_model
from medusa_spec.autotree import expected_tokens_per_step
from medusa_spec.base import inspect_base_model
from medusa_spec.train.data import make_rows, read_conversations, tokenize_conversation
from medusa_spec.train.evaluate import evaluate
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.loop import first_exchange, split_held_out
from medusa_spec.train.module import TrainModule
from medusa_spec.tree import grow_tree


def earlier_sample(conversations: list, first: int, count: int, seed: int, held_out: int = 40) -> list:
    """The training sample of a run on conversations[:first] under the split without held-out filtering."""
    order = torch.randperm(first, generator=torch.Generator().manual_seed(seed)).tolist()
    return [conversations[i] for i in order[held_out: held_out + count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--eval-examples", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trained-on", action="append", default=[], metavar="FIRST:COUNT")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-ranks", type=int, default=8)
    args = parser.parse_args()

    conversations = [m for path in args.data for m in read_conversations(path)]
    _, held_out = split_held_out(conversations, args.eval_examples, args.seed)
    seen = set()
    for spec in args.trained_on:
        first, count = map(int, spec.split(":"))
        seen |= {first_exchange(m) for m in earlier_sample(conversations, first, count, args.seed)}
    clean = [conversations[i] for i in held_out if first_exchange(conversations[i]) not in seen]
    print(f"{len(held_out)} held out, {len(clean)} of them trained on by no adapter")

    base_model, tokenizer = load_model_and_tokenizer(str(default_model.prepare()), "float32")
    rows = make_rows([tokenize_conversation(tokenizer, m) for m in clean], args.max_length, pack=True)
    spec = inspect_base_model(base_model)
    for heads in args.heads:
        medusa = MedusaModel.from_pretrained(base_model, heads)
        module = TrainModule(base_model, medusa.heads, spec.bool_mask, spec.takes_logits_to_keep)
        metrics = evaluate(module, rows, args.batch_size, tokenizer.pad_token_id, args.eval_ranks, Accelerator())
        accuracy = metrics["rank_accuracy"]
        print(json.dumps({"heads": heads, "positions": metrics["positions"][0], "top1": metrics["top1"],
                          f"top{args.eval_ranks}": metrics[f"top{args.eval_ranks}"],
                          **{f"expected_{n}_nodes": round(expected_tokens_per_step(grow_tree(accuracy, n), accuracy), 3)
                             for n in (4, 8)}}))


if __name__ == "__main__":
    main()
