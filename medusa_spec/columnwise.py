"""Linear layers on a few rows, computed column-wise on CPU: y = (W x^T)^T instead of x W^T.

Why: on CPU, BLAS runs nn.Linear on 2-64 rows as a general matmul that streams W about half as fast
as the one-row product does, while the same product taken column-wise, mm(W, x^T), stays near the
one-row cost. Measured on this project's 2-core machine, all of SmolLM2-135M's layer weights (cold
in cache, as in decoding) take 55 ms for 1 row, 85-105 ms for 2-8 rows by nn.Linear and 40-50 ms
column-wise; its 49152-row LM head takes 30-38 ms for 2-8 rows by nn.Linear and 9-20 ms column-wise.
A tree of candidates is then verified for about what one decoding step costs. The sums agree up to
fp32 rounding order, as between any two matmul kernels.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

# Beyond this many rows (long prompts) nn.Linear's own kernel is as fast.
MAX_ROWS = 64
# This machine's BLAS (MKL) takes the column-wise product markedly slower at 10-15 columns than at 16:
# all of SmolLM2-135M's decoder weights took 94-137 ms for 10-15 rows, 69-91 ms padded to 16 (and 86 ms
# for 16 rows). A tree plus a lookup chain is often 11-15 rows, so those blocks get zero rows up to 16.
PADDED_ROWS, PAD_TO = range(10, 16), 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """nn.functional.linear(x, weight, bias); column-wise for 2-64 rows of fp32 on CPU (10-15 rows padded
    to 16). (bf16 kernels round differently enough to flip near-tied greedy tokens against one-row
    decoding: not switched.)"""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (2 <= rows <= MAX_ROWS and weight.device.type == "cpu" and weight.dtype == x.dtype == torch.float32):
        return nn.functional.linear(x, weight, bias)
    columns = x.reshape(rows, x.shape[-1])
    if rows in PADDED_ROWS:
        columns = torch.cat([columns, columns.new_zeros(PAD_TO - rows, columns.shape[1])])
    # Back to nn.Linear's row-major layout: on the transposed view later ops ran slower, and sdpa left its
    # flash kernel for the math one (a 4-node verify of SmolLM2-135M took 131 ms instead of 110).
    y = torch.mm(weight, columns.t())[:, :rows].t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class _ColumnwiseLinears(TorchFunctionMode):
    """Sends F.linear on the given weights (by identity) through `linear`; every other call runs unchanged.

    A torch function mode, not a patched forward: modes are per thread, so another thread running the same
    model, even the same layers, meanwhile computes exactly as it would with nothing running, and nothing is
    left on the modules (a weight assigned later is the one used)."""

    def __init__(self, weights: set[int]):
        super().__init__()
        self.weights = weights

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _linear_arguments(*args, **kwargs)
            if id(weight) in self.weights:
                return linear(x, weight, bias)
        return func(*args, **kwargs)


def _linear_arguments(input, weight, bias=None):  # F.linear's own signature, keywords included
    return input, weight, bias


def columnwise_linears(*modules: nn.Module | None) -> AbstractContextManager:
    """A context within which, in this thread only, every plain nn.Linear in `modules` (None entries skipped)
    computes through `linear`; a one-row step still runs nn.Linear's kernel, through `linear`. Collecting the
    weights is paid once: the decoding loops make one and enter it around each forward (a reused context), not
    around the whole step, since a mode adds Python work to every op it sees (~7 us each; a SmolLM2-135M
    forward is 2,300 ops).

    Subclasses are left alone (quantised layers; LoRA wrappers call a plain base layer, whose weight is
    collected), as are weights swapped in during a forward (accelerate's offload hooks). Nothing is done
    unless some module holds fp32 weights on CPU: elsewhere a mode would only add Python work to every op.
    """
    modules = [module for module in modules if module is not None]
    if not any(_on_cpu_in_fp32(module) for module in modules):
        return nullcontext()
    return _ColumnwiseLinears({id(m.weight) for module in modules for m in module.modules() if type(m) is nn.Linear})


def _on_cpu_in_fp32(module: nn.Module) -> bool:
    # The first parameter stands for the module: a model split across devices keeps nn.Linear on its CPU part.
    first = next(module.parameters(), None)
    return first is not None and first.device.type == "cpu" and first.dtype == torch.float32
