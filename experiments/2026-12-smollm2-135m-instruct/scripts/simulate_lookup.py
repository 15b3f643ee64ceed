"""Tokens per step of lookup sources beside the heads, counted without a clock on the benchmark's kept answers.

    python scripts/simulate_lookup.py [--heads DIR] [--data DIR] [--answers FILE ...] [--max-new-tokens 128]

Teacher-forced: the base model's greedy answers (`--answers`, as scripts/compare_heads.py keeps them) are decoded
step by step as the loop would, without running it. Each step accepts what the heads' 4-node tree
`[[0], [0, 0], [1]]` gets right (the heads read the base's hidden states of the answer, as at decoding time) or, when
a source has a chain, what the chain gets right instead (at batch 1 a chain replaces the tree for that step, in as
many rows: 3 tokens). Sources:

- `prompt lookup`: lookup.py's own chain beside a tree (the text's last 3 tokens seen before in the prompt or the
  answer so far);
- `datastore`: the longest match of at least `--min-match` tokens (up to 8) in the distilled answers of `--data`
  (REST: the model's own earlier text), continued by the most frequent next token at each depth over its latest
  1,024 occurrences, only where at least `--min-share` of them agree on the first one; tried where prompt lookup
  has no chain.

Prints tokens per step per answer file for the tree alone, with prompt lookup, and with both.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np
import torch

from medusa_spec import MedusaModel, default_model
from medusa_spec.base import inspect_base_model
from medusa_spec.lookup import MIN_NGRAM_WITH_TREE, NgramIndex, lookup_chain
from medusa_spec.train.data import read_conversations, tokenize_conversation
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.module import TrainModule

CHAIN = 3  # tokens of a chain that replaces the 4-node tree
MAX_MATCHES = 1024


class Datastore:
    """The answers' tokens and, for each n-gram size (8 down to min_match), the n-grams' hashes sorted, with the
    position after each: a match is a binary search, checked token by token."""

    def __init__(self, answers: list[list[int]], min_match: int):
        self.tokens = np.concatenate([np.array(answer + [-1], dtype=np.int64) for answer in answers])  # -1: a border
        self.sizes = range(8, min_match - 1, -1)
        self.index = {}
        for n in self.sizes:
            windows = np.lib.stride_tricks.sliding_window_view(self.tokens, n)[:-1]  # each with a token after it
            keep = np.nonzero((windows >= 0).all(1) & (self.tokens[n:] >= 0))[0]
            keys = ngram_hash(windows[keep])
            order = np.argsort(keys, kind="stable")
            self.index[n] = (keys[order], keep[order] + n)

    def chain(self, context: list[int], min_share: float) -> list[int]:
        for n in self.sizes:
            if len(context) < n:
                continue
            keys, after = self.index[n]
            key = ngram_hash(np.array([context[-n:]], dtype=np.int64))[0]
            # The latest MAX_MATCHES matches (positions in order within one hash): a common phrase has thousands.
            starts = after[np.searchsorted(keys, key, "left"): np.searchsorted(keys, key, "right")][-MAX_MATCHES:]
            starts = starts[(np.lib.stride_tricks.sliding_window_view(self.tokens, n)[starts - n]
                             == context[-n:]).all(1)]  # hashes may collide
            if len(starts):
                chain = []
                for depth in range(CHAIN):
                    next_tokens = self.tokens[np.minimum(starts + depth, len(self.tokens) - 1)]
                    values, counts = np.unique(next_tokens, return_counts=True)
                    best = counts.argmax()
                    if values[best] < 0 or (depth == 0 and counts[best] < min_share * len(starts)):
                        break
                    chain.append(int(values[best]))
                    starts = starts[next_tokens == values[best]]
                return chain
        return []


def ngram_hash(windows: np.ndarray) -> np.ndarray:
    """[N, n] token ids -> [N] uint64 hashes (polynomial, wrapping)."""
    keys = np.zeros(len(windows), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in windows.T:
            keys = keys * np.uint64(1000003) + (column + 2).astype(np.uint64)
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default=str(default_model.shipped_heads()))
    parser.add_argument("--data", default="training/data/smollm2-135m-instruct")
    parser.add_argument("--answers", nargs="+", default=["experiments/2026-12-smollm2-135m-instruct/answers-mt.jsonl",
                                                         "experiments/2026-12-smollm2-135m-instruct/answers-other.jsonl"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--min-match", type=int, default=5)
    parser.add_argument("--min-share", type=float, default=0.6)
    args = parser.parse_args()
    base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()), "float32")
    spec = inspect_base_model(base)
    mm = MedusaModel.from_pretrained(base, args.heads)
    module = TrainModule(base, mm.heads, spec.bool_mask, spec.takes_logits_to_keep).eval()
    answers = [m["content"] for c in read_conversations(args.data) for m in c if m["role"] == "assistant"]
    store = Datastore(tokenizer(answers, add_special_tokens=False).input_ids, args.min_match)
    print(f"datastore: {len(store.tokens):,} tokens of {len(answers):,} answers", flush=True)
    for path in args.answers:
        totals = Counter()
        for record in map(json.loads, open(path, encoding="utf-8")):
            example = tokenize_conversation(tokenizer, record["messages"], keep_loops=True)
            x = example.input_ids
            ids = torch.tensor([x])
            with torch.no_grad():
                out = module(ids, torch.arange(len(x))[None], torch.ones_like(ids), base_logits=True,
                             greedy_paths=True)
                top2 = module.heads.project(out.head_states, base.get_output_embeddings())[0].topk(2, -1).indices
            if module.heads.token_map is not None:
                top2 = module.heads.token_map[top2]
            first = example.loss_mask.index(True)
            last = min(first + args.max_new_tokens, first + sum(example.loss_mask), len(x))
            for sources in ("tree", "tree + prompt lookup", "tree + prompt lookup + datastore"):
                i, steps = first - 1, 0  # x[i] the last token committed; the step's root is x[i + 1]
                index = NgramIndex(x[: i + 2])  # prompt lookup's own index of the text, as the loop keeps it
                while i + 1 < last:
                    hit = [j < len(x) and int(t) == x[j] for j, t in ((i + 2, top2[i, 0, 0]), (i + 3, top2[i, 1, 0]),
                                                                     (i + 2, top2[i, 0, 1]))]
                    accepted = 2 if hit[0] and hit[1] else int(hit[0] or hit[2])
                    context = x[: i + 2]
                    chain = (lookup_chain(index, [], CHAIN, MIN_NGRAM_WITH_TREE) if "prompt" in sources else [])
                    if not chain and "datastore" in sources:
                        chain = store.chain(context, args.min_share)
                    if chain:
                        accepted = 0
                        while accepted < len(chain) and i + 2 + accepted < len(x) and chain[accepted] == x[
                                i + 2 + accepted]:
                            accepted += 1
                    steps += 1
                    index.extend(x[i + 2: i + 3 + accepted])
                    i += 1 + accepted
                totals[sources, "tokens"] += last - first
                totals[sources, "steps"] += steps
        print(path, {s: round(totals[s, "tokens"] / totals[s, "steps"], 3)
                     for s in ("tree", "tree + prompt lookup", "tree + prompt lookup + datastore")}, flush=True)


if __name__ == "__main__":
    main()
