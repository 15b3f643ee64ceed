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

from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

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
    y = torch.mm(weight, columns.t())[:, :rows].t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


@contextmanager
def columnwise_linears(*modules: nn.Module | None):
    """Within the block, every plain nn.Linear in `modules` (None entries skipped) computes through
    `linear`. The decoding loops hold this over a whole generate call (switching ~200 layers costs
    about 3 ms, too much per step); a one-row step then still runs nn.Linear's kernel, through `linear`.

    Subclasses are left alone (quantised layers; LoRA wrappers call a plain base layer, which is
    switched), as are layers that already carry a forward of their own (accelerate's offload hooks);
    each switched layer gets its class forward back on exit, errors included.
    """
    linears = {id(m): m for module in modules if module is not None for m in module.modules()
               if type(m) is nn.Linear and "forward" not in vars(m)}.values()  # a shared layer once
    for layer in linears:
        layer.forward = partial(linear, weight=layer.weight, bias=layer.bias)
    try:
        yield
    finally:
        for layer in linears:
            del layer.forward
