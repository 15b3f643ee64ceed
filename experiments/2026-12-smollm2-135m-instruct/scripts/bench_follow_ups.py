"""Distillation with follow-up turns on this machine: `distill()` on the first N prompts of one pool, every
conversation given a model-written second turn (--follow-ups 1.0), the default model in fp32. Prints the
answer tokens/s and the prompt tokens run by one-row prefills, where a conversation's later turns show: the
engine prefills only what the row that held the turn before lacks. Compare two checkouts by running it in
each (PYTHONPATH=CHECKOUT), with nothing else on the machine:

    python scripts/bench_follow_ups.py [--prompts 128] [--rows 64] [--new 128] [--output DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from medusa_spec import default_model
from medusa_spec.prompts import read_prompts
from medusa_spec.train.distill import DistillConfig, distill

POOL = Path(__file__).resolve().parents[2] / "shared" / "data" / "train" / "oasst_prompt_lottery_en_250.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new", type=int, default=128, help="max new tokens per answer")
    parser.add_argument("--output", help="keep the conversations here (to compare two checkouts' answers)")
    args = parser.parse_args()
    path = default_model.prepare()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = read_prompts(POOL, limit=args.prompts)
    prefill = {"prefill_tokens": 0, "prefills": 0}

    def count(_, args, kwargs):
        if kwargs["input_ids"].shape[0] == 1:  # a decoding step runs every row; a prefill one
            prefill["prefill_tokens"] += kwargs["input_ids"].shape[1]
            prefill["prefills"] += 1

    hook = model.register_forward_pre_hook(count, with_kwargs=True)
    with tempfile.TemporaryDirectory() as scratch:
        cfg = DistillConfig(prompts=[str(POOL)], output=args.output or f"{scratch}/out", batch_size=args.rows,
                            max_new_tokens=args.new, max_prompt_tokens=640, follow_ups=1.0)
        stats = distill(model, tokenizer, prompts, cfg, progress=False)
    hook.remove()
    print(json.dumps({**stats, **prefill}))


if __name__ == "__main__":
    main()
