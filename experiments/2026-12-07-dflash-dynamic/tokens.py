"""Tokens per step (no clock) of the first DFlash draft for SmolLM2-135M-Instruct (runs/dflash, see
../2026-12-07-dflash/) on static trees grown from its held-out rank accuracies and on DynamicTrees of the same sizes
(no step costs: every step its `nodes`), greedy, 128 new tokens, one prompt per category; every output checked
against transformers'. Counts, not times: they do not move with the machine's load.

    python experiments/2026-12-07-dflash-dynamic/tokens.py --dflash runs/dflash --sizes 4 6 8 \
        --prompts medusa_spec/data/mt_bench_question.jsonl medusa_spec/data/other_tasks_question.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from medusa_spec import DynamicTree, default_model, generate_with_dflash, load_dflash
from medusa_spec.bench import encode, read_eval_prompts
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.tree import grow_tree


def last_rank_accuracy(run: Path) -> list[list[float]]:
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return next(r["eval"]["rank_accuracy"] for r in reversed(records) if "rank_accuracy" in r.get("eval", {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dflash", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 6, 8])
    parser.add_argument("--prompts", nargs="+", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()))
    draft = load_dflash(args.dflash, base)
    accuracy = last_rank_accuracy(Path(args.dflash))
    trees = {"chain": None}
    for n in args.sizes:
        trees[f"static{n}"] = grow_tree(accuracy, n)
        trees[f"dynamic{n}"] = DynamicTree(n)
    for path in args.prompts:
        prompts = read_eval_prompts([path], 1)
        totals = {name: [0, 0] for name in trees}
        for prompt in prompts:
            ids = encode(tokenizer, prompt[1])
            with torch.no_grad():
                expected = base.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens)
            for name, tree in trees.items():
                out = generate_with_dflash(base, draft, ids, max_new_tokens=args.max_new_tokens, tree=tree)
                assert torch.equal(out.sequences, expected), (name, prompt[0])
                totals[name][0] += out.stats.new_tokens[0]
                totals[name][1] += out.stats.row_steps[0]
        print(json.dumps({"prompts": Path(path).name, "count": len(prompts),
                          "tokens_per_step": {name: round(t / s, 3) for name, (t, s) in totals.items()}}), flush=True)


if __name__ == "__main__":
    main()
