"""Same-process A/B of a DFlash draft against the shipped eagle heads on SmolLM2-135M-Instruct, eager: per prompt,
transformers' greedy generate, speculation off (tree=[]), the eagle heads (tree=None), the DFlash draft's chain (its 7
drafted slots) and the DFlash draft on trees grown from its held-out rank accuracies (the last evaluation in the run's
train_log.jsonl, tree.grow_tree), in an order that rotates from prompt to prompt; every output checked against
transformers'. Prints tokens/s, tokens per step, the ratio to transformers and to tree=[], and writes the records.

    python experiments/2026-12-07-dflash/ab_dflash.py --dflash runs/dflash --trees 4 6 \
        --prompts medusa_spec/data/mt_bench_question.jsonl --per-category 1 --output ab-mt.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from medusa_spec import MedusaModel, default_model, generate_with_dflash, load_dflash
from medusa_spec.bench import MT_BENCH, encode, read_eval_prompts, run_method
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.tree import grow_tree


def last_rank_accuracy(run: Path) -> list[list[float]]:
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return next(r["eval"]["rank_accuracy"] for r in reversed(records) if "rank_accuracy" in r.get("eval", {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dflash", required=True)
    parser.add_argument("--rank-accuracy", default=None, help="a JSON file of them (default: the run's log)")
    parser.add_argument("--trees", type=int, nargs="*", default=[4, 6])
    parser.add_argument("--prompts", nargs="+", default=[str(MT_BENCH)])
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()))
    heads = MedusaModel.from_pretrained(base, default_model.shipped_heads())
    draft = load_dflash(args.dflash, base)
    accuracy = json.loads(Path(args.rank_accuracy).read_text()) if args.rank_accuracy else \
        last_rank_accuracy(Path(args.dflash))
    trees = {"dflash_chain": None, **{f"dflash_tree{n}": grow_tree(accuracy, n) for n in args.trees}}
    methods = ["transformers", "off", "eagle_heads", *trees]

    def run(method: str, ids: torch.Tensor, new: int) -> dict:
        if method in trees:
            start = time.perf_counter()
            out = generate_with_dflash(base, draft, ids, torch.ones_like(ids), max_new_tokens=new, tree=trees[method])
            return {"new_tokens": out.stats.new_tokens[0], "seconds": time.perf_counter() - start,
                    "steps": out.stats.row_steps[0], "sequence": out.sequences[0]}
        name = {"transformers": "hf_greedy", "off": "medusa_off", "eagle_heads": "medusa_greedy"}[method]
        return run_method(name, heads, ids, new, None)

    prompts = read_eval_prompts(args.prompts, args.per_category)
    warm = encode(tokenizer, prompts[0][1])
    for method in methods:  # untimed: a first call's one-off costs
        run(method, warm, 16)
    records = []
    for i, (category, text) in enumerate(prompts):
        ids = encode(tokenizer, text)
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        row = {"category": category}
        for method in order:
            r = run(method, ids, args.max_new_tokens)
            row[method] = {"new_tokens": r["new_tokens"], "seconds": r["seconds"], "steps": r["steps"],
                           "sequence": r["sequence"].tolist()}
        for method in methods[1:]:
            row[method]["identical"] = row[method].pop("sequence") == row["transformers"]["sequence"]
        row["transformers"].pop("sequence")
        records.append(row)
        print(category, {m: round(row[m]["new_tokens"] / row[m]["seconds"], 1) for m in methods}, flush=True)
    summary = {}
    for method in methods:
        tokens = sum(r[method]["new_tokens"] for r in records)
        seconds = sum(r[method]["seconds"] for r in records)
        steps = sum(r[method]["steps"] for r in records)
        summary[method] = {"tokens_per_s": round(tokens / seconds, 2), "tokens_per_step": round(tokens / steps, 3),
                           "identical": sum(r[method].get("identical", True) for r in records)}
    for method in methods:
        summary[method]["x_transformers"] = round(summary[method]["tokens_per_s"] /
                                                  summary["transformers"]["tokens_per_s"], 3)
        summary[method]["x_off"] = round(summary[method]["tokens_per_s"] / summary["off"]["tokens_per_s"], 3)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"commit": commit, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "prompts": [Path(p).name for p in args.prompts], "per_category": args.per_category,
            "max_new_tokens": args.max_new_tokens, "dflash": Path(args.dflash).name, "rank_accuracy": accuracy,
            "trees": {name: tree for name, tree in trees.items()}}
    Path(args.output).write_text(json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1) + "\n")
    for method, s in summary.items():
        print(f"{method:14s} {s['tokens_per_s']:6.1f} tok/s  {s['tokens_per_step']:.2f} tok/step  "
              f"{s['x_transformers']:.2f}x transformers  {s['x_off']:.2f}x off  identical {s['identical']}/"
              f"{len(records)}")


if __name__ == "__main__":
    main()
