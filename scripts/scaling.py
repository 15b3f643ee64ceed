"""Heads' held-out accuracy against the answer tokens they have seen: the scaling table (Markdown) and plot.

Reads the evaluations `medusa-spec train --eval-every N` logs (train_log.jsonl: answer_tokens_seen and the rank
accuracies at each point) of one or more runs, and for each point gives head top-1 accuracies and the expected
tokens per step of the best tree of --nodes nodes grown from those accuracies (what `medusa-spec tree` stores).

    python scripts/scaling.py runs/a [runs/b ...] [--nodes 8] [--plot scaling.png] [--learned-before N ...]

Points seen in the first epoch are points of a data-scaling curve (every answer token is new); later ones repeat
data, and are marked. A run that trained on heads which had already learned from other conversations (`train
--init-heads` over conversations they did not see, as `continue.sh` does) continues their curve: --learned-before
gives, per run, the distinct answer tokens those heads had learned from, and its points count from there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from medusa_spec.autotree import expected_tokens_per_step
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

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for run in dict.fromkeys(p["run"] for p in points):
        mine = [p for p in points if p["run"] == run]
        tokens = [p["answer_tokens"] / 1e6 for p in mine]
        left.plot(tokens, [p["expected"] for p in mine], marker="o", label=run)
        for k in range(len(mine[0]["top1"])):
            right.plot(tokens, [p["top1"][k] for p in mine], marker="o", label=f"{run} head {k} (+{k + 2})")
    left.set(xlabel="answer tokens seen (M)", ylabel=f"expected tokens/step ({nodes} nodes)", xscale="log")
    right.set(xlabel="answer tokens seen (M)", ylabel="held-out top-1", xscale="log")
    left.legend(fontsize=8)
    right.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="folders written by `medusa-spec train` (or their logs)")
    parser.add_argument("--nodes", type=int, default=8, help="tree size of the expected tokens/step (default: 8)")
    parser.add_argument("--plot", type=Path, help="also draw the curves into this PNG")
    parser.add_argument("--learned-before", type=int, nargs="+", metavar="N",
                        help="per run: the distinct answer tokens the heads it started from had learned (default 0)")
    args = parser.parse_args(argv)
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
