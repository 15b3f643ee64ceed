"""Column-wise linear layers: the same products as nn.Linear, only where they are faster, and only in a
columnwise_copy (see test_model_untouched for other threads)."""

import pytest
import torch

from medusa_spec import MedusaConfig, MedusaModel
from medusa_spec.columnwise import MAX_ROWS, columnwise_copy, linear
from tiny_models import VOCAB, tiny_model


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 7, 12, 15, 16, MAX_ROWS, MAX_ROWS + 1])  # 3, 7, 12, 15: padded
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


def test_linear_switches_kernel_only_for_a_few_fp32_rows(monkeypatch):
    calls = []
    original_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a: calls.append(a[1].shape[1]) or original_mm(*a))
    weight = torch.randn(8, 4)
    for rows in (1, 2, 3, 5, 7, 9, 10, 15, 16, MAX_ROWS, MAX_ROWS + 1):
        linear(torch.randn(rows, 4), weight)
    linear(torch.randn(3, 4, dtype=torch.bfloat16), weight.bfloat16())
    linear(torch.randn(3, 4, dtype=torch.float64), weight.double())
    # Columns per product: one row, long blocks, bf16 and fp64 keep nn.Linear; 3, 7 and 10-15 rows are padded to the
    # next size MKL computes faster.
    assert calls == [2, 4, 5, 8, 9, 16, 16, 16, MAX_ROWS]


def spy_on_products(monkeypatch):
    """Records (id of the weight, columns) of every column-wise product taken."""
    products = []
    original_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda w, x: products.append((id(w), x.shape[1])) or original_mm(w, x))
    return products


def test_columnwise_copy_routes_plain_layers_and_leaves_the_module_alone(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False))
    x = torch.randn(2, 3, 16)
    expected = model(x)
    products = spy_on_products(monkeypatch)
    copy = columnwise_copy(model)
    torch.testing.assert_close(copy(x), expected)
    assert products == [(id(model[0].weight), 6), (id(model[1].weight), 6)]  # the very tensors, shared
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
    copy(torch.randn(2, 4))
    assert products == [(id(shared.weight), 2)] * 2


def test_nothing_is_copied_unless_fp32_on_cpu():
    """Off CPU/fp32 `linear` would only fall back to nn.Linear: the module itself runs."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert columnwise_copy(model.bfloat16()) is model and columnwise_copy(None) is None
    assert columnwise_copy(model.float()) is not model


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
    assert weights <= {weight for weight, _ in products}
    assert 8 in {columns for _, columns in products}  # tree passes of 4 nodes, two rows (the prefill: 16)



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
