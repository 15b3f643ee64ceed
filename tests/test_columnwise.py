"""Column-wise linear layers: the same products as nn.Linear, only where they are faster, and only inside
columnwise_linears (see test_model_untouched for other threads)."""

import pytest
import torch

from medusa_spec import MedusaConfig, MedusaModel, columnwise
from medusa_spec.columnwise import MAX_ROWS, columnwise_linears, linear
from tiny_models import VOCAB, tiny_model


@pytest.mark.parametrize("rows", [0, 1, 2, 7, 12, 15, 16, MAX_ROWS, MAX_ROWS + 1])  # 12, 15: padded to 16
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
    for rows in (1, 3, 9, 10, 15, 16, MAX_ROWS, MAX_ROWS + 1):
        linear(torch.randn(rows, 4), weight)
    linear(torch.randn(3, 4, dtype=torch.bfloat16), weight.bfloat16())
    linear(torch.randn(3, 4, dtype=torch.float64), weight.double())
    # Columns per product: one row, long blocks, bf16 and fp64 keep nn.Linear; 10-15 rows are padded to 16.
    assert calls == [3, 9, 16, 16, 16, MAX_ROWS]


def spy_on_products(monkeypatch):
    """Records (id of the weight, columns) of every column-wise product taken."""
    products = []
    original_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda w, x: products.append((id(w), x.shape[1])) or original_mm(w, x))
    return products


def test_columnwise_linears_route_plain_layers_within_the_block_only(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False))
    x = torch.randn(2, 3, 16)
    expected = model(x)
    products = spy_on_products(monkeypatch)
    with columnwise_linears(model):
        torch.testing.assert_close(model(x), expected)
    assert products == [(id(model[0].weight), 6), (id(model[1].weight), 6)]
    model(x)
    with pytest.raises(RuntimeError, match="boom"), columnwise_linears(model):
        raise RuntimeError("boom")
    model(x)
    assert len(products) == 2  # nothing routed after the block, errors included


def test_subclasses_and_weights_swapped_in_are_left_alone(monkeypatch):
    class Quantised(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(Quantised(4, 4), torch.nn.Linear(4, 4))
    products = spy_on_products(monkeypatch)
    with columnwise_linears(model):
        model(torch.randn(3, 4))
        assert products == [(id(model[1].weight), 3)]
        model[1].weight = torch.nn.Parameter(torch.randn(4, 4))  # as accelerate's offload hooks swap weights in
        model(torch.randn(3, 4))
        assert len(products) == 1


def test_nothing_is_intercepted_unless_fp32_on_cpu(monkeypatch):
    """Off CPU/fp32 `linear` would only fall back to nn.Linear: no mode is pushed, so no op pays for one."""
    calls = []
    monkeypatch.setattr(columnwise, "linear", lambda *a: calls.append(a) or torch.nn.functional.linear(*a))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with columnwise_linears(model.bfloat16(), None):
        model(torch.randn(3, 4, dtype=torch.bfloat16))
    assert not calls
    with columnwise_linears(model.float(), None):
        model(torch.randn(3, 4))
    assert len(calls) == 1


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


def test_mode_is_held_around_the_forwards_only(monkeypatch):
    """The mode adds Python work to every op it sees, so acceptance and the bookkeeping between forwards run
    without it (SmolLM2-135M: accept and commit 5.4 -> 3.1 ms a step)."""
    from medusa_spec import loop

    modes_seen = {}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            modes_seen.setdefault(name, set()).add(torch._C._len_torch_function_stack())
            return fn(*args, **kwargs)
        monkeypatch.setattr(loop, name, wrapped)

    spy("forward_block", loop.forward_block)
    spy("accept_candidates", loop.accept_candidates)
    mm = MedusaModel.from_base(tiny_model("llama"), MedusaConfig(num_heads=2))
    mm.generate(torch.randint(3, VOCAB, (1, 6)), max_new_tokens=6, eos_token_id=[], tree=[[0], [1]])
    assert modes_seen == {"forward_block": {1}, "accept_candidates": {0}}
