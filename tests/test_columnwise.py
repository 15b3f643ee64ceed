"""Column-wise linear layers: the same products as nn.Linear, only where they are faster, and every
layer handed back its own forward."""

from functools import partial

import pytest
import torch

from medusa_spec import MedusaConfig, MedusaModel
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


def test_columnwise_linears_switch_plain_layers_and_restore_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8, bias=False))
    hooked = model[1]
    own_forward = hooked.forward
    hooked.forward = own_forward  # a forward of its own, as accelerate's offload hooks set
    x = torch.randn(2, 3, 16)
    expected = model(x)
    with columnwise_linears(model):
        assert isinstance(vars(model[0])["forward"], partial)
        assert vars(hooked)["forward"] is own_forward
        torch.testing.assert_close(model(x), expected)
    assert "forward" not in vars(model[0]) and vars(hooked)["forward"] is own_forward
    with pytest.raises(RuntimeError, match="boom"), columnwise_linears(model):
        raise RuntimeError("boom")
    assert "forward" not in vars(model[0])  # handed back on an error too


def test_subclasses_are_left_alone():
    class Quantised(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(Quantised(4, 4), torch.nn.Linear(4, 4))
    with columnwise_linears(model):
        assert "forward" not in vars(model[0]) and "forward" in vars(model[1])


@pytest.mark.parametrize("head_type", ["medusa", "dependent"])
def test_generate_runs_tree_and_heads_columnwise_then_hands_layers_back(head_type):
    """The decoding loop really takes the column-wise path in every plain Linear (decoder layers, LM
    head, heads) and leaves the model as it found it."""
    model = tiny_model("llama")
    mm = MedusaModel.from_base(model, MedusaConfig(num_heads=2, head_type=head_type))
    layers = [m for m in mm.modules() if type(m) is torch.nn.Linear]
    switched, rows = [], []

    def record(module, inputs, output):
        switched.append(isinstance(vars(module).get("forward"), partial))
        rows.append(inputs[0].numel() // inputs[0].shape[-1])

    hooks = [m.register_forward_hook(record) for m in layers]
    ids = torch.randint(3, VOCAB, (1, 6))
    out = mm.generate(ids, max_new_tokens=6, eos_token_id=[], tree=[[0], [1], [0, 0]])
    for hook in hooks:
        hook.remove()
    assert out.sequences.shape[1] == 12
    assert all(switched) and max(rows) >= 4  # tree passes of 4 nodes ran through the switched layers
    assert all("forward" not in vars(m) for m in layers)
