"""Heads' held-out accuracy against the answer tokens they have seen: the scaling table (Markdown) and plot.

Reads the evaluations `medusa-spec train --eval-every N` logs (train_log.jsonl: answer_tokens_seen and the rank
accuracies at each point) of one or more runs, and for each point gives head top-1 accuracies and the expected
tokens per step of the best tree of --nodes nodes grown from those accuracies (what `medusa-spec tree` stores).

    python scripts/scaling.py runs/a [runs/b ...] [--nodes 8] [--plot scaling.png] [--learned-before N ...]
    python scripts/scaling.py --scores held_out.jsonl --data training/data/smollm2-135m-instruct [--plot ...]

Points seen in the first epoch are points of a data-scaling curve (every answer token is new); later ones repeat
data, and are marked. A run that trained on heads which had already learned from other conversations (`train
--init-heads` over conversations they did not see, as `continue.sh` does) continues their curve: --learned-before
gives, per run, the distinct answer tokens those heads had learned from, and its points count from there.

--scores: adapters scored on one held-out set by scripts/compare_heads.py (its output lines), one point each, at the
answer tokens its heads learned from: those in the loss (loops left out, each conversation cut to --max-length tokens,
as `medusa-spec train` builds rows) of the conversations in --data that begin as one its trained_conversations.txt
lists. Every adapter is then counted the same way and measured on the same text, across runs that each started from
the last one's heads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from medusa_spec import default_model
from medusa_spec.autotree import expected_tokens_per_step
from medusa_spec.train.data import read_conversations, tokenize_conversation
from medusa_spec.train.loop import TRAINED_ON, conversation_key, read_trained_on
from medusa_spec.tree import grow_tree


def scaling_points(run: Path, nodes: int, learned_before: int = 0) -> list[dict]:
    """One point per evaluation logged in run/train_log.jsonl that counted the answer tokens seen (added to
    learned_before, what the heads it started from had learned)."""
    log = run / "train_log.jsonl" if run.is_dir() else run
    if not log.is_file():
        raise SystemExit(f"{log}: no training log; give a folder written by `medusa-spec train`")
    points, data_tokens = [], None
    for line in log.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        accuracy = record.get("eval", {}).get("rank_accuracy")
        if accuracy is None or "answer_tokens_seen" not in record:
            continue
        points.append({"run": run.name, "step": record["step"],
                       "answer_tokens": learned_before + record["answer_tokens_seen"],
                       "top1": record["eval"]["top1"],
                       "expected": expected_tokens_per_step(grow_tree(accuracy, nodes), accuracy)})
    summary = run / "medusa_config.json" if run.is_dir() else None
    if summary is not None and summary.is_file():  # the run's training data: points past it have seen data twice
        train = json.loads(summary.read_text(encoding="utf-8")).get("metrics", {}).get("train", {})
        data_tokens = train.get("answer_tokens_in_data")
    for point in points:
        point["repeats"] = bool(data_tokens) and point["answer_tokens"] - learned_before > data_tokens
    return points


def learned_answer_tokens(adapters: list[Path], data: list[str], tokenizer, max_length: int) -> list[int]:
    """Per adapter: the answer tokens in the loss of the conversations in `data` that begin as one its
    trained_conversations.txt lists (conversations that begin alike train, or stay out, together)."""
    listed = [read_trained_on(Path(adapter) / TRAINED_ON, "--scores") for adapter in adapters]
    counts = [0] * len(adapters)
    for messages in (m for path in data for m in read_conversations(path)):
        key = conversation_key(messages)
        if any(key in keys for keys in listed):
            in_loss = sum(tokenize_conversation(tokenizer, messages).loss_mask[:max_length])
            counts = [n + in_loss * (key in keys) for n, keys in zip(counts, listed)]
    return counts


def scored_points(lines: list[dict], data: list[str], tokenizer, nodes: int, max_length: int) -> list[dict]:
    """compare_heads.py's output lines (one text, several adapters) -> one point per adapter, by tokens learned."""
    tokens = learned_answer_tokens([line["heads"] for line in lines], data, tokenizer, max_length)
    points = [{"run": Path(line["heads"]).name, "step": "-", "answer_tokens": n, "top1": line["top1"],
               "expected": expected_tokens_per_step(grow_tree(line["rank_accuracy"], nodes), line["rank_accuracy"]),
               "repeats": False} for line, n in zip(lines, tokens)]
    return sorted(points, key=lambda p: p["answer_tokens"])


def markdown(points: list[dict], nodes: int) -> str:
    lines = [f"| run | step | answer tokens seen | head top-1 | expected tokens/step ({nodes} nodes) |",
             "|---|---|---|---|---|"]
    for p in points:
        seen = f"{p['answer_tokens'] / 1e6:.2f}M" + (" (repeats data)" if p["repeats"] else "")
        top1 = " / ".join(f"{x:.3f}" for x in p["top1"])
        lines.append(f"| {p['run']} | {p['step']} | {seen} | {top1} | {p['expected']:.2f} |")
    return "\n".join(lines)


def plot(points: list[dict], path: Path, nodes: int) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    all_tokens = [p["answer_tokens"] / 1e6 for p in points]
    # Scored adapters are one curve (each run continued the last); a log's evaluations are one curve per run.
    def curve(point: dict) -> str:
        return "adapters, one held-out set" if point["step"] == "-" else point["run"]

    for run in dict.fromkeys(map(curve, points)):
        mine = [p for p in points if curve(p) == run]
        tokens = [p["answer_tokens"] / 1e6 for p in mine]
        left.plot(tokens, [p["expected"] for p in mine], marker="o", label=run)
        for k in range(len(mine[0]["top1"])):
            right.plot(tokens, [p["top1"][k] for p in mine], marker="o", label=f"{run} head {k} (+{k + 2})")
    left.set(xlabel="answer tokens seen (M)", ylabel=f"expected tokens/step ({nodes} nodes)", xscale="log")
    right.set(xlabel="answer tokens seen (M)", ylabel="held-out top-1", xscale="log")
    for axis in (left, right):  # plain numbers: log-scale minor ticks as 3x10^0 overlap their neighbours
        axis.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xticks([t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
                         if min(all_tokens) / 1.5 <= t <= max(all_tokens) * 1.5])
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="folders written by `medusa-spec train` (or their logs)")
    parser.add_argument("--nodes", type=int, default=8, help="tree size of the expected tokens/step (default: 8)")
    parser.add_argument("--plot", type=Path, help="also draw the curves into this PNG")
    parser.add_argument("--learned-before", type=int, nargs="+", metavar="N",
                        help="per run: the distinct answer tokens the heads it started from had learned (default 0)")
    parser.add_argument("--scores", type=Path, help="scripts/compare_heads.py's output: one point per adapter")
    parser.add_argument("--data", nargs="+", help="with --scores: the conversations the adapters learned from")
    parser.add_argument("--max-length", type=int, default=512, help="with --scores: the runs' --max-length")
    parser.add_argument("--model", help="with --scores: the base model whose tokenizer counts (default model)")
    args = parser.parse_args(argv)
    if bool(args.runs) == bool(args.scores):
        parser.error("give either runs (their training logs) or --scores (compare_heads.py's output)")
    if args.scores:
        if not args.data:
            parser.error("--scores needs --data: the conversations the adapters learned from, to count them")
        lines = [json.loads(line) for line in args.scores.read_text(encoding="utf-8").splitlines() if line.strip()]
        if len({line.get("text") for line in lines}) != 1 or any("rank_accuracy" not in line for line in lines):
            raise SystemExit(f"{args.scores}: give the lines of one text (e.g. held-out) from a compare_heads.py "
                             f"that prints rank_accuracy")
        tokenizer = AutoTokenizer.from_pretrained(args.model or str(default_model.prepare()))
        points = scored_points(lines, args.data, tokenizer, args.nodes, args.max_length)
    else:
        learned = args.learned_before or [0] * len(args.runs)
        if len(learned) != len(args.runs):
            parser.error(f"--learned-before takes one count per run: {len(args.runs)} runs, {len(learned)} counts")
        points = [p for run, before in zip(args.runs, learned) for p in scaling_points(run, args.nodes, before)]
    if not points:
        raise SystemExit("no evaluation with answer_tokens_seen in these logs; train with --eval-every N")
    print(markdown(points, args.nodes))
    if args.plot:
        plot(points, args.plot, args.nodes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
