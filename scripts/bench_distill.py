"""Distillation throughput on this machine: transformers' batched `generate` against the data
engine (medusa_spec.train.engine) on the same prompts, each in fp32 and bf16, beside the machine's
bounds (memory bandwidth and GEMM rate, measured here). Answer tokens per second, one run.

Run it with nothing else on the machine: python scripts/bench_distill.py [--prompts N] [--new N]
[--methods generate engine one-block] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import default_model
from medusa_spec.columnwise import linear
from medusa_spec.train.distill import eos_ids
from medusa_spec.train.engine import Request, decode_stream

POOLS = Path(__file__).resolve().parents[2] / "shared" / "data" / "train"


def machine_bounds() -> dict:
    """Copy bandwidth (GB/s) and a large fp32 / bf16 GEMM rate (GFLOP/s): torch's matmul (MKL in fp32), and the
    fp32 kernel the engine's linear layers take (columnwise.linear: oneDNN on x86)."""
    a = torch.empty(256 * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    start = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    bandwidth = 5 * 2 * a.numel() * 4 / (time.perf_counter() - start) / 1e9
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 4096, dtype=dtype)
        x @ w
        start = time.perf_counter()
        for _ in range(10):
            x @ w
        rates[str(dtype).removeprefix("torch.")] = 10 * 2 * 1024 * 1024 * 4096 / (time.perf_counter() - start) / 1e9
    x, w = torch.randn(1024, 1024), torch.randn(4096, 1024)
    linear(x, w)
    start = time.perf_counter()
    for _ in range(10):
        linear(x, w)
    rates["float32 (engine's linear)"] = 10 * 2 * 1024 * 1024 * 4096 / (time.perf_counter() - start) / 1e9
    return {"copy_GB_per_s": round(bandwidth, 1), "gemm_GFLOP_per_s": {k: round(v) for k, v in rates.items()}}


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts from the chat and math pools, alternating (short and long answers)."""
    chat = [json.loads(line) for line in (POOLS / "oasst_prompt_lottery_en_250.jsonl").read_text().splitlines()]
    math = [json.loads(line)["question"] for line in (POOLS / "gsm8k_train.jsonl").read_text().splitlines()]
    texts = [t for pair in zip(chat, math) for t in pair][:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]


def through_eos(tokens: list[int], eos: set[int]) -> int:
    return next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))


def run_generate(model, tokenizer, asks, new, batch, eos) -> int:
    count = 0
    for first in range(0, len(asks), batch):
        rows = asks[first: first + batch]
        width = max(map(len, rows))
        pad = tokenizer.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             pad_token_id=pad)[:, width:].tolist()
        count += sum(through_eos(t, eos) for t in out)
    return count


def run_engine(model, tokenizer, asks, new, batch, eos, chunk_rows: int = 8) -> int:
    requests = deque(Request(i, a) for i, a in enumerate(sorted(asks, key=len, reverse=True)))
    return sum(len(t) for _, t in decode_stream(model, requests, eos, rows=batch, max_new_tokens=new,
                                               pad_token_id=tokenizer.pad_token_id or 0, chunk_rows=chunk_rows))


def run_engine_one_block(model, tokenizer, asks, new, batch, eos) -> int:
    """The engine with every row in one attention block: each step reads all rows up to the longest one."""
    return run_engine(model, tokenizer, asks, new, batch, eos, chunk_rows=batch)


METHODS = {"generate": ("transformers generate", run_generate), "engine": ("medusa_spec engine", run_engine),
           "one-block": ("medusa_spec engine, one attention block", run_engine_one_block)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new", type=int, default=256, help="max new tokens per answer")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=["generate", "engine"])
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    args = parser.parse_args()
    path = default_model.prepare()
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(json.dumps({"threads": torch.get_num_threads(), **machine_bounds()}))
    asks = prompts(tokenizer, args.prompts)
    for dtype in (getattr(torch, name) for name in args.dtypes):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        eos = eos_ids(model, tokenizer)
        for name, run in (METHODS[m] for m in args.methods):
            start = time.perf_counter()
            with torch.inference_mode():
                tokens = run(model, tokenizer, asks, args.new, args.batch, eos)
            seconds = time.perf_counter() - start
            print(json.dumps({"method": name, "dtype": str(dtype).removeprefix("torch."), "prompts": len(asks),
                              "batch": args.batch, "answer_tokens": tokens, "seconds": round(seconds, 1),
                              "tokens_per_s": round(tokens / seconds, 1)}), flush=True)


if __name__ == "__main__":
    main()
