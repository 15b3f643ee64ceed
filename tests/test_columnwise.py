"""Linear layers by the fastest CPU kernel (column-wise, oneDNN): the same products as nn.Linear, only where they
are faster, and only in a columnwise_copy (see test_model_untouched for other threads)."""

import copy
import pickle

import pytest
import torch

from medusa_spec import MedusaConfig, MedusaModel, columnwise
from medusa_spec.columnwise import columnwise_copy, linear
from medusa_spec.heads import MedusaHeads
from test_dependent_heads import random_heads
from tiny_models import VOCAB, tiny_model


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 16, 65, 300])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_nn_linear(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(rows, 24)
    torch.testing.assert_close(linear(x, layer.weight, layer.bias), layer(x))
    x3 = torch.randn(2, rows, 24)  # leading dimensions are kept
    torch.testing.assert_close(linear(x3, layer.weight, layer.bias), layer(x3))
    # nn.Linear's layout too: a transposed view sends sdpa to its slow math kernel and slows elementwise ops.
    assert linear(x3, layer.weight, layer.bias).stride() == layer(x3).stride()
    # A transposed view as the weight (the training loss's gradient product).
    grad = torch.randn(rows, 40)
    torch.testing.assert_close(linear(grad, layer.weight.t()), grad @ layer.weight)


def test_linear_keeps_autograd_where_a_gradient_is_wanted():
    """oneDNN's op has no backward: a product autograd must follow stays nn.Linear, with its gradients."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6)
    x = torch.randn(7, 8, requires_grad=True)
    linear(x, layer.weight, layer.bias).square().sum().backward()
    expected = torch.autograd.grad(layer(x).square().sum(), (x, layer.weight))
    torch.testing.assert_close(x.grad, expected[0])
    torch.testing.assert_close(layer.weight.grad, expected[1])


def spy_on_products(monkeypatch):
    """Records (id of the weight, rows, kernel) of every product taken column-wise ("mm") or by oneDNN (from the
    plain weights: packing is oneDNN's own, tested below)."""
    products = []
    monkeypatch.setattr(columnwise, "ONEDNN_PACK", None)
    original_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda w, x: products.append((id(w), x.shape[1], "mm")) or original_mm(w, x))

    def onednn(x, w, b, *args):  # the op's arguments; nn.Linear stands in where this build lacks the op
        products.append((id(w), x.numel() // x.shape[-1], "onednn"))
        return torch.nn.functional.linear(x, w, b)

    monkeypatch.setattr(columnwise, "ONEDNN_LINEAR", onednn)
    return products


def test_linear_switches_kernel_by_rows_for_fp32_only(monkeypatch):
    products = spy_on_products(monkeypatch)
    weight = torch.randn(8, 4)
    for rows in (1, 2, 3, 4, 5, 16, 300):
        linear(torch.randn(rows, 4), weight)
    linear(torch.randn(3, 4, dtype=torch.bfloat16), weight.bfloat16())
    linear(torch.randn(5, 4, dtype=torch.float64), weight.double())
    linear(torch.randn(5, 4, requires_grad=True), weight)
    # 2-4 rows column-wise, other fp32 counts by oneDNN; bf16, fp64 and autograd keep nn.Linear.
    assert [(rows, kernel) for _, rows, kernel in products] == [
        (1, "onednn"), (2, "mm"), (3, "mm"), (4, "mm"), (5, "onednn"), (16, "onednn"), (300, "onednn")]


def test_linear_falls_back_to_nn_linear_without_onednn(monkeypatch):
    """Off x86, or on a torch build without the op: nn.Linear."""
    monkeypatch.setattr(columnwise, "ONEDNN_LINEAR", None)
    weight = torch.randn(8, 4)
    x = torch.randn(9, 4)
    torch.testing.assert_close(linear(x, weight), x @ weight.t())


def test_columnwise_copy_routes_plain_layers_and_leaves_the_module_alone(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False))
    x = torch.randn(2, 3, 16)
    expected = model(x)
    products = spy_on_products(monkeypatch)
    copy = columnwise_copy(model)
    with torch.no_grad():  # as in decoding: autograd keeps nn.Linear
        torch.testing.assert_close(copy(x), expected)
    assert products == [(id(model[0].weight), 6, "onednn"), (id(model[1].weight), 6, "onednn")]  # the very tensors
    model(x)
    assert len(products) == 2  # the module itself still runs nn.Linear
    assert [type(m) for m in model] == [torch.nn.Linear] * 2


def test_nothing_done_to_the_copy_reaches_the_module():
    """Own containers per copied submodule: hooks (transformers installs its output-capturing hooks at the first
    forward asking for hidden states), children, parameters and training flags set on the copy stay there."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model[1].register_forward_hook(lambda *a: None)  # a hook already there is shared: it runs on the copy too
    copy = columnwise_copy(model)
    assert len(copy[1]._forward_hooks) == 1
    copy[1][0].register_forward_hook(lambda *a: None)
    copy[0].register_forward_pre_hook(lambda *a: None)
    copy[0].extra = torch.nn.Linear(1, 1)
    copy[1][0].weight = torch.nn.Parameter(torch.zeros(4, 4))
    copy.eval()
    assert not model[1][0]._forward_hooks and not model[0]._forward_pre_hooks
    assert not hasattr(model[0], "extra") and len(model[1]._forward_hooks) == 1
    assert bool(model[1][0].weight.detach().any()) and model.training and model[1][0].training


def test_subclasses_are_left_alone_and_shared_modules_stay_shared(monkeypatch):
    class Quantised(torch.nn.Linear):
        pass

    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(Quantised(4, 4), shared, shared)
    products = spy_on_products(monkeypatch)
    copy = columnwise_copy(model)
    assert type(copy[0]) is Quantised and copy[1] is copy[2]
    with torch.no_grad():
        copy(torch.randn(2, 4))
    assert products == [(id(shared.weight), 2, "mm")] * 2


def test_nothing_is_copied_unless_fp32_on_cpu():
    """Off CPU/fp32 `linear` would only fall back to nn.Linear: the module itself runs."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert columnwise_copy(model.bfloat16()) is model and columnwise_copy(None) is None
    assert columnwise_copy(model.float()) is not model


def test_an_eval_mode_copy_is_made_for_a_module_in_train_mode_on_any_dtype():
    """eval_mode: the copy's modules in eval mode, the module's own left in train mode; a module already in eval mode
    off CPU/fp32 runs itself."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).bfloat16().eval()
    assert columnwise_copy(model, eval_mode=True) is model
    model.train()
    for dtype in (torch.bfloat16, torch.float32):
        copy = columnwise_copy(model.to(dtype), eval_mode=True)
        assert copy is not model and not any(m.training for m in copy.modules())
        assert all(m.training for m in model.modules())


@pytest.mark.parametrize("head_type", ["medusa", "dependent"])
def test_generate_runs_tree_and_heads_columnwise(head_type, monkeypatch):
    """The decoding loop really takes the column-wise path in every plain Linear (decoder layers, LM head,
    heads)."""
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2, head_type=head_type))
    weights = {id(m.weight) for m in mm.modules() if type(m) is torch.nn.Linear}
    products = spy_on_products(monkeypatch)
    ids = torch.randint(3, VOCAB, (2, 6))  # two rows, so the heads' products are column-wise too
    out = mm.generate(ids, max_new_tokens=6, eos_token_id=[], tree=[[0], [1], [0, 0]])
    assert out.sequences.shape[1] == 12
    assert weights <= {weight for weight, _, _ in products}
    # Tree passes of 4 nodes over two rows by oneDNN, the heads' two rows column-wise.
    assert {(8, "onednn"), (2, "mm")} <= {(rows, kernel) for _, rows, kernel in products}



def test_copy_attends_to_grouped_keys_in_place_and_leaves_the_config_alone(monkeypatch):
    """A masked multi-row query (a tree's verify pass) attends to the key/value heads without transformers'
    repeat_kv copy, with the same result; the module's own config still names sdpa."""
    from transformers.integrations import sdpa_attention

    model = tiny_model("llama")  # 4 query heads over 2 key/value heads
    config_before = dict(vars(model.config))
    ids = torch.randint(3, VOCAB, (1, 9))
    mask = torch.ones(1, 1, 9, 9, dtype=torch.bool).tril()
    mask[..., 6:, 6:] = torch.eye(3, dtype=torch.bool)  # three siblings after a 6-token prefix, as in a tree
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        repeats = []
        original = sdpa_attention.repeat_kv
        monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: repeats.append(1) or original(*a))
        copy = columnwise_copy(model)
        got = copy(ids, attention_mask=mask).logits
        assert not repeats
        model(ids, attention_mask=mask)
        assert repeats  # the module itself still takes transformers' path
    torch.testing.assert_close(got, expected)
    assert dict(vars(model.config)) == config_before and model.config._attn_implementation == "sdpa"
    layers = [m for m in copy.modules() if hasattr(m, "num_key_value_groups")]
    assert len({id(m.config) for m in layers}) == 1 and layers[0].config is not model.config


def test_a_compiled_one_row_pass_attends_to_grouped_keys_in_place(monkeypatch):
    """Traced for a graph (torch.compile), a one-row query of the copy attends to the key/value heads without
    transformers' repeat_kv copy, which transformers takes there (eagerly it folds the group into the row): the
    same logits as the model's eager pass."""
    from transformers.integrations import sdpa_attention

    model = tiny_model("llama")  # 4 query heads over 2 key/value heads
    ids = torch.randint(3, VOCAB, (1, 7))
    mask = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    mask[..., 2] = False  # a masked slot: transformers' sdpa path keeps the mask, as in a verify pass over a buffer
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).past_key_values
        expected = model(ids[:, 6:], cache=copy.deepcopy(cache), attention_mask=mask).logits
        repeats = []
        original = sdpa_attention.repeat_kv
        monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: repeats.append(1) or original(*a))
        layers = columnwise_copy(model, eval_mode=True, linears=False)
        torch._dynamo.reset()
        got = torch.compile(lambda i, c: layers(i, cache=c, attention_mask=mask).logits, backend="eager",
                            fullgraph=False)(ids[:, 6:], copy.deepcopy(cache))
        torch._dynamo.reset()
    assert not repeats
    torch.testing.assert_close(got, expected)


def test_training_runs_a_frozen_base_through_the_fast_kernels_and_a_trained_one_through_autograd(monkeypatch):
    from medusa_spec.train.module import TrainModule

    torch.manual_seed(0)
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    base_weights = {id(m.weight) for m in model.model.layers.modules() if type(m) is torch.nn.Linear}
    module = TrainModule(model, mm.heads, mm.spec.bool_mask, mm.spec.takes_logits_to_keep)
    ids = torch.randint(3, VOCAB, (2, 7))
    positions, segments = torch.arange(7).expand_as(ids), torch.ones_like(ids)
    expected = model(ids, output_hidden_states=True).hidden_states[-1]
    products = spy_on_products(monkeypatch)
    frozen = module(ids, positions, segments)
    assert base_weights <= {weight for weight, rows, kernel in products if (rows, kernel) == (14, "onednn")}
    torch.testing.assert_close(frozen.hidden, expected)
    products.clear()
    trained = module(ids, positions, segments, train_base=True)  # Medusa-2: gradients reach the base
    assert not base_weights & {weight for weight, _, _ in products}
    trained.hidden.sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    assert not any(isinstance(m, columnwise.ColumnwiseLinear) for m in model.modules())  # the caller's model: as it was


needs_onednn = pytest.mark.skipif(columnwise.ONEDNN_PACK is None, reason="oneDNN's packing is x86-only")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 65, 300])
def test_packed_weights_give_the_plain_products(rows, monkeypatch):
    """From 2 rows on bit-identical to oneDNN on the plain weight; one row rounds as another kernel may. Any row
    count takes the pack, column-wise's 2-4 too."""
    torch.manual_seed(rows)
    layer = torch.nn.Linear(24, 40)
    pack = columnwise.PackedWeights().get(layer.weight)
    x = torch.randn(2, rows, 24)
    with torch.no_grad():
        monkeypatch.setattr(torch, "mm", None)  # never column-wise from a pack
        got = linear(x, layer.weight, layer.bias, pack)
        monkeypatch.undo()
        torch.testing.assert_close(got, layer(x))
        if rows > 1:
            assert torch.equal(got, columnwise.ONEDNN_LINEAR(x, layer.weight, layer.bias, "none", [], ""))


@needs_onednn
def test_a_pack_is_kept_while_its_weight_holds_the_same_values_and_dropped_with_it(monkeypatch):
    packs = columnwise.PackedWeights()
    calls = []
    pack_op = columnwise.ONEDNN_PACK
    monkeypatch.setattr(columnwise, "ONEDNN_PACK", lambda w, rows: calls.append(1) or pack_op(w, rows))
    layer = torch.nn.Linear(16, 8)
    first = packs.get(layer.weight)
    assert packs.get(layer.weight) is first and len(calls) == 1
    x = torch.randn(3, 16)
    # An edit the version counter does not see (peft's merge_adapter adds its delta through .data) is packed again.
    layer.weight.data[2, 5] += 0.5
    second = packs.get(layer.weight)
    assert second is not first and len(calls) == 2
    with torch.no_grad():
        torch.testing.assert_close(linear(x, layer.weight, layer.bias, second), layer(x))
    assert packs.get(torch.nn.Linear(16, 8, dtype=torch.float64).weight) is None  # oneDNN's fp32 only
    del layer, first, second
    assert not packs.packs  # a weight that is gone takes its pack with it


@needs_onednn
def test_weights_are_not_packed_where_memory_runs_short(monkeypatch):
    """A pack is a second copy of its weight: none is made that would leave under a quarter of memory available."""
    layer = torch.nn.Linear(256, 256)  # 256 KiB
    memory = type("Memory", (), {"total": 4 << 20, "available": (1 << 20) + layer.weight.nbytes - 1})
    monkeypatch.setattr(columnwise.psutil, "virtual_memory", lambda: memory)
    assert columnwise.PackedWeights().get(layer.weight) is None
    memory.available += 1
    assert columnwise.PackedWeights().get(layer.weight) is not None


@needs_onednn
def test_generate_packs_once_and_follows_a_weight_edited_between_calls(monkeypatch):
    """The packs a MedusaModel keeps never outlive the values they were made from: after a .data edit of the base
    model, generate is again token-identical to transformers' greedy generate on the edited model."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    calls = []
    pack_op = columnwise.ONEDNN_PACK
    monkeypatch.setattr(columnwise, "ONEDNN_PACK", lambda w, rows: calls.append(1) or pack_op(w, rows))
    ids = torch.randint(3, VOCAB, (1, 6))
    tree = [[0], [1], [0, 0], [0, 1], [1, 0]]
    mm.generate(ids, max_new_tokens=8, eos_token_id=[], tree=tree)
    packed = len(calls)
    assert packed == sum(type(m) is torch.nn.Linear for m in mm.modules())  # the base's layers and the heads'
    mm.generate(ids, max_new_tokens=8, eos_token_id=[], tree=tree)
    assert len(calls) == packed  # kept from call to call
    for layer in model.model.layers:
        layer.mlp.down_proj.weight.data.mul_(-3.0)  # as a merge through .data: no version bump
    out = mm.generate(ids, max_new_tokens=8, eos_token_id=[], tree=tree)
    assert len(calls) == packed + len(model.model.layers)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(out.sequences, expected)


@needs_onednn
@pytest.mark.parametrize("head_type", ["dependent", "eagle"])
def test_heads_draft_from_packs_of_their_layers_and_draft_vocabulary_on_the_copy_only(head_type, monkeypatch):
    """generate packs the heads' layers and their draft vocabulary's projection (the base LM head's rows for the token
    map, a buffer, not a layer) as it packs the base's: SmolLM2-135M's 4,096-row projection took 0.40 ms a level
    plain and 0.10 packed. The packs go on the loop's copy of the heads; the caller's heads never hold one, and
    the output stays transformers' greedy output."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    mm = random_heads(model, num_heads=2, head_type=head_type, draft_vocab_size=40, scale=0.3)
    packed_from = []
    pack_op = columnwise.ONEDNN_PACK
    monkeypatch.setattr(columnwise, "ONEDNN_PACK", lambda w, rows: packed_from.append(w) or pack_op(w, rows))
    drafted_from = []
    project = MedusaHeads.project

    def spying_project(heads, states, base_lm_head, head=None):
        drafted_from.append((heads is mm.heads, heads.draft_lm_packed))
        return project(heads, states, base_lm_head, head)

    monkeypatch.setattr(MedusaHeads, "project", spying_project)
    ids = torch.randint(3, VOCAB, (1, 6))
    out = mm.generate(ids, max_new_tokens=8, eos_token_id=[], tree=[[0], [1], [0, 0], [0, 1]])
    draft_lm_weight = mm.heads.draft_lm_weight
    packed = {w.data_ptr() for w in packed_from}  # PackedWeights packs a detached view of each weight
    assert draft_lm_weight.data_ptr() in packed
    assert {m.weight.data_ptr() for m in mm.heads.modules() if type(m) is torch.nn.Linear} <= packed
    pack = mm._packed_weights.get(draft_lm_weight)
    assert drafted_from and all(not caller and drafted is pack for caller, drafted in drafted_from)
    assert mm.heads.draft_lm_packed is None
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert torch.equal(out.sequences, expected)


@needs_onednn
def test_an_in_place_edit_the_probe_product_cannot_see_is_packed_again(monkeypatch):
    """One entry of a weight moved by one ulp, where the probe's product (one row against a fixed random vector) rounds
    to what it was: the next generate packs that weight again, and its pack gives the edited entry."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    ids = torch.randint(3, VOCAB, (1, 6))
    tree = [[0], [1], [0, 0]]
    mm.generate(ids, max_new_tokens=4, eos_token_id=[], tree=tree)
    weight = model.model.layers[0].mlp.down_proj.weight
    packs = mm._packed_weights
    probe = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(weight.shape[1]))
    seen = columnwise.ONEDNN_LINEAR(probe, weight.detach(), None, "none", [], "")
    edited = weight.detach().clone()
    for i, j in zip(*torch.randperm(edited.numel()).reshape(2, -1)):  # entries, in a fixed random order
        i, j = int(i) % edited.shape[0], int(j) % edited.shape[1]
        edited[i, j] = torch.nextafter(weight[i, j], torch.tensor(float("inf")))
        if torch.equal(columnwise.ONEDNN_LINEAR(probe, edited, None, "none", [], ""), seen):
            break
        edited[i, j] = weight[i, j]
    else:
        pytest.fail("no one-ulp edit the probe cannot see")
    repacked = []
    pack_op = columnwise.ONEDNN_PACK
    monkeypatch.setattr(columnwise, "ONEDNN_PACK", lambda w, rows: repacked.append(w.data_ptr()) or pack_op(w, rows))
    with torch.no_grad():
        weight[i, j] = edited[i, j]
    mm.generate(ids, max_new_tokens=4, eos_token_id=[], tree=tree)
    assert repacked == [weight.data_ptr()]
    column = torch.zeros(2, weight.shape[1])
    column[:, j] = 1.0  # two rows: a pack's product is then bit-identical to the plain weight's
    assert torch.equal(columnwise.ONEDNN_LINEAR(column, packs.get(weight), None, "none", [], "")[0], edited[:, j])


def test_a_medusa_model_pickles_and_copies_after_a_call():
    """The packed weights are a cache: a pickled or deep-copied MedusaModel leaves them behind and packs its own."""
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2))
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    out = mm.generate(ids, max_new_tokens=6, eos_token_id=[], tree=[[0], [1]]).sequences
    for again in (pickle.loads(pickle.dumps(mm)), copy.deepcopy(mm)):
        assert torch.equal(again.generate(ids, max_new_tokens=6, eos_token_id=[], tree=[[0], [1]]).sequences, out)
