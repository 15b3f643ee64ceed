"""generate(compile=True): the verify pass through torch.compile'd graphs of the base model (medusa_spec.compiled),
as lossless as the eager one, on every architecture, and invisible to the caller's model."""

import pytest
import torch

from medusa_spec import DynamicTree, autotree, compiled, propose, slots
from test_dynamic_tree import SETTINGS
from test_eagle import eagle_heads
from test_generate import TREE, OracleHeads, left_padded, medusa, prompt, reference_generate
from test_model_untouched import module_state
from tiny_models import ARCHITECTURES, tiny_model


@pytest.fixture(autouse=True)
def quick_kernels(request, monkeypatch):
    """inductor's plain CPU kernels (weights frozen; no search among GEMM kernels, no C++ wrapper) for the tests of
    what the loop does around its graphs, which then compile in a fraction of the time; the tests marked
    shipped_kernels compile with the options generate uses (compiled.compile_options), on every architecture."""
    if request.node.get_closest_marker("shipped_kernels") is None:
        monkeypatch.setattr(compiled, "compile_options",
                            lambda device, dtype: {"freezing": True} if device.type == "cpu" else {})


@pytest.mark.shipped_kernels
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_compiled_greedy_equals_transformers_on_every_architecture(arch):
    """Speculation off (the 1-node graph) and a 7-node tree (the 8-node graph, padded) on one MedusaModel, over
    prompts of other lengths: each call's cache is a new buffer, which the graphs must write, not the buffer they
    were compiled with (marked as a static address, freezing folded it into the graph as a constant)."""
    model = tiny_model(arch)
    texts = [reference_generate(model, prompt(length, seed=seed), max_new_tokens=30, eos_token_id=None)
             for seed, length in ((1, 11), (2, 6))]
    mm = medusa(model, OracleHeads(model, [texts[0][0]]))
    out = mm.generate(texts[0][:, :11], max_new_tokens=30, eos_token_id=[], tree=TREE, compile=True)
    assert torch.equal(out.sequences, texts[0])
    assert out.stats.tokens_per_step > 2.0, out.stats  # the oracle's tree was accepted: the tree mask held
    for text, length in zip(texts, (11, 6)):
        out = mm.generate(text[:, :length], max_new_tokens=30, eos_token_id=[], tree=[], compile=True)
        assert torch.equal(out.sequences, text)
    assert {shape[:2] for shape in mm._compiled.shapes} == {(1, 1), (1, 8)}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compiled_padded_batch_and_a_grown_cache_equal_per_row_generation(arch, monkeypatch):
    """Rows of different lengths (sync points, padding slots) and a cache buffer too small for the whole call: it
    grows and the text goes on exactly, through the graphs it had: one graph serves every length of text (the
    slots a pass attends to are a dynamic dimension), where one per buffer size took minutes each to compile."""
    monkeypatch.setattr(compiled, "CACHE_SLOTS", 8)
    monkeypatch.setattr(compiled, "ROOM_AFTER", 0)
    adopted = []
    adopt = compiled.adopt
    for module in (compiled, slots):
        monkeypatch.setattr(module, "adopt", lambda cache, slots: adopted.append(slots) or adopt(cache, slots))
    model = tiny_model(arch)
    rows = [prompt(13, seed=10)[0], prompt(4, seed=11)[0]]
    ids, mask = left_padded(rows)
    per_row = [reference_generate(model, row[None], max_new_tokens=25, eos_token_id=None)[0] for row in rows]
    mm = medusa(model, OracleHeads(model, per_row))
    out = mm.generate(ids, attention_mask=mask, max_new_tokens=25, eos_token_id=[], tree=TREE, compile=True)
    for b, row in enumerate(rows):
        assert torch.equal(out.sequences[b, ids.shape[1]:], per_row[b][len(row):]), b
    assert len(adopted) > 1, adopted  # the buffer grew
    assert mm._compiled.shapes == {(2, 8)}, mm._compiled.shapes  # the tree's block alone


def test_a_compiled_shape_never_compiles_again(monkeypatch):
    """After each block's graph is compiled (by compile_blocks, whose timed chains are expanded views of one token),
    no later call compiles again: not for other text lengths, nor on buffers of other sizes (the windows' strides
    stay the same). A graph guards on its inputs' strides, a compile takes minutes on a CPU, and such a silent one
    once landed inside a benchmark's timed steps."""
    monkeypatch.setattr(compiled, "CACHE_SLOTS", 8)
    monkeypatch.setattr(compiled, "ROOM_AFTER", 0)
    model = tiny_model("llama")
    texts = [reference_generate(model, prompt(length, seed=seed), max_new_tokens=24, eos_token_id=None)
             for seed, length in ((1, 11), (2, 5), (3, 19))]
    mm = medusa(model, OracleHeads(model, [texts[0][0]]))
    mm.compile_blocks([1, 8])
    with torch.compiler.set_stance("fail_on_recompile"):  # a compile would raise
        for text, length in zip(texts, (11, 5, 19)):
            for tree in (TREE, []):
                out = mm.generate(text[:, :length], max_new_tokens=24, eos_token_id=[], tree=tree, compile=True)
                assert torch.equal(out.sequences, text)
    assert mm._compiled.shapes == {(1, 1), (1, 8)}


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_compiled_dynamic_trees_are_lossless_and_priced_by_the_compiled_graphs(head_type, monkeypatch):
    """Each size is priced at its block's compiled pass plus drafting, each the fastest of COMPILED_REPEATS timings:
    with 2, a busy moment moved the size chosen from run to run."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=3, head_type=head_type, seed=1 if head_type == "eagle" else 2)
    timings = []
    fastest = autotree._fastest_seconds
    monkeypatch.setattr(autotree, "_fastest_seconds",
                        lambda fns, repeats, device: timings.append(repeats) or fastest(fns, repeats, device))
    ids = prompt(seed=6)[:, :10]
    text = reference_generate(model, ids, max_new_tokens=24, eos_token_id=None)
    for tree in (DynamicTree(6), None):  # 6 nodes: padded to the 8-node graph
        out = mm.generate(ids, max_new_tokens=24, eos_token_id=[], tree=tree, compile=True)
        assert torch.equal(out.sequences, text), tree
    priced = next(iter(mm._trees.compiled_trees.values()))
    assert priced.nodes == 8 and len(priced.step_ms) == 8
    assert timings == [autotree.COMPILED_REPEATS] * 2, timings  # the verify passes, then the drafting
    assert {shape[1] for shape in mm._compiled.shapes} == {1, 2, 4, 8}  # the only graphs its steps ran
    # Sizes 5..8 run one graph, the 8-node one, and 3..4 the 4-node one: with drafting free, they cost the same.
    free = autotree.compiled_dynamic_tree(mm, mm._compiled, {1: 0.0, 8: 0.0})
    assert len(set(free.step_ms[4:])) == 1 and free.step_ms[2] == free.step_ms[3] != free.step_ms[4]


@pytest.mark.parametrize("head_type", ["eagle", "eagle3"])
def test_compiled_drafting_drafts_what_eager_drafting_drafts(head_type, monkeypatch):
    """With compile=True eagle heads' draft-layer passes run through graphs of their own (compiled.DraftGraphs): the
    same candidates at every step as the same passes eager (both on the compiled verify pass), on a dynamic tree
    and a static one; a step's update pass is padded to one width, so that later calls, other lengths of text
    included, compile nothing again."""
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=3, head_type=head_type, seed=3)
    drafted = []
    for cls in (propose.DraftLayerProposer, propose.DynamicDraftLayerProposer):
        own = cls.propose
        monkeypatch.setattr(cls, "propose", lambda self, root, own=own: drafted.append(own(self, root)) or drafted[-1])
    with_graphs = autotree.heads_proposer

    def eager_drafting(base, heads, tree, packs=None, graphs=None):
        return with_graphs(base, heads, tree, packs)

    texts = [reference_generate(model, prompt(seed=seed)[:, :length], max_new_tokens=24, eos_token_id=None)
             for seed, length in ((6, 10), (7, 5))]
    for tree in (DynamicTree(6), [[0], [1], [0, 0], [0, 0, 0]]):
        runs = []
        for graphs in (False, True):
            monkeypatch.setattr(autotree, "heads_proposer", with_graphs if graphs else eager_drafting)
            drafted.clear()
            out = mm.generate(texts[0][:, :10], max_new_tokens=24, eos_token_id=[], tree=tree, compile=True)
            assert torch.equal(out.sequences, texts[0])
            runs.append([(c.node_tokens, c.tree.tree_mask) for c in drafted])
        assert len(runs[0]) == len(runs[1]) > 5
        for (tokens, mask), (tokens_c, mask_c) in zip(*runs):
            assert torch.equal(tokens, tokens_c) and torch.equal(mask, mask_c)
        if isinstance(tree, DynamicTree):  # its beam and top_k (4), every update's width (depth 3 + 1)
            assert mm._compiled.draft.shapes == {(1, 4)}, mm._compiled.draft.shapes
    assert mm._compiled.draft.shapes == {(1, 4), (1, 2), (1, 1)}  # and the static tree's levels, 2 and 1 wide
    with torch.compiler.set_stance("fail_on_recompile"):
        for tree in (DynamicTree(6), [[0], [1], [0, 0], [0, 0, 0]]):
            out = mm.generate(texts[1][:, :5], max_new_tokens=24, eos_token_id=[], tree=tree, compile=True)
            assert torch.equal(out.sequences, texts[1])


def test_compile_blocks_also_compiles_the_draft_updates_of_a_lookup_chains_paths(monkeypatch):
    """bench warms up with compile_blocks for the blocks a lookup chain adds: with eagle heads the draft layer's
    update pass after a step that accepted a chain longer than the heads' tree (padded to its block size) is
    compiled there too, not inside a timed call (where a compile once took 29 s of one prompt's)."""
    monkeypatch.setattr(compiled, "BLOCK_SIZES", (1, 8, 64))  # fewer graphs to compile
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=2, seed=3)
    text = reference_generate(model, prompt(seed=8)[:, :10], max_new_tokens=30, eos_token_id=None)
    tree = [[0], [0, 0]]  # depth 2: an update pass of 3 slots, and of a block of 8 after a longer path
    mm.generate(text[:, :10], max_new_tokens=4, eos_token_id=[], tree=tree, compile=True)  # bench's warm-up call
    mm.compile_blocks([8])
    with torch.compiler.set_stance("fail_on_recompile"):  # a compile would raise
        out = mm.generate(text[:, :10], max_new_tokens=20, eos_token_id=[], tree=tree, lookup_tokens=4,
                          documents=[text[0, 10:].tolist()], compile=True)  # the chain: the text itself
    assert torch.equal(out.sequences, text[:, :30])
    assert sum(out.stats.accepted_at_depth[2:]) > 0  # a path of 4+ slots: an update pass of the 8-slot block


@pytest.mark.parametrize("sampling", SETTINGS[1:3], ids=str)
def test_compiled_sampling_draws_what_eager_sampling_draws(sampling):
    """Same seed, same draws: the compiled pass gives the eager pass's distribution (to rounding), and the loop's
    sampling is the one the eager loop's chi-square tests cover."""
    model = tiny_model("llama")
    mm = medusa(model, share_lm_head=False)
    ids = prompt(seed=3)
    options = dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0,
                   top_p=sampling.top_p or 1.0)
    runs = []
    for compile_ in (False, True):
        torch.manual_seed(5)
        runs.append(mm.generate(ids, max_new_tokens=20, eos_token_id=[], tree=TREE, compile=compile_,
                                **options).sequences)
    assert torch.equal(*runs)


def test_the_prompts_last_token_runs_through_the_compiled_graph(monkeypatch):
    """Prefill runs the prompt's last token through the one-node graph where it is compiled (an eager one-token pass
    of SmolLM2-135M costs 2.5 times the graph's on a CPU): greedy output unchanged, no eager full-model pass."""
    model = tiny_model("llama")
    text = reference_generate(model, prompt(11, seed=1), max_new_tokens=20, eos_token_id=None)
    mm = medusa(model, share_lm_head=False)
    mm.compile_blocks([1])
    eager = []
    forward_block = slots.forward_block
    monkeypatch.setattr(slots, "forward_block", lambda *args, **kwargs: eager.append(1) or forward_block(*args,
                                                                                                         **kwargs))
    out = mm.generate(text[:, :11], max_new_tokens=20, eos_token_id=[], tree=[], compile=True)
    assert torch.equal(out.sequences, text)
    assert eager == []
    assert mm._compiled.shapes == {(1, 1)}


def test_changed_weights_are_compiled_again():
    """Freezing copies the weights into the graphs: an edit through .data (as peft's merge_adapter makes), which
    leaves the version counter as it was, must still reach the next call."""
    model = tiny_model("llama")
    mm = medusa(model, share_lm_head=False)
    ids = prompt(seed=4)
    mm.generate(ids, max_new_tokens=5, eos_token_id=[], tree=[], compile=True)
    first = mm._compiled.run
    with torch.no_grad():
        model.get_output_embeddings().weight.data[:, :8] *= -1.0
    expected = reference_generate(model, ids, max_new_tokens=20, eos_token_id=None)
    out = mm.generate(ids, max_new_tokens=20, eos_token_id=[], tree=[], compile=True)
    assert torch.equal(out.sequences, expected)
    assert mm._compiled.run is not first
    mm.generate(ids, max_new_tokens=5, eos_token_id=[], tree=[], compile=True)
    assert len(mm._compiled.shapes) == 1  # the same weights again: nothing compiled again


def test_a_changed_config_setting_is_compiled_again():
    """The graphs guard on their arguments alone (compiled._guards_on_arguments), not on what the model reads from its
    config: a setting the forward reads at run time (Gemma's final logit softcapping) compiles the graphs again at
    the next call, as for changed weights. Before, dynamo's own guard on it recompiled outside the raised recompile
    limit, and the call failed."""
    model = tiny_model("gemma3")
    mm = medusa(model, share_lm_head=False)
    ids = prompt(seed=4)
    mm.generate(ids, max_new_tokens=5, eos_token_id=[], tree=[], compile=True)
    first = mm._compiled.run
    model.config.final_logit_softcapping = 0.5
    expected = reference_generate(model, ids, max_new_tokens=20, eos_token_id=None)
    out = mm.generate(ids, max_new_tokens=20, eos_token_id=[], tree=[], compile=True)
    assert torch.equal(out.sequences, expected)
    assert mm._compiled.run is not first


def test_a_graph_guards_its_arguments_not_the_frozen_model(monkeypatch):
    """Before every call dynamo checks each guard of a graph: on SmolLM2-135M 7,580 of them, mostly on the model copy
    whose weights the graph froze, about 1 ms of a 20 ms step. The graphs keep those on their arguments (shapes,
    strides, the cache's layout) and torch's global state; a new shape still compiles its own graph."""
    seen = []
    choose = compiled._guards_on_arguments

    def recorded(*arguments):
        keep = choose(*arguments)
        return lambda entries: seen.append((entries, keep(entries))) or seen[-1][1]

    monkeypatch.setattr(compiled, "_guards_on_arguments", recorded)
    model = tiny_model("llama")
    mm = eagle_heads(model, num_heads=2, head_type="eagle", seed=1)
    mm.generate(prompt(seed=5)[:, :10], max_new_tokens=12, eos_token_id=[], tree=DynamicTree(4), compile=True)
    assert len(seen) >= 2  # the verify graphs and the draft layer's
    for entries, keep in seen:
        kept = [entry for entry, flag in zip(entries, keep) if flag]
        assert 0 < len(kept) < len(entries) / 4, (len(kept), len(entries))
        assert not any(entry.name.startswith(("model", "layer")) for entry in kept)  # the closed-over copies
        assert any(entry.name.startswith("cache") and entry.guard_type == "TENSOR_MATCH" for entry in kept)
    ids = prompt(seed=5)[:, :10].repeat(2, 1)  # two rows: a new shape, its own graph
    out = mm.generate(ids, max_new_tokens=12, eos_token_id=[], tree=[], compile=True)
    assert (2, 1) in mm._compiled.shapes
    assert torch.equal(out.sequences, reference_generate(model, ids, max_new_tokens=12, eos_token_id=None))


def test_compiling_leaves_the_callers_model_as_it_was():
    model = tiny_model("llama").train()
    before = module_state(model)
    mm = medusa(model, share_lm_head=False)
    mm.generate(prompt(seed=5), max_new_tokens=10, eos_token_id=[], tree=TREE, compile=True)
    assert module_state(model) == before  # no hooks, flags or compiled forwards on the caller's modules
    assert model.training


def test_a_cpu_without_a_cpp_compiler_is_told_what_to_install(monkeypatch):
    monkeypatch.setattr(compiled, "cpp_compiler", lambda: None)
    mm = medusa(tiny_model("llama"), share_lm_head=False)
    with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler .* install one"):
        mm.generate(prompt(seed=5), max_new_tokens=4, tree=[], compile=True)


def test_block_sizes():
    assert [compiled.block_size(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 64, 65, 130)] == [1, 2, 4, 8, 8, 16, 16, 32, 64,
                                                                                       128, 192]
