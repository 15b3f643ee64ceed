"""Eagle heads on dynamic trees (EAGLE-2) against the static tree of the same size, through the decoding loop itself.

    python scripts/eagle_dynamic_trees.py --heads DIR [--nodes 8 12] [--top-k 4] [--beam 4] [--extra-depth 2]
        [--prompts FILE[:N] ...] [--per-category 1] [--max-new-tokens 128]

A measurement, not yet a decoding option of the library. The static tree of N nodes is the one `medusa-spec tree
--nodes N` grows from the adapter's stored rank accuracies. The dynamic one is chosen anew each step from the heads'
own confidence: at each depth the `--beam` nodes with the highest path log-probability (the sum of the heads'
log-probabilities along the path, over the draft vocabulary) take `--top-k` children each, drafted by one draft-layer
pass over those nodes; the step's tree is then the N - 1 best of all children by that score (a child never scores
above its parent, so they form a tree). `--extra-depth K` lets the dynamic tree reach K levels deeper than the
adapter's heads: the draft layer drafts any depth, and the deeper levels read the last head's residual block.

Greedy, one prompt at a time (batch 1), every output checked against the static tree's (the verify pass decides,
so every tree gives the base model's own tokens). For each prompt the configurations run one after the other, in
turn, so a machine that slows down for a while slows them all. Prints, per configuration, tokens per step and the
summed seconds of the generate calls (prefill included). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import tempfile
import time

import torch

from medusa_spec import MedusaModel, default_model
from medusa_spec.bench import MT_BENCH, encode, read_eval_prompts
from medusa_spec.eagle import DRAFT_LAYER_SPEC
from medusa_spec.inputs import resolve_sampling, special_tokens
from medusa_spec.io import load_adapter, save_adapter
from medusa_spec.loop import decode
from medusa_spec.propose import Candidates, DraftLayerProposer, heads_proposer
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.tree import MedusaTree, build_tree, grow_tree
from medusa_spec.verify import layer_masks


@functools.lru_cache(maxsize=None)
def tree_of(choices: tuple[tuple[int, ...], ...]) -> MedusaTree:
    return build_tree([list(path) for path in choices])


class DynamicDraftLayerProposer(DraftLayerProposer):
    """A DraftLayerProposer whose tree is chosen each step (batch 1): `nodes` nodes, root included."""

    def __init__(self, base_model, heads, nodes: int, top_k: int, beam: int):
        super().__init__(base_model, heads, build_tree([[0]]))  # the layout is unused: each step makes its own
        self.nodes, self.top_k, self.beam = nodes, top_k, beam
        self.max_depth = heads.num_heads

    def propose(self, root: torch.Tensor) -> Candidates:
        heads, slots = self.heads, self.slots
        lm_head = self.base_model.get_output_embeddings()
        outputs = self.root_output[:, None]  # [1, n, H]: the draft layer's outputs at the beam's slots
        scores = torch.zeros(1)
        beam_paths: list[tuple[int, ...]] = [()]  # rank paths of the beam (the root's: ())
        self.slot_paths: list[tuple[int, ...]] = []  # rank paths of the step's drafted slots, in slot order
        paths, tokens, path_scores = [], [], []
        for d in range(1, heads.num_heads + 1):
            logits = heads.draft_logits(d - 1, outputs, lm_head)[0]  # [n, V']
            top = logits.log_softmax(-1).topk(self.top_k, dim=-1)
            child_scores = (scores[:, None] + top.values).flatten()
            child_tokens = heads.token_ids(top.indices).flatten()
            child_paths = [path + (r,) for path in beam_paths for r in range(self.top_k)]
            paths += child_paths
            tokens.append(child_tokens)
            path_scores.append(child_scores)
            if d == heads.num_heads:
                break
            kept = child_scores.topk(min(self.beam, len(child_paths))).indices
            beam_paths = [child_paths[i] for i in kept.tolist()]
            # The beam's slots: each sees the committed slots, its ancestors' drafted slots and itself.
            q_pos, kv_valid, kv_pos = slots.verify_inputs(torch.full((len(beam_paths),), d - 1, device=root.device))
            self.slot_paths += beam_paths
            allowed = kv_valid[:, None, :].expand(-1, len(beam_paths), -1).clone()
            allowed[:, :, slots.past:] = torch.tensor([[path[: len(slot)] == slot for slot in self.slot_paths]
                                                       for path in beam_paths])
            mask = layer_masks(DRAFT_LAYER_SPEC, allowed, q_pos, kv_pos, outputs.dtype)
            outputs = heads.draft_layer(outputs[:, kept // self.top_k], self.embed(child_tokens[kept])[None], mask,
                                        q_pos, slots.cache)
            scores = child_scores[kept]
        score = torch.cat(path_scores).tolist()
        # Best first; a child that ties its parent comes after it (a stable sort over candidates listed by level).
        best = {paths[i]: i for i in sorted(range(len(paths)), key=lambda i: -score[i])[: self.nodes - 1]}
        tree = tree_of(tuple(sorted(best, key=lambda path: (len(path), path))))
        node_tokens = torch.cat([root, torch.cat(tokens)[[best[path] for path in tree.choices]]])[None]
        return Candidates(node_tokens, tree.to(root.device))


def deeper(heads_dir: str, extra: int, folder: str) -> str:
    """A copy of the adapter in `folder` with `extra` more heads, each a copy of the last one's residual block."""
    config, state = load_adapter(heads_dir)
    last = config.num_heads - 1
    for k in range(config.num_heads, config.num_heads + extra):
        state |= {name.replace(f"blocks.{last}.", f"blocks.{k}.", 1): tensor.clone()
                  for name, tensor in state.items() if name.startswith(f"blocks.{last}.")}
    save_adapter(folder, dataclasses.replace(config, num_heads=config.num_heads + extra), state)
    return folder


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
    with tempfile.TemporaryDirectory() as folder:
        drafting = MedusaModel.from_pretrained(base, deeper(args.heads, args.extra_depth, folder)) \
            if args.extra_depth else mm
    packs = mm._packed_weights
    heads = heads_proposer(base, drafting.heads, build_tree([[0]]), packs).heads  # the decoding loop's packed copy
    makers = {}
    for n in args.nodes:
        static = build_tree(grow_tree(accuracy, n))
        makers[f"static {n}"] = functools.partial(heads_proposer, base, mm.heads, static, packs)
        makers[f"dynamic {n}"] = functools.partial(DynamicDraftLayerProposer, base, heads, n, args.top_k, args.beam)
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
