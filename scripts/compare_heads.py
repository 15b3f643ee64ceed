"""Accuracy of several adapters on the same text, which none of them trained on: held-out distilled conversations,
or the base model's own answers to evaluation prompts.

--data: the held-out set is sampled as `medusa-spec train` holds one out (--eval-examples, --seed) from the
conversations in --data that no adapter trained on: those listed in the --exclude files (the trained_conversations.txt
that `medusa-spec train` writes beside each adapter) are left out first.

--prompts: the base model answers each prompt's first turn (greedy, --max-new-tokens, as `medusa-spec bench` runs
them), and the adapters are scored on those answers, per category and overall. The answers are kept in --answers
(reused when the file exists), so later runs compare on the very same text. This is the benchmark's text without its
clock: on a 2-core CPU the speed ratios of two adapters move with the machine by more than the adapters differ, while
these counts are the same in every run.

For each adapter: per-head top-1 and top-8 accuracy against the base's greedy tokens, and the expected tokens per step
of the best 4- and 8-node trees grown from them.

    python scripts/compare_heads.py --data training/data/smollm2-135m-instruct \\
        --heads heads/smollm2-135m-instruct runs/smollm2-dependent-more \\
        --exclude runs/smollm2-dependent-more/trained_conversations.txt
    python scripts/compare_heads.py --heads heads/smollm2-135m-instruct runs/NEW \\
        --prompts medusa_spec/data/mt_bench_question.jsonl --answers mt_bench_answers.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator

from medusa_spec import MedusaModel, default_model
from medusa_spec.autotree import expected_tokens_per_step
from medusa_spec.base import inspect_base_model
from medusa_spec.bench import read_eval_prompts
from medusa_spec.prompts import read_jsonl
from medusa_spec.train.data import make_rows, read_conversations, tokenize_conversation
from medusa_spec.train.distill import DistillConfig, answer
from medusa_spec.train.evaluate import accuracy_metrics, evaluate
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.loop import split_held_out, without_excluded
from medusa_spec.train.module import TrainModule
from medusa_spec.tree import grow_tree


def answered_prompts(base_model, tokenizer, specs: list[str], path: str | None, max_new_tokens: int) -> list[dict]:
    """[{"category", "messages"}] for the first turns of the prompts in `specs`, answered greedily by the base model;
    read from `path` when it exists (it must hold those prompts), else written there."""
    prompts = read_eval_prompts(specs)
    if path and Path(path).is_file():
        records = [record for _, record in read_jsonl(path)]
        if [r["messages"][0]["content"] for r in records] != [text for _, text in prompts]:
            raise SystemExit(f"{path} holds answers to other prompts than {' '.join(specs)}: delete it, or pass "
                             f"another --answers file, to answer these")
        return records
    conversations = [[{"role": "user", "content": text}] for _, text in prompts]
    config = DistillConfig(prompts=specs, output="-", max_new_tokens=max_new_tokens, do_sample=False)  # 64 rows
    replies, _ = answer(base_model, tokenizer, conversations, config)
    records = [{"category": category, "messages": [*messages, {"role": "assistant", "content": reply}]}
               for (category, _), messages, reply in zip(prompts, conversations, replies)]
    if path:
        Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return records


def pooled(metrics: list[dict]) -> dict:
    """evaluate()'s metrics of several texts -> those of all of them: the hit counts back from each text's rank
    accuracies (4 decimals: exact below 10,000 positions a head), summed."""
    hits = sum(torch.tensor(m["rank_accuracy"], dtype=torch.float64) * torch.tensor(m["positions"])[:, None]
               for m in metrics)
    return accuracy_metrics(hits.round().long(), sum(torch.tensor(m["positions"]) for m in metrics))


def summary(metrics: dict, ranks: int) -> dict:
    accuracy = metrics["rank_accuracy"]
    return {"positions": metrics["positions"][0], "top1": metrics["top1"], f"top{ranks}": metrics[f"top{ranks}"],
            **{f"expected_{n}_nodes": round(expected_tokens_per_step(grow_tree(accuracy, n), accuracy), 3)
               for n in (4, 8)},
            "rank_accuracy": accuracy}  # for trees of other sizes (experiments/.../scripts/scaling.py --scores)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True)
    parser.add_argument("--data", nargs="+", help="distilled conversations: score a held-out sample of them")
    parser.add_argument("--prompts", nargs="+", metavar="FILE[:N]",
                        help="evaluation prompts (bench's --prompts): score the base's answers to their first turns")
    parser.add_argument("--answers", metavar="FILE", help="with --prompts: where the answers are kept, and reused")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="with --prompts: the answers' length")
    parser.add_argument("--model", help="the base model (default: the default model)")
    parser.add_argument("--eval-examples", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", nargs="+", default=[], metavar="FILE")
    parser.add_argument("--max-length", type=int, default=512, help="with --data: tokens per packed row")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--eval-ranks", type=int, default=8)
    args = parser.parse_args(argv)
    if bool(args.data) == bool(args.prompts):
        parser.error("give either --data (held-out distilled conversations) or --prompts (evaluation prompts)")

    base_model, tokenizer = load_model_and_tokenizer(args.model or str(default_model.prepare()), "float32")
    if args.data:
        conversations = without_excluded([m for path in args.data for m in read_conversations(path)], args.exclude,
                                         require_match=False)  # an adapter trained on other data excludes nothing
        _, held_out = split_held_out(conversations, args.eval_examples, args.seed)
        groups = {"held-out": [tokenize_conversation(tokenizer, conversations[i]) for i in held_out]}
        max_length = args.max_length
    else:
        records = answered_prompts(base_model, tokenizer, args.prompts, args.answers, args.max_new_tokens)
        # Loops stay: the benchmark's text runs on through them. Rows are as long as the longest conversation, so
        # every prompt counts, long documents included.
        examples = [tokenize_conversation(tokenizer, r["messages"], keep_loops=True) for r in records]
        groups = {}
        for category in dict.fromkeys(r["category"] for r in records):
            groups[category] = [e for e, r in zip(examples, records) if r["category"] == category]
        max_length = max(len(e.input_ids) for e in examples)
    spec = inspect_base_model(base_model)
    for heads in args.heads:
        medusa = MedusaModel.from_pretrained(base_model, heads)
        module = TrainModule(base_model, medusa.heads, spec.bool_mask, spec.takes_logits_to_keep)
        measured = {name: evaluate(module, make_rows(examples, max_length, pack=True), args.batch_size,
                                   tokenizer.pad_token_id, args.eval_ranks, Accelerator())
                    for name, examples in groups.items()}
        if len(measured) > 1:
            measured["all"] = pooled(list(measured.values()))
        for name, metrics in measured.items():
            print(json.dumps({"heads": heads, "text": name, **summary(metrics, args.eval_ranks)}), flush=True)


if __name__ == "__main__":
    main()
