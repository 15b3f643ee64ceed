"""Same-process A/B of head adapters with compile=True (issue 56): per prompt, transformers' greedy generate,
speculation off (tree=[]) and each adapter with tree=None, all of this library's methods through compiled graphs,
in an order that rotates from prompt to prompt; every output checked against transformers'. Each prompt set is
summed on its own (MT-bench and the other task types have categories of the same name), all in one process, so the
graphs compile once. A training job (`medusa-spec train`) is stopped (SIGSTOP) for the timed prompts only: it may run
while the graphs compile.

    MEDUSA_SPEC_STEP_COSTS=0 python experiments/2026-12-07-eagle3-compiled/ab.py \
        --heads heads/smollm2-135m-instruct heads/smollm2-135m-instruct-eagle3 --output DIR [--gguf FILE]

--gguf (added in the fifteenth session, ../2026-12-07-verify-profile/): llama.cpp's plain greedy decoding of that file
as one more method, "llama.cpp" (bench's llama_cpp).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
from pathlib import Path

import torch

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, LlamaCpp, encode, eos_ids, read_eval_prompts, run_method
from medusa_spec.train.load import load_model_and_tokenizer

SETS = {"mt-bench": MT_BENCH, "other-tasks": MT_BENCH.with_name("other_tasks_question.jsonl")}


def training_jobs() -> list[int]:
    found = subprocess.run(["pgrep", "-f", "medusa-spec train"], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run(method: str, models: dict, ids: torch.Tensor, max_new_tokens: int, llama: LlamaCpp | None = None) -> dict:
    first = next(iter(models.values()))
    name = {"transformers": "hf_greedy", "off": "medusa_off", "llama.cpp": "llama_cpp"}.get(method, "medusa_greedy")
    return run_method(name, models.get(method, first), ids, max_new_tokens, None, llama=llama, compile=True)


def summarise(records: list[dict], methods: list[str]) -> dict:
    summary = {}
    for method in methods:
        tokens = sum(r[method]["new_tokens"] for r in records)
        seconds = sum(r[method]["seconds"] for r in records)
        steps = sum(r[method]["steps"] for r in records)
        s = {"tokens_per_s": round(tokens / seconds, 2), "tokens_per_step": round(tokens / steps, 3),
             "identical": sum(r[method].get("identical", True) for r in records)}
        timed = sum(r[method].get("timed_steps", 0) for r in records)
        if timed:
            stages = {}
            for r in records:
                for stage, sec in r[method]["stage_seconds"].items():
                    stages[stage] = stages.get(stage, 0.0) + sec
            s["ms_per_step"] = {k: round(1000 * v / timed, 2) for k, v in stages.items() if v}
        nodes = [r[method]["mean_tree_nodes"] for r in records if "mean_tree_nodes" in r[method]]
        if nodes:
            s["mean_tree_nodes"] = round(sum(nodes) / len(nodes), 2)
        summary[method] = s
    for method in methods:
        summary[method]["x_transformers"] = round(summary[method]["tokens_per_s"] /
                                                  summary["transformers"]["tokens_per_s"], 3)
        summary[method]["x_off"] = round(summary[method]["tokens_per_s"] / summary["off"]["tokens_per_s"], 3)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", required=True)
    parser.add_argument("--gguf", default=None, help="a GGUF of the same weights: llama.cpp as one more method")
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()))
    models = {Path(h).name: MedusaModel.from_pretrained(base, h) for h in args.heads}
    methods = ["transformers", "off", *models] + (["llama.cpp"] if args.gguf else [])
    llama = LlamaCpp(args.gguf, 4096, torch.get_num_threads(), eos_ids(base)) if args.gguf else None
    # Untimed: every graph (verify blocks, draft layers) compiles and every tree size is priced at the first calls.
    warm = encode(tokenizer, "Hello")
    for method in methods:
        run(method, models, warm, 4, llama)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for name in args.sets:
        prompts = read_eval_prompts([str(SETS[name])], args.per_category)
        paused = training_jobs()
        signal_all(paused, signal.SIGSTOP)
        try:
            records = []
            for i, (category, text) in enumerate(prompts):
                ids = encode(tokenizer, text)
                row = {"category": category}
                for method in methods[i % len(methods):] + methods[: i % len(methods)]:
                    r = run(method, models, ids, args.max_new_tokens, llama)
                    r["sequence"] = r["sequence"].tolist()
                    row[method] = r
                for method in methods[1:]:
                    row[method]["identical"] = row[method].pop("sequence") == row["transformers"]["sequence"]
                row["transformers"].pop("sequence")
                records.append(row)
                print(name, category, {m: round(row[m]["new_tokens"] / row[m]["seconds"], 1) for m in methods},
                      flush=True)
        finally:
            signal_all(paused, signal.SIGCONT)
        summary = summarise(records, methods)
        meta = {"commit": commit, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                "compile": True, "prompts": SETS[name].name, "per_category": args.per_category,
                "max_new_tokens": args.max_new_tokens, "heads": [str(h) for h in args.heads],
                "gguf": Path(args.gguf).name if args.gguf else None,
                "training_job_paused": bool(paused)}
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "summary": summary, "records": records},
                                                     indent=1) + "\n")
        for method, s in summary.items():
            print(f"{name:12s} {method:32s} {s['tokens_per_s']:6.1f} tok/s  {s['tokens_per_step']:.3f} tok/step  "
                  f"{s['x_transformers']:.2f}x transformers  {s['x_off']:.2f}x off  "
                  f"identical {s['identical']}/{len(records)}  {s.get('mean_tree_nodes', '')}  "
                  f"{s.get('ms_per_step', '')}", flush=True)


if __name__ == "__main__":
    main()
