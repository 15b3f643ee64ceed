"""Linear layers by the fastest CPU kernel for their row count, and grouped-query attention of a few rows
without copying the keys and values per query head: what the decoding loops, the data engine and training's
frozen base run through (columnwise_copy).

Why: torch computes an fp32 nn.Linear on CPU with MKL, which on this project's AMD EPYC machines runs far below
the CPU's rate. oneDNN's linear beats it at every row count, and for 2-4 rows a column-wise mm(W, x^T) beats both.
So 2-4 rows go column-wise (a tree of 4 nodes is verified for about what one decoding step costs) and every other
count through oneDNN (one-row steps, wider trees and batches, prefills, the data engine's batches, training's packed
rows). The sums agree up to fp32 rounding order, as between any two matmul kernels. oneDNN's rows run faster still
from weights in its own layout, which PackedWeights keeps from call to call for the decoding loops and the data
engine. (Measured: "oneDNN's fp32 linear for every row count but 2-4" and "oneDNN's packed weights" in
experiments/2026-12-smollm2-135m-instruct/NOTES.md.)

Attention: for a query of several rows and a mask, transformers' sdpa path copies every key and value
head once per query head of its group (`repeat_kv`), a copy that grows with the context. torch's sdpa
takes the groups as they are (`enable_gqa`); transformers passes that only for masks it knows the
kernel supports, so the copy's attention layers read a config of their own naming `GQA_SDPA`, the
same sdpa call with `enable_gqa`: a multi-row verify pass gets cheaper, the more so the longer the context;
outputs bit-identical (measured: "Cheaper rows, fewer wasted rows" in the NOTES.md above).
"""

from __future__ import annotations

import copy
import platform
import weakref

import psutil
import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

# From 2 rows up to this many the column-wise product is the fastest; for one row and beyond it, oneDNN's.
COLUMNWISE_ROWS = 4


def _onednn_ops():
    """oneDNN's fp32 linear and its weight packing (the ops torch.compile's CPU backend calls), where this torch
    build has them; x86 only, where they were measured. (None, None) elsewhere: nn.Linear then."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return None, None
    try:
        return torch.ops.mkldnn._linear_pointwise.default, torch.ops.mkldnn._reorder_linear_weight.default
    except (AttributeError, RuntimeError):
        return None, None


ONEDNN_LINEAR, ONEDNN_PACK = _onednn_ops()


class PackedWeights:
    """oneDNN's own layout of fp32 CPU weights, for linear's `packed_weight`, kept from call to call: called with a
    plain weight, oneDNN reorders it at every product. Packed weights are faster than plain ones at every row
    count, through oneDNN and against the column-wise kernel for 2-4 rows alike, the LM head included (measured:
    "oneDNN's packed weights" in experiments/2026-12-smollm2-135m-instruct/NOTES.md). Packing the model's layers
    takes a while and their memory again, so a MedusaModel keeps one PackedWeights and the data engine one per run;
    weights are packed only while a quarter of the machine's memory stays available.

    A weight packed earlier is used only while it is the same tensor with the same values: `get` compares its
    version counter and storage address with those at packing, which any edit through the tensor changes (an
    optimiser step, copy_, an in-place op under no_grad, however small the change); and, since an edit through
    `.data` (peft's merge_adapter) leaves both as they were, its product with a fixed random vector (one row's
    product through the whole model, at each generate call) against the one taken at packing. A weight that
    changed is packed again; one that is gone drops its pack. A cache: a pickled or copied PackedWeights is empty."""

    def __init__(self):
        # id -> (weight, (version, storage address), check, pack)
        self.packs: dict[int, tuple[weakref.ref, tuple[int | None, int], torch.Tensor, torch.Tensor]] = {}
        self.probes: dict[int, torch.Tensor] = {}  # in_features -> the fixed random vector

    def __getstate__(self) -> dict:
        return {}  # weak references and oneDNN's opaque packs pickle as nothing; the copy packs its own

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """`weight` [out, in] packed (None where linear would not use a pack: no oneDNN, not fp32 on CPU)."""
        if ONEDNN_PACK is None or weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            return None
        plain = weight.detach()
        columns = plain.shape[1]
        if columns not in self.probes:  # its own generator: the caller's random stream stays as it was
            self.probes[columns] = torch.randn(1, columns, generator=torch.Generator().manual_seed(columns))
        check = ONEDNN_LINEAR(self.probes[columns], plain, None, "none", [], "")
        key, stamp = id(weight), _stamp(weight)
        if key in self.packs:
            ref, known_stamp, known, pack = self.packs[key]
            if ref() is weight and known_stamp == stamp and torch.equal(known, check):
                return pack
        if not _room_for(plain.nbytes):
            return None
        # Packed for 8 rows: faster than for one at every row count measured (1-128); from 2 rows on, its products
        # are bit-identical to the plain weight's, one row's round differently (as any two kernels may).
        pack = ONEDNN_PACK(plain, 8)
        self.packs[key] = (weakref.ref(weight, lambda _, packs=self.packs, key=key: packs.pop(key, None)), stamp, check,
                           pack)
        return pack


def _stamp(weight: torch.Tensor) -> tuple[int | None, int]:
    """(version counter, storage address) of `weight`; an inference tensor keeps no version counter (None)."""
    try:
        version = weight._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        version = None
    return version, weight.data_ptr()


def _room_for(nbytes: int) -> bool:
    """Whether `nbytes` more leaves a quarter of this machine's memory available. A pack is a second copy of its
    weight, a speed-up never worth swapping or the OOM killer (an fp32 8B model takes 32 GB, its packs as much
    again): past that, layers compute from their plain weights."""
    memory = psutil.virtual_memory()
    return memory.available - nbytes >= memory.total // 4


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed_weight: torch.Tensor | None = None) -> torch.Tensor:
    """nn.functional.linear(x, weight, bias), for fp32 on CPU by the fastest kernel measured here: oneDNN's from
    `packed_weight` (PackedWeights.get(weight)) where given, else 2-4 rows column-wise and others oneDNN's. Not where
    autograd needs the graph (oneDNN's op has no backward), and not in bf16 (bf16 kernels round differently enough
    to flip near-tied greedy tokens against one-row decoding)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    if rows == 0 or grad or not (weight.device.type == "cpu" and weight.dtype == x.dtype == torch.float32):
        return nn.functional.linear(x, weight, bias)
    if packed_weight is not None:  # the fastest at every row count measured (see PackedWeights)
        return ONEDNN_LINEAR(x, packed_weight, bias, "none", [], "")
    if rows == 1 or rows > COLUMNWISE_ROWS:
        if ONEDNN_LINEAR is None:
            return nn.functional.linear(x, weight, bias)
        return ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    columns = x.reshape(rows, x.shape[-1])
    # Back to nn.Linear's row-major layout: on the transposed view later ops ran slower, and sdpa left its
    # flash kernel for the slower math one.
    y = torch.mm(weight, columns.t()).t().contiguous()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


GQA_SDPA = "medusa_spec_gqa_sdpa"


def gqa_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention; a masked query attends to the key/value heads in place. One query row eagerly
    goes transformers' way, which folds the group into the row; inside a graph being compiled transformers copies
    every key and value head once per query head of its group instead (`repeat_kv`): SmolLM2-135M's one-node compiled
    verify pass took 23.4-23.7 ms with that copy, 18.7-20.0 without (experiments/2026-12-07-verify-profile/NOTES.md)."""
    extras = ("softcap", "position_bias", "output_attentions")
    plain = ((query.shape[2] == 1 and not torch.compiler.is_compiling()) or attention_mask is None
             or query.shape[1] == key.shape[1] or any(kwargs.get(name) not in (None, False) for name in extras))
    if plain:  # one row eagerly, a causal flag, one head per group, or extras
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


# Registering adds a name to transformers' table of attention functions; no model reads it unless its config names
# it, and only the attention layers of a columnwise_copy get such a config.
AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)


# nn.Module's own containers (parameters, buffers, children, hooks): a copy owns these.
MODULE_CONTAINERS = frozenset(name for name, value in vars(nn.Module()).items() if isinstance(value, (dict, set)))


class ColumnwiseLinear(nn.Linear):
    """nn.Linear computing through `linear` (from its packed_weight, where columnwise_copy packed one). Only the
    layers of a columnwise_copy take this class."""

    packed_weight: torch.Tensor | None = None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias, self.packed_weight)


def columnwise_copy(module: nn.Module | None, attention: str = GQA_SDPA,
                    packs: PackedWeights | None = None, eval_mode: bool = False,
                    linears: bool = True) -> nn.Module | None:
    """A copy of `module`'s tree whose plain nn.Linear layers compute through `linear`, and whose sdpa attention
    layers through `gqa_sdpa_attention` (or another registered attention function, `attention`: the data engine's
    takes each block of rows' own width); the decoding loops run the base model, the heads and a draft model through
    one, made per generate call. With `packs`, the linear layers compute from the weights it packed (PackedWeights).

    Each submodule is copied shallowly with its own nn.Module containers (children, parameter and buffer
    dicts, hook dicts): tensors, config, hook functions and any other attribute are shared, nothing done to the
    copy's structure reaches `module`, and `module` computes as before in every thread. Subclasses are left
    alone (quantised layers; a LoRA wrapper calls its plain base layer, which is converted). Why a copy, not a
    torch function mode: a mode adds Python work to every op, and a forward runs thousands of them, so a verify
    pass is markedly slower under one than through the copy.

    `eval_mode`: the copy runs in eval mode (the decoding loops: dropout on would be neither greedy nor the model's
    distribution), its `training` set on the copy only, never on `module`, which another thread may be training;
    then a module in train mode is copied on any device and dtype. Returns `module` itself where nothing would
    change: not fp32 weights on CPU (`linear` would only call nn.Linear) and, with eval_mode, every module in eval
    mode already. `linears=False` keeps the linear layers plain nn.Linear (what torch.compile's own kernels replace:
    see compiled), and makes a copy in any case: compiled graphs and transformers' output hooks then belong to it.
    """
    if module is None:
        return None
    columnwise = _on_cpu_in_fp32(module)
    if linears and not columnwise and not (eval_mode and any(m.training for m in module.modules())):
        return module
    copies: dict[int, nn.Module] = {}
    configs: dict[int, PreTrainedConfig] = {}

    def gqa_config(config: PreTrainedConfig) -> PreTrainedConfig:
        if id(config) not in configs:
            configs[id(config)] = copy.copy(config)
            # Not the `_attn_implementation` setter: it would also set the sub-configs, which the copy shares.
            vars(configs[id(config)])["_attn_implementation_internal"] = attention
        return configs[id(config)]

    def copy_tree(original: nn.Module) -> nn.Module:
        if id(original) in copies:  # a module registered twice stays one module
            return copies[id(original)]
        # A shallow copy by hand: copy.copy takes the slower __reduce_ex__ route, paid for every module at each
        # generate call.
        clone = copies[id(original)] = object.__new__(type(original))
        vars(clone).update(vars(original))
        for name in MODULE_CONTAINERS & vars(original).keys():
            vars(clone)[name] = type(vars(original)[name])(vars(original)[name])
        vars(clone)["_modules"] = {name: None if child is None else copy_tree(child)
                                   for name, child in original._modules.items()}
        if eval_mode:
            vars(clone)["training"] = False
        if not columnwise:
            return clone
        if type(original) is nn.Linear and linears:
            clone.__class__ = ColumnwiseLinear
            if packs is not None:
                vars(clone)["packed_weight"] = packs.get(original.weight)
        config = vars(original).get("config")
        # Attention layers: those with a (key/value) group size; GQA_SDPA changes only grouped ones.
        groups = getattr(original, "num_key_value_groups", None)
        if (groups is not None and (groups > 1 or attention != GQA_SDPA)
                and isinstance(config, PreTrainedConfig) and config._attn_implementation == "sdpa"):
            vars(clone)["config"] = gqa_config(config)
        return clone

    return copy_tree(module)


def _on_cpu_in_fp32(module: nn.Module) -> bool:
    # The first parameter stands for the module: a model split across devices keeps nn.Linear on its CPU part.
    first = next(module.parameters(), None)
    return first is not None and first.device.type == "cpu" and first.dtype == torch.float32
