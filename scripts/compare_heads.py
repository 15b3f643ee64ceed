"""Held-out accuracy of several adapters on the same conversations, none of which any of them trained on.

The held-out set is sampled as `medusa-spec train` holds one out (--eval-examples, --seed) from the conversations in
--data that no adapter trained on: those listed in the --exclude files (the trained_conversations.txt that
`medusa-spec train` writes beside each adapter) are left out first. For each adapter: per-head top-1 and top-8
accuracy against the base's greedy tokens, and the expected tokens per step of the best 4- and 8-node trees grown
from them.

    python scripts/compare_heads.py --data training/data/smollm2-135m-instruct \\
        --heads heads/smollm2-135m-instruct runs/smollm2-dependent-more \\
        --exclude runs/smollm2-dependent-more/trained_conversations.txt
"""

from __future__ import annotations

import argparse
import json

from accelerate import Accelerator

from medusa_spec import MedusaModel, default_model
from medusa_spec.autotree import expected_tokens_per_step
from medusa_spec.base import inspect_base_model
from medusa_spec.train.data import make_rows, read_conversations, tokenize_conversation
from medusa_spec.train.evaluate import evaluate
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.loop import split_held_out, without_excluded
from medusa_spec.train.module import TrainModule
from medusa_spec.tree import grow_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True)
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--eval-examples", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", nargs="+", default=[], metavar="FILE")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-ranks", type=int, default=8)
    args = parser.parse_args()

    conversations = without_excluded([m for path in args.data for m in read_conversations(path)], args.exclude)
    _, held_out = split_held_out(conversations, args.eval_examples, args.seed)
    clean = [conversations[i] for i in held_out]

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
