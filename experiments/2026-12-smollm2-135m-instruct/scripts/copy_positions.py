"""Where heads fail on copied text: head-0 top-1 accuracy split by whether the token copies the text before it.

At each answer position the heads are scored as `compare_heads.py --prompts` scores them (head 0 guesses the base's
greedy token two positions on, teacher-forced on the base's own answers). A position counts as a copy when the lookup
chain that decoding proposes beside a tree there starts with that target: the last 3 tokens known there (the root
token included) occurred earlier in the conversation, prompt included, and the token after their latest earlier
occurrence is the target.
Per category: the share of copy positions, and head 0's top-1 at copy positions and elsewhere.

    E=experiments/2026-12-smollm2-135m-instruct
    PYTHONPATH=scripts python $E/scripts/copy_positions.py --heads heads/smollm2-135m-instruct \\
        --prompts medusa_spec/data/other_tasks_question.jsonl --answers $E/answers-other.jsonl
"""

from __future__ import annotations

import argparse
import json

import torch
from compare_heads import answered_prompts

from medusa_spec import MedusaModel, default_model
from medusa_spec.base import inspect_base_model
from medusa_spec.lookup import MIN_NGRAM_WITH_TREE, NgramIndex, lookup_chain
from medusa_spec.train.data import collate, tokenize_conversation
from medusa_spec.train.evaluate import head_hits
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.module import TrainModule


def copied(ids: list[int], targets: list[int]) -> list[bool]:
    """copied[t]: the lookup chain that decoding beside a tree proposes at t (lookup.lookup_chain after a match of
    MIN_NGRAM_WITH_TREE = 3 tokens, in the text ids[: t + 2] known there) starts with targets[t], the token at t + 2."""
    known, flags = NgramIndex(ids[:1]), []
    for t, target in enumerate(targets):
        known.extend([ids[t + 1]])
        flags.append(lookup_chain(known, [], 1, MIN_NGRAM_WITH_TREE) == [target])
    return flags


def count(module, tokenizer, records: list[dict]) -> dict[str, list[int]]:
    """Per category: [copy positions, head-0 hits there, other positions, head-0 hits there]."""
    counts = {}
    for record in records:
        batch = collate([[tokenize_conversation(tokenizer, record["messages"], keep_loops=True)]],
                        tokenizer.pad_token_id or 0)
        with torch.no_grad():
            out = module(batch["input_ids"], batch["position_ids"], batch["segment_ids"], base_logits=True,
                         greedy_paths=True)
            logits = module.heads.project(out.head_states, module.base_model.get_output_embeddings())
        greedy = out.base_logits.argmax(dim=-1)
        hit, valid = head_hits(logits, greedy, batch["loss_mask"], batch["segment_ids"], 0, 1, module.heads.token_map)
        hits, valid = hit[0, :, 0].tolist(), valid[0].tolist()
        targets = greedy[0, 1:-1].tolist()  # the base's greedy token at t + 2
        c = counts.setdefault(record["category"], [0, 0, 0, 0])
        for ok, hit, copy in zip(valid, hits, copied(batch["input_ids"][0].tolist(), targets)):
            if ok:
                c[0 if copy else 2] += 1
                c[1 if copy else 3] += hit
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", required=True)
    parser.add_argument("--prompts", nargs="+", required=True, help="evaluation prompt files (FILE or FILE:N)")
    parser.add_argument("--answers", help="the base's answers, kept as compare_heads.py keeps them")
    parser.add_argument("--model", help="the base model (default: the default model)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    base_model, tokenizer = load_model_and_tokenizer(args.model or str(default_model.prepare()), "float32")
    records = answered_prompts(base_model, tokenizer, args.prompts, args.answers, args.max_new_tokens)
    spec = inspect_base_model(base_model)
    medusa = MedusaModel.from_pretrained(base_model, args.heads)
    module = TrainModule(base_model, medusa.heads, spec.bool_mask, spec.takes_logits_to_keep).eval()
    counts = count(module, tokenizer, records)
    counts["all"] = [sum(c[i] for c in counts.values()) for i in range(4)]
    for text, (copies, copy_hits, others, other_hits) in counts.items():
        print(json.dumps({"heads": args.heads, "text": text, "positions": copies + others,
                          "copy_share": round(copies / max(copies + others, 1), 3),
                          "top1_at_copies": round(copy_hits / max(copies, 1), 3),
                          "top1_elsewhere": round(other_hits / max(others, 1), 3)}), flush=True)


if __name__ == "__main__":
    main()
