"""Tokens per step of static trees against dynamic ones of the same size, counted without a clock on kept answers.

    python scripts/simulate_trees.py [--heads DIR] [--answers FILE ...] [--nodes 4 8] [--top-k 4] [--beam 4]

Teacher-forced, as scripts/simulate_lookup.py: the base model's greedy answers (`--answers`, as
scripts/compare_heads.py keeps them) are decoded step by step as the loop would, without running it. The heads read
the base's hidden state before each step's root and draft; the step accepts the longest path of the tree that the
answer continues, then moves on past it and the bonus token. Trees, at each node count (root included):

- `static`: the one `medusa-spec tree` grows from the adapter's stored rank accuracies (the adapter's default tree
  is such a tree; `--tree auto` picks its size from timings);
- `dynamic` (EAGLE-2): chosen anew each step from the heads' own confidence. Each level's `--beam` best nodes (by
  the log-probability of their path, the product of the heads' probabilities along it) take their `--top-k`
  children; the tree is then the node count's best candidates by that score. A child never scores above its
  parent, so the choice is a tree.

Prints tokens per step per answer file and tree.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from medusa_spec import MedusaModel, default_model
from medusa_spec.base import inspect_base_model
from medusa_spec.config import MedusaConfig
from medusa_spec.propose import draft_with_heads
from medusa_spec.train.data import tokenize_conversation
from medusa_spec.train.load import load_model_and_tokenizer
from medusa_spec.train.module import TrainModule
from medusa_spec.tree import MedusaTree, build_tree, grow_tree


@functools.lru_cache(maxsize=None)
def tree_of(choices: tuple[tuple[int, ...], ...]) -> MedusaTree:
    return build_tree([list(path) for path in choices])


def dynamic_draft(heads, embed, lm_head, root: torch.Tensor, last_hidden: torch.Tensor, nodes: int, top_k: int,
                  beam: int) -> tuple[MedusaTree, torch.Tensor]:
    """Dependent heads: root [B], last_hidden [B, H] -> (tree, node_tokens [B, nodes]). The rows of a batch share the
    tree's shape (rank paths), chosen on their mean score."""
    paths = root[:, None, None]  # [B, n, d]: the tokens root .. node of each node of the beam
    scores = torch.zeros(len(root), 1)
    rank_paths: list[tuple[int, ...]] = [()]
    candidates, tokens, path_scores = [], [], []
    for d in range(1, heads.num_heads + 1):
        n = paths.shape[1]
        logits = heads.head_logits(d - 1, last_hidden[:, None].expand(-1, n, -1), embed(paths), lm_head)
        top = logits.log_softmax(-1).topk(top_k, dim=-1)
        child_scores = (scores[..., None] + top.values).flatten(1)  # [B, n * top_k]
        child_tokens = heads.token_ids(top.indices).flatten(1)
        child_paths = [path + (r,) for path in rank_paths for r in range(top_k)]
        candidates += child_paths
        tokens.append(child_tokens)
        path_scores.append(child_scores)
        if d == heads.num_heads:
            break  # no head below the deepest level
        kept = child_scores.mean(0).topk(min(beam, len(child_paths))).indices
        paths = torch.cat([paths[:, kept // top_k], child_tokens[:, kept, None]], dim=2)
        scores = child_scores[:, kept]
        rank_paths = [child_paths[i] for i in kept.tolist()]
    score = torch.cat(path_scores, 1).mean(0).tolist()
    # Best first. A child that ties its parent (a probability that rounds to 1) comes after it: the sort is stable and
    # candidates are listed level by level.
    best = sorted(range(len(candidates)), key=lambda i: -score[i])[: nodes - 1]
    picked = {candidates[i]: i for i in best}
    tree = tree_of(tuple(sorted(picked, key=lambda path: (len(path), path))))
    node_tokens = torch.cat([root[:, None], torch.cat(tokens, 1)[:, [picked[path] for path in tree.choices]]], 1)
    return tree, node_tokens


def head_inputs(module: TrainModule, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> [B, T, H]: at each position the state the heads draft from at decoding time, the final layer's
    fused with the feature_layers' where the heads read them (the base returns them side by side)."""
    hidden = module(ids, torch.arange(ids.shape[1]).expand_as(ids), torch.ones_like(ids)).hidden
    return module.heads.features(hidden)


def accepted_length(tree: MedusaTree, node_tokens: torch.Tensor, following: list[int]) -> int:
    """The depth of the deepest node whose path, root excluded, is the text that follows the root (`following`)."""
    target = torch.tensor((following + [-1] * tree.max_depth)[: tree.max_depth])
    right = torch.cat([torch.ones(1, dtype=torch.bool), node_tokens[1:] == target[tree.depth[1:] - 1]])
    whole_path = (right[None, :] | ~tree.tree_mask).all(1)
    return int(tree.depth[whole_path].max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default=str(default_model.shipped_heads()))
    parser.add_argument("--answers", nargs="+", default=["experiments/2026-12-smollm2-135m-instruct/answers-mt.jsonl",
                                                         "experiments/2026-12-smollm2-135m-instruct/answers-other.jsonl"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--beam", type=int, default=4)
    args = parser.parse_args()
    base, tokenizer = load_model_and_tokenizer(str(default_model.prepare()), "float32")
    heads = MedusaModel.from_pretrained(base, args.heads).heads.eval()
    if not heads.dependent or getattr(heads, "draft_layer", None) is not None or heads.context is not None:
        raise SystemExit(f"{args.heads}: dynamic drafting here is for dependent heads without a context layer")
    spec = inspect_base_model(base)
    module = TrainModule(base, heads, spec.bool_mask, spec.takes_logits_to_keep).eval()
    embed, lm_head = base.get_input_embeddings(), base.get_output_embeddings()
    accuracy = MedusaConfig.from_json_file(f"{args.heads}/medusa_config.json").metrics["eval"]["rank_accuracy"]
    static = {n: build_tree(grow_tree(accuracy, n)) for n in args.nodes}
    def static_draft(root, last_hidden, tree):
        return tree, draft_with_heads(heads, base, root, last_hidden, tree)

    drafts = {**{f"static {n}": functools.partial(static_draft, tree=static[n]) for n in args.nodes},
              **{f"dynamic {n}": functools.partial(dynamic_draft, heads, embed, lm_head, nodes=n, top_k=args.top_k,
                                                   beam=args.beam) for n in args.nodes}}
    for path in args.answers:
        tokens, steps = 0, dict.fromkeys(drafts, 0)
        for record in map(json.loads, open(path, encoding="utf-8")):
            example = tokenize_conversation(tokenizer, record["messages"], keep_loops=True)
            x = example.input_ids
            ids = torch.tensor([x])
            first = example.loss_mask.index(True)
            last = min(first + args.max_new_tokens, first + sum(example.loss_mask), len(x))
            tokens += last - first
            with torch.no_grad():
                hidden = head_inputs(module, ids)[0]
                for name, draft in drafts.items():
                    i = first - 1  # x[i] the last token committed; the step's root is x[i + 1]
                    while i + 1 < last:
                        root = torch.tensor([x[i + 1]])
                        tree, node_tokens = draft(root=root, last_hidden=hidden[i][None])
                        i += 1 + min(accepted_length(tree, node_tokens[0], x[i + 2:]), last - i - 2)
                        steps[name] += 1
        print(json.dumps({"answers": path, "heads": args.heads, "tokens": tokens,
                          **{name: round(tokens / n, 3) for name, n in steps.items()}}), flush=True)


if __name__ == "__main__":
    main()
