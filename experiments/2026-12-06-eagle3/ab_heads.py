"""Same-process A/B of head adapters on SmolLM2-135M-Instruct: per prompt, transformers' greedy generate, speculation
off (tree=[], medusa_spec's kernels) and each adapter with tree=None, in an order that rotates from prompt to prompt;
every output checked against transformers'. Prints tokens/s, tokens per step, the ratio to transformers and the share
against tree=[], and writes the records as JSON.

    python experiments/2026-12-06-eagle3/ab_heads.py \
        --heads heads/smollm2-135m-instruct heads/smollm2-135m-instruct-eagle3 \
        --prompts medusa_spec/data/mt_bench_question.jsonl --per-category 1 --output ab-mt.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import torch

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, encode, read_eval_prompts, run_method
from medusa_spec.train.load import load_model_and_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--prompts", nargs="+", default=[str(MT_BENCH)])
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()))
    models = {Path(h).name: MedusaModel.from_pretrained(base, h) for h in args.heads}
    first = next(iter(models.values()))
    methods = ["transformers", "off", *models]
    prompts = read_eval_prompts(args.prompts, args.per_category)
    # Untimed: the first call's costs (packing the weights, timing the step costs tree=None chooses from) are paid
    # once per process, not per prompt.
    warm = encode(tokenizer, prompts[0][1])
    for method in methods:
        name = {"transformers": "hf_greedy", "off": "medusa_off"}.get(method, "medusa_greedy")
        run_method(name, models.get(method, first), warm, 16, None)
    records = []
    for i, (category, text) in enumerate(prompts):
        ids = encode(tokenizer, text)
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        row = {"category": category}
        for method in order:
            if method == "transformers":
                r = run_method("hf_greedy", first, ids, args.max_new_tokens, None)
            elif method == "off":
                r = run_method("medusa_off", first, ids, args.max_new_tokens, None)
            else:
                r = run_method("medusa_greedy", models[method], ids, args.max_new_tokens, None)
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
            "max_new_tokens": args.max_new_tokens, "heads": [str(h) for h in args.heads]}
    Path(args.output).write_text(json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1) + "\n")
    for method, s in summary.items():
        print(f"{method:32s} {s['tokens_per_s']:6.1f} tok/s  {s['tokens_per_step']:.3f} tok/step  "
              f"{s['x_transformers']:.2f}x transformers  {s['x_off']:.2f}x off  "
              f"identical {s['identical']}/{len(records)}")


if __name__ == "__main__":
    main()
