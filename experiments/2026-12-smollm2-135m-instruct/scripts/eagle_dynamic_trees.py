"""Eagle heads on dynamic trees (EAGLE-2) against the static tree of the same size, through the decoding loop itself.

    python scripts/eagle_dynamic_trees.py --heads DIR [--nodes 8 12] [--top-k 4] [--beam 4] [--extra-depth 2]
        [--prompts FILE[:N] ...] [--per-category 1] [--max-new-tokens 128]

The static tree of N nodes is the one `medusa-spec tree --nodes N` grows from the adapter's stored rank accuracies;
the dynamic one, the library's DynamicTree(N, --top-k, --beam) (what generate(tree=None) drafts for eagle heads, there
with its size chosen each step), is chosen anew each step from the heads' own confidence: at each depth the `--beam`
nodes with the highest path probability (the product of the heads' probabilities along the path, over the draft
vocabulary) take `--top-k` children each, drafted by one draft-layer pass over those nodes; the step's tree is then
the N - 1 best of all children by that score (a child never scores above its parent, so they form a tree).
`--extra-depth K` lets the dynamic tree reach K levels deeper than the adapter's heads: the draft layer drafts any
depth, and the deeper levels read the last head's residual block.

Greedy, one prompt at a time (batch 1), every output checked against the static tree's (the verify pass decides,
so every tree gives the base model's own tokens). For each prompt the configurations run one after the other, in
turn, so a machine that slows down for a while slows them all. Prints, per configuration, tokens per step and the
summed seconds of the generate calls (prefill included). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from medusa_spec import DynamicTree, MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, encode, read_eval_prompts
from medusa_spec.inputs import resolve_sampling, special_tokens
from medusa_spec.loop import decode
from medusa_spec.propose import heads_proposer
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.loop import grown_heads
from medusa_spec.tree import build_tree, grow_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="an eagle adapter with rank accuracies in its metrics")
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 12])
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--extra-depth", type=int, default=0)
    parser.add_argument("--prompts", nargs="+", default=[str(MT_BENCH)], metavar="FILE[:N]")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()), "float32")
    mm = MedusaModel.from_pretrained(base, args.heads)
    if mm.heads.draft_layer is None:
        raise SystemExit(f"{args.heads}: dynamic trees here are for eagle heads (head_type 'eagle')")
    accuracy = mm._rank_accuracy()
    if not accuracy:
        raise SystemExit(f"{args.heads}: no rank accuracies in its metrics to grow the static trees from")
    # Deeper levels: heads added after the adapter's, each a copy of its last (as `train --init-heads` grows them).
    drafting = grown_heads(base, mm, {"num_heads": mm.config.num_heads + args.extra_depth}) if args.extra_depth else mm
    packs = mm._packed_weights
    makers = {}
    for n in args.nodes:
        static = build_tree(grow_tree(accuracy, n))
        makers[f"static {n}"] = functools.partial(heads_proposer, base, mm.heads, static, packs)
        makers[f"dynamic {n}"] = functools.partial(heads_proposer, base, drafting.heads,
                                                   DynamicTree(n, args.top_k, args.beam), packs)
    sampling, (eos, pad) = resolve_sampling(base, False), special_tokens(base, None, None)
    new_tokens, steps, seconds = (dict.fromkeys(makers, 0) for _ in range(3))
    identical = dict.fromkeys(makers, True)
    for _, text in read_eval_prompts(args.prompts, args.per_category):
        input_ids = encode(tokenizer, text)
        reference = None
        for name, make in makers.items():
            start = time.perf_counter()
            with torch.inference_mode():
                out = decode(base, mm.spec, make(), input_ids, None, args.max_new_tokens, sampling, eos, pad,
                             packs=packs)
            seconds[name] += time.perf_counter() - start
            new_tokens[name] += out.sequences.shape[1] - input_ids.shape[1]
            steps[name] += out.stats.steps
            reference = out.sequences if reference is None else reference
            identical[name] &= torch.equal(out.sequences, reference)
    for name in makers:
        print(f"{name:>12}: {new_tokens[name] / steps[name]:.3f} tokens/step, {new_tokens[name]} tokens in "
              f"{seconds[name]:.1f} s ({new_tokens[name] / seconds[name]:.1f} tokens/s), identical: {identical[name]}")


if __name__ == "__main__":
    main()
