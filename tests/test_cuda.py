"""The CUDA path, on tiny models (marked `cuda`: skipped without a CUDA device; scripts/gpu_check.py runs them):
greedy output equals transformers' on the GPU for every architecture, with heads that miss and heads that propose
long runs, in batches, with the draft model and the lookup chain, eagle heads on dynamic trees; one verify pass
gives each node its sequential logits in fp32 and bf16; no column-wise copy is made there; seeded sampling draws
what transformers' does."""

import pytest
import torch

from medusa_spec import (
    DynamicTree,
    MedusaConfig,
    MedusaModel,
    columnwise,
    generate_with_draft,
    generate_with_lookup,
    loop,
    self_draft,
)
from medusa_spec.kv_cache import new_cache
from medusa_spec.slots import prefill
from medusa_spec.tree import build_tree
from medusa_spec.verify import forward_block
from test_eagle import eagle_heads
from test_generate import TREE, OracleHeads, left_padded, medusa, prompt, reference_generate
from tiny_models import ARCHITECTURES, VOCAB, WINDOW, tiny_model

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def on_cuda(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return tiny_model(arch).to(CUDA, dtype)


class CudaOracleHeads(OracleHeads):
    """test_generate's oracle heads, their logits on the hidden states' device."""

    def forward(self, hidden, lm_head):
        return super().forward(hidden, lm_head).to(hidden.device)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_output_equals_transformers_on_cuda(arch):
    model = on_cuda(arch)
    ids = prompt(seed=1).to(CUDA)
    expected = reference_generate(model, ids, max_new_tokens=40, eos_token_id=None)
    missing = medusa(model, share_lm_head=False).generate(ids, max_new_tokens=40, eos_token_id=[], tree=TREE)
    assert torch.equal(missing.sequences, expected)
    out = medusa(model, CudaOracleHeads(model, expected)).generate(ids, max_new_tokens=40, eos_token_id=[], tree=TREE)
    assert torch.equal(out.sequences, expected)
    assert out.stats.tokens_per_step > 2.5, out.stats  # multi-token acceptance and compaction ran on the GPU


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_mixed_length_batch_equals_per_row_generation_on_cuda(arch):
    model = on_cuda(arch)
    rows = [prompt(n, seed=10 + i)[0].to(CUDA) for i, n in enumerate([2 * WINDOW + 3, 4, WINDOW + 1])]
    ids, mask = left_padded([r.cpu() for r in rows])
    per_row = [reference_generate(model, r[None], max_new_tokens=25, eos_token_id=None)[0, len(r):] for r in rows]
    mm = medusa(model, CudaOracleHeads(model, [torch.cat([r, new]) for r, new in zip(rows, per_row)]))
    out = mm.generate(ids.to(CUDA), attention_mask=mask.to(CUDA), max_new_tokens=25, eos_token_id=[], tree=TREE)
    for b in range(len(rows)):
        assert torch.equal(out.sequences[b, ids.shape[1]:], per_row[b]), f"row {b}"


def test_draft_model_and_lookup_chain_equal_transformers_on_cuda():
    model = on_cuda("llama")
    ids = prompt(seed=2).to(CUDA)
    expected = reference_generate(model, ids, max_new_tokens=30, eos_token_id=None)
    drafted = generate_with_draft(model, self_draft(model, 1), ids, max_new_tokens=30, do_sample=False,
                                  eos_token_id=[])
    assert torch.equal(drafted.sequences, expected)
    repeated = torch.cat([ids, ids], dim=1)  # a prompt that repeats itself: the chain finds matches
    expected = reference_generate(model, repeated, max_new_tokens=30, eos_token_id=None)
    looked = generate_with_lookup(medusa(model, share_lm_head=False), repeated, max_new_tokens=30, eos_token_id=[],
                                  lookup_tokens=5, tree=TREE)
    assert torch.equal(looked.sequences, expected)


def test_eagle_heads_on_dynamic_trees_equal_transformers_on_cuda():
    """tree=None (one row: a dynamic tree, its step costs timed on the GPU), a fixed DynamicTree for a left-padded
    batch, and one beside the lookup chain: every tensor the dynamic drafting builds must be on the GPU."""
    model = on_cuda("llama")
    mm = eagle_heads(model, num_heads=3)
    rows = [prompt(seed=20)[0, :10], prompt(seed=21)[0, :5]]
    ids, mask = left_padded(rows)
    per_row = [reference_generate(model, r[None].to(CUDA), max_new_tokens=20, eos_token_id=None)[0, len(r):]
               for r in rows]
    one = mm.generate(rows[0][None].to(CUDA), max_new_tokens=20, eos_token_id=[])
    assert torch.equal(one.sequences[0, len(rows[0]):], per_row[0]) and one.stats.tree_sizes
    for options in (dict(tree=DynamicTree(6)), dict(tree=DynamicTree(6), lookup_tokens=4)):
        out = mm.generate(ids.to(CUDA), attention_mask=mask.to(CUDA), max_new_tokens=20, eos_token_id=[], **options)
        for b in range(len(rows)):
            assert torch.equal(out.sequences[b, ids.shape[1]:], per_row[b]), (options, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_logits_equal_sequential_logits_on_cuda(dtype):
    """One verify pass as the loop runs it (prefill, Slots.verify_inputs, forward_block) against each node's path
    fed whole. fp32 to rounding; bf16 within 5% of the logits' range (its sums round in another order than a
    whole-sequence pass does, to about 1% of a logit)."""
    model = on_cuda("llama", dtype)
    spec = MedusaModel.from_base(model, MedusaConfig(num_heads=3)).spec
    tree = build_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]).to(CUDA)
    ids = prompt(12, seed=3).to(CUDA)
    nodes = torch.randint(3, VOCAB, (1, tree.num_nodes), generator=torch.Generator().manual_seed(4)).to(CUDA)
    with torch.no_grad():
        _, _, slots = prefill(model, spec, ids, torch.ones_like(ids, dtype=torch.bool), new_cache())
        q_pos, kv_valid, kv_pos = slots.verify_inputs(tree.depth)
        logits, _ = forward_block(model, spec, nodes, q_pos, tree.tree_mask, slots.cache, kv_valid, kv_pos)
        for node in range(tree.num_nodes):
            path = tree.node_paths[node, : tree.depth[node] + 1]
            expected = model(torch.cat([ids[0], nodes[0, path]])[None]).logits[0, -1].float()
            got = logits[0, node].float()
            if dtype == torch.float32:
                torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4, msg=f"node {node}")
            else:
                bound = 0.05 * float(expected.max() - expected.min())
                assert float((got - expected).abs().max()) <= bound, f"node {node}"


def test_no_columnwise_copy_is_made_on_cuda(monkeypatch):
    """Column-wise products are for fp32 CPU weights: on CUDA generate runs the model itself (the same spy sees a
    copy made of the CPU model)."""
    copied = []
    original = columnwise.columnwise_copy

    def recording(module, **kwargs):  # the packed weights (packs=) are passed on
        copy = original(module, **kwargs)
        copied.append(copy is not module)
        return copy

    monkeypatch.setattr(loop, "columnwise_copy", recording)
    ids = prompt()
    medusa(tiny_model("llama")).generate(ids, max_new_tokens=8, tree=TREE)
    assert copied == [True]
    copied.clear()
    medusa(on_cuda("llama")).generate(ids.to(CUDA), max_new_tokens=8, tree=TREE)
    assert copied == [False]


def test_seeded_sampling_on_cuda_draws_what_transformers_draws():
    """Speculation off, each token is one draw from the whole vocabulary, as transformers' sampling loop draws it: the
    same seed gives transformers' own sample. With a tree the generator is drawn once per node, so the text is
    another exact sample: the same seed repeats it, another seed changes it."""
    model = tiny_model("llama", lm_head_scale=1.0).to(CUDA)  # unsharpened logits: draws that differ by seed
    mm = medusa(model, share_lm_head=False)
    ids = prompt().to(CUDA)
    options = dict(max_new_tokens=30, do_sample=True, temperature=1.0, top_k=0)
    torch.manual_seed(7)
    ours = mm.generate(ids, eos_token_id=[], tree=[], **options).sequences
    torch.manual_seed(7)
    with torch.no_grad():
        assert torch.equal(ours, model.generate(ids, eos_token_id=None, **options))
    runs = {}
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.setdefault(seed, []).append(mm.generate(ids, eos_token_id=[], tree=TREE, **options).sequences)
    assert torch.equal(*runs[7]) and not torch.equal(runs[7][0], runs[8][0]) and int(runs[7][0].max()) < VOCAB
