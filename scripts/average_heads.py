"""The mean of the weights of adapters along one line of runs: checkpoint averaging (a "soup" of the adapters that
`medusa-spec train --init-heads` wrote, each run starting from the last one's heads).

Each such run fits the conversations it reads and lets go of some of the older ones
(experiments/2026-12-smollm2-135m-instruct/NOTES.md, "Run 17"); the mean of the last few adapters keeps more of each.
Every adapter must have the same settings (config) and draft vocabulary; Medusa-2 adapters (with a LoRA adapter of the
base) are refused. The output is an adapter folder as train writes one: the averaged weights; the last adapter's
config without its measured accuracies (they were the last adapter's, not the mean's; metrics.mean_of lists the
sha256 of each adapter's weights); a trained_conversations.txt listing every conversation any of them learned from.
Measure the mean's accuracies and store its tree before decoding with it, on conversations none of them learned:

    python scripts/average_heads.py --heads runs/run14 runs/run15 runs/run16 runs/run17 --output runs/avg14-17
    medusa-spec tree --heads runs/avg14-17 --nodes 8 --data D --exclude runs/avg14-17/trained_conversations.txt
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from medusa_spec.io import load_adapter, save_adapter
from medusa_spec.train.loop import TRAINED_ON, read_trained_on, write_trained_on

# Fields that describe one save or one measurement, not the heads' settings: they may differ between the adapters.
_PER_SAVE = ("metrics", "tree", "weights_sha256", "base_model_name_or_path")


def average_adapters(paths: list[str | Path], output: str | Path) -> None:
    """Write the mean of the adapters in `paths` to the adapter folder `output` (see the module's docstring)."""
    if len(paths) < 2:
        raise ValueError(f"--heads: give two adapters or more to average, got {len(paths)}")
    if Path(output).resolve() in {Path(path).resolve() for path in paths}:
        raise ValueError(f"--output {output} is one of the adapters averaged, which the mean would replace; write it "
                         f"to another folder")
    loaded = [load_adapter(path) for path in paths]
    for path, (config, _) in zip(paths, loaded):
        if config.lora:
            raise ValueError(f"{path} holds a LoRA adapter of the base (Medusa-2): its LoRA weights are not averaged; "
                             f"average Medusa-1 adapters (frozen base) only")
    first_config, first_weights = loaded[0]
    settings = {k: v for k, v in dataclasses.asdict(first_config).items() if k not in _PER_SAVE}
    for path, (config, weights) in zip(paths[1:], loaded[1:]):
        other = {k: v for k, v in dataclasses.asdict(config).items() if k not in _PER_SAVE}
        differ = sorted(k for k in settings if settings[k] != other[k])
        if differ:
            raise ValueError(f"{path} and {paths[0]} differ in {', '.join(differ)}: only adapters with the same "
                             f"settings (one line of runs) can be averaged")
        for name, tensor in first_weights.items():
            if not tensor.is_floating_point() and not torch.equal(tensor, weights[name]):
                raise ValueError(f"{path} and {paths[0]} differ in {name} (their draft vocabularies): the heads' "
                                 f"weights then mean different tokens and cannot be averaged")
    mean = {name: torch.stack([weights[name].double() for _, weights in loaded]).mean(0).to(tensor.dtype)
            if tensor.is_floating_point() else tensor for name, tensor in first_weights.items()}
    # The accuracies were the last adapter's; what is kept says where the mean came from (each one's weights' sha256).
    metrics = {"mean_of": [config.weights_sha256 for config, _ in loaded]}
    save_adapter(output, dataclasses.replace(loaded[-1][0], metrics=metrics), mean)
    lists = [Path(path) / TRAINED_ON for path in paths]
    listed = Path(output) / TRAINED_ON
    if all(file.is_file() for file in lists):
        write_trained_on(listed, set().union(*(read_trained_on(file, "--heads") for file in lists)))
    else:  # what the mean learned from is unknown: no list, not one left by the heads saved here before
        listed.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", required=True, metavar="DIR", help="adapter folders, two or more")
    parser.add_argument("--output", required=True, metavar="DIR", help="the averaged adapter's folder")
    args = parser.parse_args(argv)
    average_adapters(args.heads, args.output)
    print(f"saved the mean of {len(args.heads)} adapters to {args.output}")


if __name__ == "__main__":
    main()
