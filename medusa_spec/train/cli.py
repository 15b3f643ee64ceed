"""The `distill`, `train` and `tree` subcommands: add_train_commands(subparsers) registers them;
each sets `func`, which runs the command and returns the exit status."""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator

from .. import default_model
from ..base import inspect_base_model
from ..flags import add_flag, check_device, default_device, fast_dtype, positive_int
from ..model import MedusaModel
from ..prompts import read_prompt_files
from .config import TrainConfig
from .data import make_rows, read_conversations, tokenize_conversations
from .dflash_loop import train_dflash
from .distill import DistillConfig, distill
from .evaluate import calibrate_tree, evaluate
from .load import load_model_and_tokenizer
from .loop import train, without_excluded
from .module import TrainModule
from .options import add_options, resolve
from .server import distill_via_server


def run_distill(args) -> int:
    cfg = resolve(DistillConfig, args, "distill")
    prompts = read_prompt_files(cfg.prompts, cfg.prompt_field)
    if cfg.server:
        print(json.dumps(distill_via_server(prompts, cfg)))
        return 0
    torch.manual_seed(cfg.seed)
    device = check_device(cfg.device or default_device())
    model, tokenizer = load_model_and_tokenizer(cfg.model or default_model.prepare(), cfg.dtype or fast_dtype(device),
                                                cfg.plain_text)
    model.to(device)
    print(json.dumps(distill(model, tokenizer, prompts, cfg)))
    return 0


def run_train(args) -> int:
    cfg = resolve(TrainConfig, args, "train")
    (train_dflash if cfg.head_type == "dflash" else train)(cfg)  # logs as it goes, and where it saved the result
    return 0


def run_tree(args) -> int:
    eval_metrics = None
    if args.data:
        eval_metrics = measure(args.heads, args.model or default_model.prepare(), args.data, args.max_length,
                               args.batch_size, args.eval_ranks, args.plain_text, args.exclude)
    elif args.model or args.exclude:
        flag = "--model is the base" if args.model else "--exclude leaves conversations out of what"
        raise ValueError(f"tree: {flag} the accuracies are measured on: add --data FILE (without it, the accuracies "
                         f"saved by training are used)")
    tree = calibrate_tree(args.heads, args.nodes, eval_metrics)
    print(json.dumps({"heads": str(args.heads), "nodes": args.nodes, "tree": tree}))
    return 0


def measure(adapter: str, model: str, data: list[str], max_length: int, batch_size: int, eval_ranks: int,
            plain_text: bool, exclude: list[str] = ()) -> dict:
    """Rank accuracies of the adapter's heads on conversations, against its base's greedy tokens: those of `data`
    that begin as none listed in the `exclude` files."""
    # Left out before the model loads; the report goes to stderr, as stdout is the tree's JSON.
    conversations = without_excluded([messages for path in data for messages in read_conversations(path)],
                                     list(exclude), report=lambda line: print(line, file=sys.stderr))
    base_model, tokenizer = load_model_and_tokenizer(model, "float32", plain_text)
    medusa = MedusaModel.from_pretrained(base_model, adapter)  # applies a Medusa-2 LoRA adapter (lora/) too
    spec = inspect_base_model(medusa.base_model)
    examples = tokenize_conversations(tokenizer, conversations)
    rows = make_rows(examples, max_length, pack=True)
    accelerator = Accelerator()
    module = TrainModule(medusa.base_model, medusa.heads, spec.bool_mask, spec.takes_logits_to_keep)
    module.to(accelerator.device)
    return evaluate(module, rows, batch_size, tokenizer.pad_token_id, eval_ranks, accelerator)


def add_train_commands(subparsers) -> None:
    """Register `distill`, `train` and `tree` on an argparse subparsers object."""
    p = subparsers.add_parser("distill", help="let the base model answer prompts (self-distillation data)",
                              description="Answer prompt files with the base model's chat template; append the "
                                          "conversations to --output. Rerun the same command to resume.")
    add_options(p, DistillConfig)
    p.set_defaults(func=run_distill)

    p = subparsers.add_parser("train", help="train Medusa heads (medusa1) or heads + LoRA (medusa2)",
                              description="Train heads on distilled conversations and save the adapter into "
                                          "--output. Same command under `accelerate launch` for several GPUs.")
    add_options(p, TrainConfig)
    p.set_defaults(func=run_train)

    p = subparsers.add_parser("tree", help="grow the heads' tree of N nodes from measured head accuracies",
                              description="Grow the sparse tree of --nodes nodes that maximises the expected accepted "
                                          "length, print it (the medusa_choices a serving engine takes) and store it "
                                          "in the medusa_config.json of --heads (an adapter folder written by "
                                          "`medusa-spec train`). Uses the accuracies saved by training, or measures "
                                          "them with --model and --data and stores them too. generate's default "
                                          "(tree=None, --tree auto) does not read the stored tree while the "
                                          "accuracies are there: it times trees of every size on the machine it runs "
                                          "on and picks the fastest for them; --tree N decodes with this N-node tree.")
    add_flag(p, "heads", required=True, aliases=("--adapter",))
    p.add_argument("--nodes", type=positive_int, default=16,
                   help="tree size, root included; larger suits GPUs (default: 16)")
    # Measuring afresh: --data (held-out conversations), read as train reads its data.
    add_flag(p, "data")
    add_flag(p, "exclude", [], default_help="none")
    add_flag(p, "model")
    add_flag(p, "max_length", TrainConfig.max_length)
    add_flag(p, "batch_size", TrainConfig.batch_size)
    add_flag(p, "eval_ranks", TrainConfig.eval_ranks)
    add_flag(p, "plain_text", False)
    p.set_defaults(func=run_tree)


