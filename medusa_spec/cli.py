"""`medusa-spec` command line: demo, generate (and the training / conversion commands)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from . import bench, default_model
from .config import MedusaConfig
from .formats import add_convert_command
from .train.cli import add_train_commands
from .model import MedusaModel

# The evaluation prompts beside this repository (../shared/data/eval, see its SOURCES.md).
DEFAULT_EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval" / "mt_bench_question.jsonl"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tree_arg(text: str):
    """--tree: JSON rank paths, 'off' for no speculation (one token per step), or 'auto'."""
    if text == "off":
        return []
    if text == "auto":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"--tree must be JSON rank paths such as '[[0],[1],[0,0]]' or 'off', got {text!r}")


def _sampling_kwargs(args) -> dict:
    return dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def demo(args) -> int:
    """Offline demo on a tiny random Llama: speculative greedy output equals transformers' greedy output."""
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    base = transformers.AutoModelForCausalLM.from_config(config).eval()
    mm = MedusaModel.from_base(base, MedusaConfig(num_heads=3))
    ids = torch.randint(3, 512, (1, 16))
    start = time.perf_counter()
    plain = base.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    plain_time = time.perf_counter() - start
    out = mm.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=[], tree=args.tree)
    stats = out.stats
    print(f"tiny random Llama, {args.max_new_tokens} new tokens, untrained heads")
    print(f"identical to transformers greedy: {torch.equal(out.sequences, plain)}")
    print(f"medusa_spec: {stats.tokens_per_second:.0f} tok/s, {stats.tokens_per_step:.2f} tokens/step; "
          f"transformers: {args.max_new_tokens / plain_time:.0f} tok/s")
    print("untrained heads rarely guess right; train heads with `medusa-spec train` for real speed-ups")
    return 0 if torch.equal(out.sequences, plain) else 1


def load(args):
    """(MedusaModel, tokenizer) from --model/--heads; without --model, the default model and its shipped heads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = args.model or default_model.prepare()
    heads = args.heads
    if heads is None and args.model is None and (default_model.HEADS_DIR / "medusa_config.json").is_file():
        heads = default_model.HEADS_DIR
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[args.dtype]).to(args.device).eval()
    mm = MedusaModel.from_pretrained(base, heads) if heads else MedusaModel.from_base(base)
    if heads is None:
        print("[no heads given: untrained heads, expect no speed-up]", file=sys.stderr)
    if getattr(args, "tree", None) == "auto":
        args.tree = _auto_tree(mm)
    return mm, tokenizer


def _auto_tree(mm):
    """--tree auto: measured on this machine when the heads carry rank accuracies, else the heads' own tree."""
    if not mm.config.metrics.get("eval", {}).get("rank_accuracy"):
        return None
    tree, table = mm.auto_tree()
    best = next(row for row in table if row["tree"] == tree)
    print(f"[tree auto: {best['nodes']} nodes, {best['step_ms']} ms/step, expected {best['expected_tokens_per_step']} "
          f"tokens/step]", file=sys.stderr)
    return tree


def generate(args) -> int:
    """Generate, streaming text; --compare also times plain decoding."""
    from transformers import TextStreamer

    mm, tokenizer = load(args)
    base = mm.base_model
    ids = bench.encode(tokenizer, args.prompt)
    out = mm.generate(ids, max_new_tokens=args.max_new_tokens, tree=args.tree,
                      streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True), **_sampling_kwargs(args))
    stats = out.stats
    print(f"\n[{sum(stats.new_tokens)} tokens, {stats.tokens_per_second:.1f} tok/s, "
          f"{stats.tokens_per_step:.2f} tokens/step]", file=sys.stderr)
    if args.compare:
        start = time.perf_counter()
        with torch.inference_mode():
            plain = base.generate(ids.to(args.device), max_new_tokens=args.max_new_tokens, **_sampling_kwargs(args))
        plain_rate = (plain.shape[1] - ids.shape[1]) / (time.perf_counter() - start)
        print(f"[transformers generate: {plain_rate:.1f} tok/s; speed-up {stats.tokens_per_second / plain_rate:.2f}x"
              + (f"; identical: {torch.equal(plain.cpu(), out.sequences.cpu())}]" if not args.do_sample else "]"),
              file=sys.stderr)
    return 0


def chat(args) -> int:
    """Multi-turn chat through the model's chat template; an empty line or end of input quits."""
    from transformers import TextStreamer

    mm, tokenizer = load(args)
    if not tokenizer.chat_template:
        raise ValueError(f"{args.model or default_model.MODEL_NAME} has no chat template; use `medusa-spec generate`")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    while True:
        try:
            text = input("> ").strip()
        except EOFError:
            break
        if not text:
            break
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        out = mm.generate(ids, max_new_tokens=args.max_new_tokens, tree=args.tree, streamer=streamer,
                          **_sampling_kwargs(args))
        reply = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        print(f"[{out.stats.tokens_per_second:.1f} tok/s, {out.stats.tokens_per_step:.2f} tokens/step]", file=sys.stderr)
    return 0


def run_bench(args) -> int:
    mm, tokenizer = load(args)
    prompts = bench.read_eval_prompts(args.prompts, args.per_category)
    records = bench.bench(mm, tokenizer, prompts, args.max_new_tokens, args.tree, seed=args.seed)
    meta = {"model": args.model or default_model.MODEL_NAME, "heads": str(args.heads or default_model.HEADS_DIR),
            "prompts": str(args.prompts), "max_new_tokens": args.max_new_tokens, "tree": args.tree,
            "threads": torch.get_num_threads(), "device": args.device, "dtype": args.dtype}
    report = bench.write_report(records, args.out, meta)
    print(bench.markdown(report["summary"]))
    print(f"wrote {args.out}/bench.json, bench.md" + (", bench.png" if report["plotted"] else " (pip install matplotlib for bench.png)"))
    return 0


def _add_model_options(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="local folder of a transformers causal LM with its tokenizer (default: SmolLM2-135M-Instruct "
                             f"from the {default_model.DISTRIBUTION} package)")
    parser.add_argument("--heads", default=None,
                        help="adapter folder (default: the shipped heads for the default model, else untrained heads)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def _add_generation_options(parser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree", type=_tree_arg, default="auto",
                        help="JSON rank paths, 'off', or 'auto' (fastest for this machine and the heads' accuracies)")
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medusa-spec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("demo", help="offline check on a tiny random model")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--tree", type=_tree_arg, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo)

    p = commands.add_parser("generate", help="generate text with Medusa heads")
    p.add_argument("prompt")
    _add_model_options(p)
    p.add_argument("--compare", action="store_true", help="also run transformers generate and print the speed-up")
    _add_generation_options(p)
    p.set_defaults(func=generate)

    p = commands.add_parser("chat", help="multi-turn chat with Medusa heads (empty line quits)")
    _add_model_options(p)
    p.add_argument("--system", default=None, help="system message")
    _add_generation_options(p)
    p.set_defaults(func=chat)

    p = commands.add_parser("bench", help="compare decoding methods on evaluation prompts")
    _add_model_options(p)
    p.add_argument("--prompts", default=str(DEFAULT_EVAL), help="MT-bench-shaped JSONL (first turns are used)")
    p.add_argument("--per-category", type=int, default=None, help="prompts per category (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--tree", type=_tree_arg, default="auto",
                   help="JSON rank paths, or 'auto' (fastest for this machine and the heads' accuracies)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results", help="folder for bench.json, bench.md, bench.png")
    p.set_defaults(func=run_bench)

    add_train_commands(commands)
    add_convert_command(commands)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:  # our errors already say what to fix
        print(f"medusa-spec {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
