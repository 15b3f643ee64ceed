"""The base model's verify pass, and eagle heads' draft-layer passes, compiled for static shapes:
generate(compile=True), gpt-fast's recipe on transformers' own modeling code.

Why: an eager pass dispatches the base model's thousands of small ops one by one from Python, and on a CPU torch's
fp32 linear kernels stream the weights of a one-row step well below the machine's memory rate. torch.compile
(inductor) fuses the small ops into a few C++ loops and, on a CPU, with the weights frozen into the graph, computes
the linear layers with its own GEMM kernels (experiments/2026-12-06-compiled/NOTES.md has the figures).

Shapes: a graph is compiled for each (rows, block). A block of n nodes is padded to the next of BLOCK_SIZES (a
padding node sees only itself and is never kept), so a tree whose size changes from step to step (eagle heads'
dynamic trees, the lookup chain) meets a few graphs, not one per size. The cache is a preallocated buffer of slots
(rounded up to CACHE_SLOTS, grown when a long batch outruns it), and the one dimension a graph leaves dynamic is how
many of its slots a pass attends to: the text's so far, not the whole buffer, whose empty slots cost attention as
much as the text's (experiments/2026-12-06-compiled-step/NOTES.md), and one graph serves every length of text.
Each graph compiles once per process (minutes on a small CPU: a line on stderr says when and for what); the weights
are frozen into it, so a change to them (training, merging a LoRA) is detected at the next call, and every graph
compiled again.

The prompt is prefilled eagerly (its length changes with every call) and its slots copied into the buffer. Compiled
kernels sum in another order than eager ones, as any two kernels do: greedy decoding stays lossless against the
model computed that way, and is tested equal to transformers' greedy output.

Eagle heads' draft layer (DraftGraphs) runs the same way: its passes over a level's beam and over a step's accepted
states (a few slots each) cost a few small products and dozens of small ops, so eagerly most of their time is
dispatch; one graph per (rows, slots), on a buffer of its own, its prompt pass eager. Drafts are the same tokens
up to the order of the sums, as the verify pass's logits are.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import sys
import time
import types

import torch
from torch import nn
from transformers.cache_utils import Cache, StaticLayer

from .base import BaseSpec
from .columnwise import columnwise_copy
from .verify import attention_masks, base_features

# Blocks are padded to the first of these at least as large (past the last, to a multiple of it). Every power of two
# up to 8, each a graph more to compile: on a CPU a node more is arithmetic on every weight, so a 2- or 4-node tree
# padded to 8 nodes paid a third more than its own graph (experiments/2026-12-06-compiled-step/NOTES.md).
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64)
# The cache buffer's slots are a multiple of this, with room for at least ROOM_AFTER more than asked for (a block
# at the end of the text).
CACHE_SLOTS = 1024
ROOM_AFTER = 16
# Graphs a process may compile for one CompiledSteps before dynamo stops (shapes x models): fullgraph=True makes
# hitting the limit an error rather than a silent fall back to eager.
RECOMPILE_LIMIT = 64


def block_size(n: int) -> int:
    """The compiled block that verifies n nodes."""
    last = BLOCK_SIZES[-1]
    return next((size for size in BLOCK_SIZES if size >= n), -(-n // last) * last)


def compile_options(device: torch.device, dtype: torch.dtype) -> dict:
    """inductor's options for the verify graph on `device`. CPU: the weights frozen into the graph, so that its
    linear layers run inductor's own C++ GEMM, which needs them constant: for fp32 where the CPU has the vector
    instructions its kernel is written for, the only choice (nothing to time; aten's MKL linear was far slower on
    the CPUs measured), else chosen against aten's by timing both; and the C++ wrapper, which calls the graph's
    kernels from C++ rather than Python: a one-row pass of SmolLM2-135M 8% faster, an 8-node one 12%
    (experiments/2026-12-07-cpp-wrapper/NOTES.md), for a compile 15-20% longer. Other devices: inductor's defaults
    (not measured here)."""
    if device.type != "cpu":
        return {}
    from torch._inductor.cpu_vec_isa import pick_vec_isa  # inductor's own test for its vectorised kernels

    backends = "CPP" if dtype == torch.float32 and pick_vec_isa() else "CPP,ATEN"
    return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": backends,
            "max_autotune_report_choices_stats": False, "cpp_wrapper": True}


def cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would call (the CXX environment variable, else g++; clang++ on macOS),
    where it is installed; None where it is not."""
    default = "clang++" if sys.platform == "darwin" else "g++"
    return shutil.which(os.environ.get("CXX") or default)


def _forward_of(model: nn.Module, spec: BaseSpec, feature_layers: tuple[int, ...]):
    """`model`'s forward as the verify graph runs it, with a code object of its own. The model is a closure variable,
    not an argument: inductor freezes the parameters of the modules a graph reads, not of those passed to it. Dynamo
    keeps compiled graphs on the code object it compiled, so with their own code these graphs (and the weights frozen
    into them) go when the function does, and their recompile count is their own (torch._dynamo.reset() would drop
    every graph in the process, the caller's too)."""

    def forward(input_ids: torch.Tensor, position_ids: torch.Tensor, mask, cache: Cache):
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                    output_hidden_states=True, return_dict=True, **{spec.cache_arg: cache})
        return out.logits, base_features(out.hidden_states, feature_layers)

    return types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__, None,
                              forward.__closure__)


class BufferLayer(StaticLayer):
    """transformers' StaticLayer (a preallocated buffer its update writes into at cumulative_length), its tensors not
    marked as static addresses: freezing folds such tensors into the graph as constants, as it does the weights, and
    the graph would then write into the buffer of the cache it was compiled with, whatever cache it is given.
    Its keys and values are the buffer's first slots (window): a graph attends over those alone, not the whole
    buffer, whose slots past the text cost attention as much as those in it. The slots are the buffer's outer
    dimension, so that a window's strides are the same whatever its length and the buffer's: a graph guards on
    strides, and another stride would compile it again."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.buffers = tuple(states.new_zeros(self.max_cache_len, self.batch_size, self.num_heads, states.shape[-1])
                             .permute(1, 2, 0, 3) for states in (key_states, value_states))  # [B, heads, slots, dim]
        self.keys, self.values = self.buffers
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def window(self, length: int) -> None:
        """Keys and values: the buffer's first `length` slots."""
        self.keys, self.values = (buffer[:, :, :length] for buffer in self.buffers)


class CompiledSteps:
    """One MedusaModel's compiled verify graphs, the model copy they run and the signature of the weights they froze.
    A cache of compiled code: a pickled or copied CompiledSteps is empty."""

    def __init__(self):
        self.model: nn.Module | None = None
        self.source: tuple | None = None  # (the base model's id, its config, its tensors' ids and shapes)
        self.signature: torch.Tensor | None = None
        self.feature_layers: tuple[int, ...] = ()  # the base's layers whose states the graphs give
        self.run = None  # the compiled forward
        self.shapes: set[tuple] = set()  # (rows, block) compiled so far
        self.options: dict = {}  # inductor's, for the model's device (compile_options)
        self.probes: dict[tuple, torch.Tensor] = {}
        self.draft = DraftGraphs()  # eagle heads' draft layer, prepared with them

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    @torch.no_grad()
    def prepare(self, base_model: nn.Module, spec: BaseSpec, feature_layers: tuple[int, ...],
                heads: nn.Module | None = None, packs=None) -> None:
        """Ready the graphs for `base_model` as it is now, giving the final hidden state and `feature_layers`' states
        (the heads' feature layers: every proposer of theirs reads those or none): kept where the weights are the
        ones they froze (the same tensors holding the same values) and the config the same, else dropped and compiled
        again at their first call. Heads with a draft layer (eagle, eagle3): its graphs too (self.draft), its linear
        layers computing from `packs` (columnwise.PackedWeights) where given."""
        if getattr(heads, "draft_layer", None) is not None:
            self.draft.prepare(heads, packs)
        tensors = list(itertools.chain(base_model.parameters(), base_model.buffers()))
        # The config too: the graphs do not guard on what the model reads from it (_guards_on_arguments), and a
        # setting read at run time (Gemma's final_logit_softcapping) changes what the model computes.
        source = (id(base_model), spec, feature_layers, repr(base_model.config.to_dict()),
                  tuple((id(t), tuple(t.shape), t.dtype) for t in tensors))
        signature = _signature(tensors, self.probes)
        if self.run is not None and source == self.source and torch.equal(signature, self.signature):
            return
        device = base_model.get_output_embeddings().weight.device
        if device.type == "cpu" and cpp_compiler() is None:
            raise RuntimeError("compile=True on a CPU needs a C++ compiler for torch.compile's kernels and none was "
                               "found (g++, or the one the CXX environment variable names): install one (e.g. apt "
                               "install g++) or generate without compile")
        # An eval-mode copy with plain linear layers (inductor compiles those): the caller's model keeps its mode, and
        # the output-capturing hooks transformers installs land on the copy, at its first call that asks for hidden
        # states, under a lock dynamo cannot trace: that first call is an eager one.
        self.model = columnwise_copy(base_model, eval_mode=True, linears=False)
        self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), output_hidden_states=True,
                   use_cache=False)
        self.source, self.signature, self.feature_layers, self.shapes = source, signature, feature_layers, set()
        self.run = torch.compile(_forward_of(self.model, spec, feature_layers), fullgraph=True, dynamic=False,
                                 options={"guard_filter_fn": _guards_on_arguments("input_ids", "position_ids", "mask",
                                                                                  "cache")})
        self.options = compile_options(device, base_model.get_output_embeddings().weight.dtype)

    def forward_block(self, spec: BaseSpec, input_ids: torch.Tensor, q_pos: torch.Tensor, block_mask: torch.Tensor,
                      cache: Cache, kv_valid: torch.Tensor, kv_pos: torch.Tensor,
                      feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """verify.forward_block through the compiled graph of this block's shape, on a static cache from adopt:
        the block padded to block_size, its slots written after the kv_valid.shape[1] - N committed ones, attending
        to those slots and its own. feature_layers: a subset of prepare's."""
        rows, n = input_ids.shape
        size = block_size(n)
        past = kv_valid.shape[1] - n
        if size > n:  # padding nodes: valid nowhere, each seeing only itself (attention_masks adds the diagonal)
            pad = size - n
            input_ids = torch.cat([input_ids, input_ids[:, -1:].expand(-1, pad)], dim=1)
            q_pos = torch.cat([q_pos, q_pos[:, -1:].expand(-1, pad)], dim=1)
            block_mask = nn.functional.pad(block_mask, (0, pad, 0, pad), value=False)
            kv_valid = torch.cat([kv_valid, kv_valid.new_zeros(rows, pad)], dim=1)
            kv_pos = torch.cat([kv_pos, kv_pos[:, -1:].expand(-1, pad)], dim=1)
        dtype = self.model.get_output_embeddings().weight.dtype
        mask = attention_masks(spec, kv_valid, kv_pos, q_pos, block_mask, dtype)
        logits, hidden = _run_on_buffer(self.run, self.options, self.shapes, "the verify pass", cache, past, mask,
                                        input_ids, q_pos)
        if feature_layers != self.feature_layers:  # the final state, then the layers asked for, of those given
            width = hidden.shape[-1] // (1 + len(self.feature_layers))
            chunks = hidden.split(width, dim=-1)
            hidden = torch.cat([chunks[0], *(chunks[1 + self.feature_layers.index(i)] for i in feature_layers)], -1)
        return logits[:, :n], hidden[:, :n]


class DraftGraphs:
    """Eagle heads' draft-layer passes (propose.DraftLayerProposer) through compiled graphs: the draft layer's
    column-wise copy (as the eager proposer runs it), its weights frozen into a graph per (rows, slots) on a static
    cache from adopt. Kept on the MedusaModel's CompiledSteps; compiled again after the heads' weights change."""

    def __init__(self):
        self.layer: nn.Module | None = None
        self.source: tuple | None = None
        self.signature: torch.Tensor | None = None
        self.run = None
        self.shapes: set[tuple] = set()
        self.options: dict = {}
        self.probes: dict[tuple, torch.Tensor] = {}

    @torch.no_grad()
    def prepare(self, heads: nn.Module, packs=None) -> None:
        """Ready the graphs for `heads`' draft layer as it is now (see CompiledSteps.prepare)."""
        tensors = list(itertools.chain(heads.parameters(), heads.buffers()))
        source = (id(heads), tuple((id(t), tuple(t.shape), t.dtype) for t in tensors))
        signature = _signature(tensors, self.probes)
        if self.run is not None and source == self.source and torch.equal(signature, self.signature):
            return
        self.layer = columnwise_copy(heads.draft_layer, packs=packs, eval_mode=True)
        self.source, self.signature, self.shapes = source, signature, set()
        self.run = torch.compile(_draft_forward_of(self.layer), fullgraph=True, dynamic=False,
                                 options={"guard_filter_fn": _guards_on_arguments("states", "next_embeds", "positions",
                                                                                  "mask", "cache")})
        weight = heads.draft_layer.fc.weight
        self.options = compile_options(weight.device, weight.dtype)
        if weight.device.type == "cpu":
            # With inductor's C++ GEMM (max_autotune) a pass of 4 slots after 300 took 1.07 ms, with freezing alone
            # 1.27, eagerly 2.09 (experiments/2026-12-06-compiled-draft); aten's kernels are allowed where the C++
            # GEMM has none for a shape, and the timing of the choices is not printed.
            self.options.update(max_autotune_gemm_backends="CPP,ATEN", autotune_num_choices_displayed=0)

    def forward(self, states: torch.Tensor, next_embeds: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                cache: Cache) -> torch.Tensor:
        """The draft layer's forward (eagle.DraftLayer, eagle3.Eagle3Draft) through the graph of this shape, on a
        static cache from adopt whose first mask.shape[-1] - n slots are the committed and drafted ones."""
        past = mask.shape[-1] - states.shape[1]
        return _run_on_buffer(self.run, self.options, self.shapes, "the draft layer", cache, past, mask, states,
                              next_embeds, positions)


def _draft_forward_of(layer: nn.Module):
    """`layer`'s forward as the draft graph runs it, with a code object of its own (see _forward_of)."""

    def forward(states: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor, mask, cache: Cache):
        return layer(states, next_embeds, mask, positions, cache)

    return types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__, None,
                              forward.__closure__)


def _guards_on_arguments(*arguments: str):
    """A guard filter for torch.compile that keeps the guards on the graph's arguments (their shapes, strides, dtypes,
    the cache's structure) and on torch's global state, and drops those on everything else it read: the model copy it
    closes over, that copy's classes and the modules' globals. The copy is this module's own and its weights are frozen
    into the graph, so they cannot change under it (prepare compiles anew where the caller's weights change), and a
    graph computes the model as it was prepared, whatever transformers' registries hold later. Those guards were most
    of the 7,580 dynamo checked before each one-row verify pass of SmolLM2-135M, about 1 ms of a 20 ms pass
    (experiments/2026-12-07-guards/NOTES.md)."""
    named = re.compile(rf"\b({'|'.join(arguments)})\b")

    def keep(entries) -> list[bool]:
        return [entry.guard_type in ("GLOBAL_STATE", "SHAPE_ENV") or bool(named.search(entry.name))
                for entry in entries]

    return keep


def _signature(tensors: list[torch.Tensor], probes: dict[tuple, torch.Tensor]) -> torch.Tensor:
    """Each tensor's product with a fixed random vector: any change of its values shows, also one made through
    `.data` (peft's merge_adapter), which leaves the version counter as it was."""
    sums = []
    for tensor in tensors:
        flat = tensor.detach().reshape(tensor.shape[0] if tensor.dim() else 1, -1)
        key = (flat.shape[1], flat.dtype, flat.device)
        if key not in probes:  # its own generator: the caller's random stream stays as it was
            probe = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(flat.shape[1]))
            probes[key] = probe.to(flat.device, flat.dtype if flat.is_floating_point() else torch.float32)
        probe = probes[key]
        sums.append(flat.to(probe.dtype) @ probe)
    return torch.cat(sums).float()


def adopt(cache: Cache, slots: int) -> Cache:
    """A static cache of room for `slots` slots and ROOM_AFTER more (rounded up to CACHE_SLOTS), holding `cache`'s
    (a prefill's)."""
    room = -(-(slots + ROOM_AFTER) // CACHE_SLOTS) * CACHE_SLOTS
    static = Cache(layers=[BufferLayer(room) for _ in cache.layers])
    for layer, source in zip(static.layers, cache.layers):
        layer.lazy_initialization(source.keys, source.values)
        length = source.keys.shape[-2]
        layer.keys[..., :length, :] = source.keys
        layer.values[..., :length, :] = source.values
    return static


def _run_on_buffer(run, options: dict, shapes: set[tuple], what: str, cache: Cache, past: int, mask, *inputs):
    """`run(*inputs, mask, cache)`, a graph over a block of n slots (inputs [B, n, ...]) after `past` slots of a static
    cache from adopt (grown where the block would not fit), attending to those slots and its own."""
    rows, n = inputs[0].shape[:2]
    if past + n > cache.layers[0].max_cache_len:
        cache.layers = adopt(_narrowed(cache, past), past + n).layers
    for layer in cache.layers:  # the slots attended to, and where StaticLayer.update writes the block's
        layer.window(past + n)
        layer.cumulative_length.fill_(past)
    # Copies in every call's strides: a graph guards on them, also a size-1 dimension's, which .contiguous()
    # keeps (a chain of one token expanded to n nodes arrives with stride 0).
    inputs = [values.new_empty(values.shape).copy_(values) for values in inputs]
    shape = (rows, n)
    if shape in shapes:  # compiled: the options below only matter to a compile, and patching them costs ~0.2 ms
        return run(*inputs, mask, cache)
    print(f"medusa_spec: compiling {what} for {rows} row(s) x {n} slots (once per process and shape; minutes on a "
          f"small CPU)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    # One graph for any text length: the slots attended to are a dimension of their own.
    for each in mask.values() if isinstance(mask, dict) else [mask]:  # [B, 1, N, L]
        torch._dynamo.mark_dynamic(each, 3)
    for layer in cache.layers:  # [B, heads, L, head_dim]
        torch._dynamo.mark_dynamic(layer.keys, 2)
        torch._dynamo.mark_dynamic(layer.values, 2)
    # inductor's options as a patch around the call (a graph compiles at its shape's first call): torch.compile's
    # options= did not reach freezing, and setting them process-wide would change the caller's compiles too.
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, accumulated_recompile_limit=RECOMPILE_LIMIT), \
            torch._inductor.config.patch(options):
        out = run(*inputs, mask, cache)
    shapes.add(shape)
    print(f"medusa_spec: compiled in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return out


def _narrowed(cache: Cache, length: int) -> Cache:
    """A view of `cache`'s first `length` slots, as adopt reads a prefill's."""
    view = Cache(layers=[BufferLayer(length) for _ in cache.layers])
    for layer, source in zip(view.layers, cache.layers):
        layer.keys, layer.values = source.keys[..., :length, :], source.values[..., :length, :]
    return view
