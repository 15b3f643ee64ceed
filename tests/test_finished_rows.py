"""A row of a batch that is done (eos, max_new_tokens) leaves it: the verify passes after that step run the rows still
generating alone, with every proposer, and each row's text is still transformers' own (eos, padding, lengths)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from medusa_spec import DynamicTree, MedusaConfig, MedusaModel, generate_with_dflash, generate_with_draft, loop
from test_dependent_heads import random_heads
from test_dflash_decode import random_draft
from test_eagle import eagle_heads
from test_generate import left_padded, medusa, reference_generate
from tiny_models import tiny_model

NEW = 16
TREE = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]
ACCURACY = [[0.8, 0.1], [0.6, 0.1]]


def heads(model, kind: str) -> MedusaModel:
    if kind in ("eagle", "eagle3"):
        return eagle_heads(model, num_heads=3, head_type=kind)
    if kind == "context":
        return random_heads(model, head_type="dependent", context_heads=2, scale=0.1)
    if kind == "accuracies":  # tree=None: AdaptiveTree over the trees these accuracies and the timed costs give
        return MedusaModel.from_base(model, MedusaConfig(num_heads=2, metrics={"eval": {"rank_accuracy": ACCURACY}}))
    return medusa(model)


def timed(mm: MedusaModel) -> MedusaModel:
    mm.tree_table(3)  # tree=None's step costs, timed before the call whose passes the test counts
    return mm


# name -> model -> generate(ids, mask, eos) for each proposer the loop runs
RUNS = {
    "root only": lambda m: partial(heads(m, "plain").generate, tree=[]),
    "medusa heads": lambda m: partial(heads(m, "plain").generate, tree=TREE),
    "context heads": lambda m: partial(heads(m, "context").generate, tree=TREE),
    "eagle heads": lambda m: partial(heads(m, "eagle").generate, tree=TREE),
    "eagle heads, dynamic tree": lambda m: partial(heads(m, "eagle").generate, tree=DynamicTree(6)),
    "eagle3 heads": lambda m: partial(heads(m, "eagle3").generate, tree=TREE),
    "tree=None": lambda m: timed(heads(m, "accuracies")).generate,
    "lookup": lambda m: partial(heads(m, "plain").generate, tree=TREE, lookup_tokens=4),
    "draft model": lambda m: partial(generate_with_draft, m, tiny_model("llama", seed=3)),
    "dflash": lambda m: partial(generate_with_dflash, m, random_draft(m)),
}


def rows_and_eos(model):
    """Three left-padded prompts and an eos token that the first row's greedy text reaches after a few tokens and the
    others' never do: that row finishes early, the others run all NEW tokens."""
    rows = [torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 11, 9)]
    free = [reference_generate(model, row[None], max_new_tokens=NEW, eos_token_id=None)[0, len(row):] for row in rows]
    others = set(torch.cat(free[1:]).tolist())
    eos = next(int(t) for t in free[0][2:8] if int(t) not in others and int(t) not in free[0][:2].tolist())
    return rows, eos


@pytest.mark.parametrize("name", RUNS)
def test_a_finished_row_leaves_the_batch_and_every_text_is_transformers(name, monkeypatch):
    model = tiny_model("llama")
    rows, eos = rows_and_eos(model)
    ids, mask = left_padded(rows)
    expected = reference_generate(model, ids, mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    generate = RUNS[name](model)
    batches, verify = [], loop.verify
    monkeypatch.setattr(loop, "verify", lambda base, spec, slots, candidates, *args: batches.append(
        candidates.node_tokens.shape[0]) or verify(base, spec, slots, candidates, *args))
    out = generate(ids, mask, max_new_tokens=NEW, eos_token_id=[eos], pad_token_id=0)
    assert torch.equal(out.sequences, expected)
    assert out.stats.new_tokens[0] < NEW and out.stats.new_tokens[1:] == [NEW, NEW]
    # Three rows until the step in which the first one finished (its steps: the prefill and those passes), fewer after.
    assert batches.count(3) == out.stats.row_steps[0] - 1 and len(batches) > batches.count(3)
    assert sorted(batches, reverse=True) == batches
