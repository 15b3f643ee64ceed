"""Adapter files: medusa_config.json + medusa_heads.safetensors (+ lora/ for Medusa-2), saved crash-safely.

A save writes the complete new files into a staging folder inside the adapter folder, fsyncs them, and commits
with one rename of that folder; only then are the files moved into place, one by one. A kill before the commit
leaves the old adapter; a kill after it leaves the commit folder, whose manifest lets the next save or load
finish the moves. So a load always sees one whole adapter, old or new, and the folder keeps its plain layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .config import CONFIG_NAME, MedusaConfig
from .heads import MedusaHeads

try:
    import fcntl
except ImportError:  # Windows: no flock, so a load there may clear the staging folder of a save still running
    fcntl = None

WEIGHTS_NAME = "medusa_heads.safetensors"
# Medusa-2: the LoRA adapter trained into the base model, in peft's own save_pretrained layout.
LORA_DIR = "lora"
LORA_ADAPTER = "medusa2"  # the peft adapter name a Medusa-2 LoRA is loaded under
# Folders a save keeps inside the adapter folder while it runs: being written, committed, being deleted.
STAGING, COMMITTED, DONE = ".medusa-saving-", ".medusa-commit-", ".medusa-done-"
# Inside a commit folder: the names the save manages and the ones it wrote; and where replaced folders go.
MANIFEST, REPLACED = ".manifest.json", ".replaced"


@contextmanager
def staged_save(path: str | Path, names: tuple[str, ...]) -> Iterator[Path]:
    """Yield an empty folder to write into; when the block ends, each of `names` it wrote replaces the one in
    `path`, and each it did not write is removed from `path` (a stale file must not pair with new ones), all
    or nothing, even if the process is killed. Other files in `path` are left alone.

    An exclusive lock on `path` keeps a second save (or a load clearing leftovers) out until this one is done.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is a file, not a folder: an adapter is a folder of files; save to a folder path")
    path.mkdir(parents=True, exist_ok=True)
    with _folder_lock(path, wait=True):
        _finish_interrupted(path)
        staging = Path(tempfile.mkdtemp(prefix=STAGING, dir=path))  # inside `path`: renames stay atomic
        committed = path / (COMMITTED + staging.name.removeprefix(STAGING))
        try:
            yield staging
            written = [name for name in names if (staging / name).exists()]
            (staging / MANIFEST).write_text(json.dumps({"names": list(names), "written": written}), encoding="utf-8")
            _fsync_tree(staging)  # the files' contents must be on disk before the rename that commits them
            os.replace(staging, committed)  # the commit: from here on the new adapter is the one that loads
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _fsync_dir(path)
        _move_into_place(committed, path)


def finish_interrupted_save(path: str | Path) -> None:
    """Finish the moves of a save to `path` that was killed after its commit, and remove what a killed save
    left; call before reading the folder. Without leftovers (the usual case) it writes nothing, so read-only
    folders load."""
    path = Path(path)
    if not path.is_dir():
        return
    for old in path.glob(".saving-*"):
        warnings.warn(f"{old} was left by a save that an older medusa_spec did not finish, and may hold the previous "
                      f"adapter's files (in previous/); check that the adapter in {path} is the one you expect, "
                      f"then delete {old}", stacklevel=3)
    commits = list(path.glob(COMMITTED + "*"))
    if not commits and not any(path.glob(STAGING + "*")) and not any(path.glob(DONE + "*")):
        return
    # A save running now holds the lock. If a commit folder exists it is moving files into place, which takes
    # moments: wait for it. Otherwise it is still writing its staging folder, which must not be removed.
    with _folder_lock(path, wait=bool(commits)) as held:
        if held:
            _finish_interrupted(path)


def _finish_interrupted(path: Path) -> None:
    for committed in path.glob(COMMITTED + "*"):
        try:
            _move_into_place(committed, path)
        except PermissionError as err:
            raise PermissionError(f"{path} holds a save that was interrupted after it committed ({committed.name}): "
                                  f"its files are a mix of two saves until the moves are finished, which needs write "
                                  f"access to {path}; load it once with write access, or save the adapter again"
                                  ) from err
    for leftover in (*path.glob(STAGING + "*"), *path.glob(DONE + "*")):
        # Nothing reads these; one that cannot be removed now is removed by the next save.
        shutil.rmtree(leftover, ignore_errors=True)


def _move_into_place(committed: Path, path: Path) -> None:
    """Move the files of a committed save into `path`. Each step can be repeated after a kill: a written name
    missing from `committed` was moved already."""
    manifest = json.loads((committed / MANIFEST).read_text(encoding="utf-8"))
    replaced = committed / REPLACED
    replaced.mkdir(exist_ok=True)
    for name in manifest["names"]:
        new, target, write = committed / name, path / name, name in manifest["written"]
        if write and not new.exists():
            continue
        if target.is_dir():
            # A folder can neither be replaced nor removed in one step: set it aside, to be deleted with `committed`.
            os.replace(target, replaced / name)
        elif not write:
            target.unlink(missing_ok=True)
        if write:
            os.replace(new, target)
    _fsync_dir(path)
    # Renamed before deleting: a half-deleted folder must not pass for a commit still to finish.
    done = path / (DONE + committed.name.removeprefix(COMMITTED))
    os.replace(committed, done)
    shutil.rmtree(done, ignore_errors=True)


@contextmanager
def _folder_lock(path: Path, wait: bool) -> Iterator[bool]:
    """An exclusive flock on the folder itself (no lock file to leave behind); yields whether it is held. The
    kernel drops it when its holder dies, so a killed save never blocks the next."""
    if fcntl is None:
        yield True
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
        else:
            yield True
    finally:
        os.close(fd)  # releases the lock


def _fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(folder: Path) -> None:
    """Make the renames in `folder` durable."""
    if os.name == "nt":  # Windows cannot open a folder; NTFS journals its renames itself
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def save_adapter(path: str | Path, config: MedusaConfig, state_dict: Mapping[str, torch.Tensor],
                 lora: nn.Module | None = None) -> None:
    """Write medusa_config.json + medusa_heads.safetensors and, for Medusa-2, `lora` (a peft model) under lora/,
    crash-safely (see staged_save), the weights' sha256 and whether lora/ was written recorded in the config.
    Saving without `lora` removes one left by an earlier save, so new heads are never loaded with a stale LoRA
    adapter; a lora/ that no earlier save recorded is refused (see check_lora_folder), never replaced or removed.
    Weights that do not fit `config` are refused before anything is written: the save would replace a loadable
    adapter with one that no longer loads."""
    check_weights(expected_shapes(config, path), state_dict, path,
                  fix="the heads no longer match their config (was the config or a head changed after they were "
                      "built?); build heads for a new config with MedusaModel.from_base(base_model, config)")
    with staged_save(path, (LORA_DIR, WEIGHTS_NAME, CONFIG_NAME)) as staged:
        check_lora_folder(path)  # under the save's lock, after an interrupted save was finished: the folder as it is
        save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(staged / WEIGHTS_NAME),
                  metadata={"format": "pt"})
        config = dataclasses.replace(config, weights_sha256=sha256_file(staged / WEIGHTS_NAME), lora=lora is not None)
        config.to_json_file(staged / CONFIG_NAME)
        if lora is not None:
            lora.save_pretrained(str(staged / LORA_DIR))


def check_lora_folder(path: str | Path) -> None:
    """Raise unless `path`/lora is absent or was written by an earlier save to `path`, as its medusa_config.json
    records: a save replaces or removes lora/, and one of the user's own (their peft output, notes) must survive."""
    lora_dir, config_file = Path(path) / LORA_DIR, Path(path) / CONFIG_NAME
    if not lora_dir.exists():
        return
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # no config, or not one a save wrote: nothing records lora/
        config = None
    if not (isinstance(config, dict) and config.get("lora") is True):
        raise ValueError(f"{lora_dir}: saving heads to {path} would replace or delete this folder, and "
                         f"{config_file} does not record that a save of heads wrote it (it may be your own, or a LoRA "
                         f"adapter saved by an older medusa_spec, which did not record it); move or delete {lora_dir}, "
                         f"or save the heads to another folder")


def load_adapter(path: str | Path) -> tuple[MedusaConfig, dict[str, torch.Tensor]]:
    """Read an adapter written by save_adapter; the weights are checked against the config (shapes, and the
    sha256 where the config records one)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no adapter folder at {path}; save one with MedusaModel.save_heads({str(path)!r})")
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for file in (config_file, weights_file):
        if not file.is_file():
            raise FileNotFoundError(f"{file} is missing; an adapter folder holds {CONFIG_NAME} and {WEIGHTS_NAME} "
                                    f"(re-save it with save_heads)")
    config = MedusaConfig.from_json_file(config_file)
    state_dict = read_safetensors(weights_file)
    check_weights(expected_shapes(config, config_file), state_dict, weights_file,
                  fix=f"it and {CONFIG_NAME} come from different saves; re-save the adapter with save_heads()")
    if config.weights_sha256 is not None and sha256_file(weights_file) != config.weights_sha256:
        raise ValueError(f"{weights_file} does not match the sha256 recorded in {config_file}: the two files come from "
                         f"different saves, or the weights were changed after saving; copy both files from one save, "
                         f"or re-save the adapter with save_heads()")
    return config, state_dict


def read_weights_folder(path: Path, holder: str) -> tuple[dict[str, torch.Tensor], Path]:
    """Every *.safetensors in the folder `path` (engines read them all; large checkpoints are sharded), and the name
    to give in messages: the file where there is one, else the folder. `holder` says what the folder's config.json
    describes, for the message when there is none."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has {holder} config.json but no *.safetensors weights; put its weights file "
                                f"beside it")
    tensors = {}
    for file in files:
        tensors.update(read_safetensors(file))
    return tensors, files[0] if len(files) == 1 else path


def read_weights_file(file: Path, safetensors_name: str) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file, or of a pickled state dict (.pt, .bin), read with weights_only;
    `safetensors_name` is the file to save them in instead, for the message when the pickle holds other objects."""
    if file.suffix == ".safetensors":
        return read_safetensors(file)
    try:
        # weights_only: a .pt file is a pickle, and unpickling anything but tensors can run arbitrary code.
        data = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{file} holds Python objects besides tensors, which torch.load(weights_only=True) refuses; "
                         f"if you trust the file, load it with weights_only=False and save its tensors with "
                         f"safetensors.torch.save_file as {safetensors_name}") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise ValueError(f"{file} is truncated or corrupt ({err}); re-download it") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in data.items()):
        raise ValueError(f"{file} is not a state dict of tensors; save the heads' state_dict() in it")
    # The original Medusa reuses one ResBlock for all layers of a head ([ResBlock] * L), so its tensors can share
    # storage; clones make them independent (and savable: safetensors refuses shared tensors).
    return {key: value.clone() for key, value in data.items()}


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{file} is truncated or corrupt ({err}); re-save or re-download it") from None


def expected_shapes(config: MedusaConfig, source) -> dict[str, torch.Size]:
    """Name -> shape of every tensor of heads built from `config` (on the meta device: nothing is allocated)."""
    unknown = [name for name in ("hidden_size", "vocab_size")
               if getattr(config, name) is None and (name == "hidden_size" or not config.share_lm_head)]
    if unknown:
        raise ValueError(f"{source}: {' and '.join(unknown)} unknown (null); set them to the base model's values")
    if config.head_type == "eagle" and config.draft_layer is None:
        raise ValueError(f"{source}: eagle heads without draft_layer (the draft layer's shape); re-save the adapter "
                         f"with save_heads()")
    if config.head_type == "eagle3" and (config.draft_layer is None or not config.feature_layers):
        raise ValueError(f"{source}: eagle3 heads without draft_layer or feature_layers; re-save the adapter with "
                         f"save_heads()")
    with torch.device("meta"):
        # A shared LM head is the base model's: the heads hold nothing vocabulary-sized, so 0 stands in.
        heads = MedusaHeads.from_config(config)
    return {name: tensor.shape for name, tensor in heads.state_dict().items()}


def check_weights(expected: Mapping[str, torch.Size], state_dict: Mapping[str, torch.Tensor], source, fix: str,
                  name: Callable[[str], str] = lambda key: key) -> None:
    """Raise ValueError naming every missing, unexpected or misshapen tensor; `name` maps a key to the file's own
    naming for the message."""
    problems = [f"missing {name(k)}" for k in expected if k not in state_dict]
    problems += [f"unexpected {name(k)}" for k in state_dict if k not in expected]
    problems += [f"{name(k)} has shape {tuple(state_dict[k].shape)}, expected {tuple(shape)}"
                 for k, shape in expected.items() if k in state_dict and state_dict[k].shape != shape]
    if problems:
        raise ValueError(f"{source}: {'; '.join(problems[:5])}{'; ...' if len(problems) > 5 else ''}; {fix}")


def same_weight(copy: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether `copy` is `expected`; a copy saved in another precision is the same when both agree at the coarser of
    the two."""
    if copy.shape != expected.shape:
        return False
    coarser = max(copy.dtype, expected.dtype, key=lambda dtype: torch.finfo(dtype).eps)
    return torch.equal(copy.to(expected.device, coarser), expected.to(coarser))


def write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def check_token_map(token_map: torch.Tensor, vocab_size: int, source: str) -> None:
    """A token map (draft index -> token id) must hold distinct ids of the base vocabulary."""
    if token_map.dtype not in (torch.int32, torch.int64) or token_map.dim() != 1:
        raise ValueError(f"{source}: token_map must be a 1-D integer tensor of token ids, got {token_map.dtype} "
                         f"{tuple(token_map.shape)}; re-save the heads")
    if token_map.numel() and (int(token_map.min()) < 0 or int(token_map.max()) >= vocab_size):
        raise ValueError(f"{source}: token_map holds ids outside the base vocabulary [0, {vocab_size}); these heads "
                         f"belong to another model")
    if token_map.unique().numel() != token_map.numel():
        raise ValueError(f"{source}: token_map repeats token ids; each draft index must map to a distinct token")


def load_lora(base_model: nn.Module, path: str | Path) -> nn.Module:
    """Apply the Medusa-2 LoRA adapter saved under `path`/lora to `base_model` in place, through peft, and
    return `base_model`; without lora/ it is left as is. A LoRA already in `base_model` (from an earlier load)
    is replaced, not stacked under the new one; if peft fails, `base_model` is put back as it was."""
    lora_dir = Path(path) / LORA_DIR
    if not lora_dir.exists():
        return base_model
    if not (lora_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{lora_dir} has no adapter_config.json, so it is not a peft adapter; re-save with "
                                f"save_heads(path, lora=peft_model), or delete {lora_dir} to load the heads alone")
    weights = lora_dir / "adapter_model.safetensors"
    if weights.is_file():
        read_safetensors(weights)  # a clear error for a damaged file, before peft changes base_model
    from peft import PeftModel  # imported here: peft is slow to import and only Medusa-2 adapters need it

    foreign = _adapter_names(base_model) - {LORA_ADAPTER}
    if foreign:
        raise ValueError(f"base_model already holds the peft adapter(s) {', '.join(sorted(foreign))}, which "
                         f"medusa_spec did not load: a Medusa-2 LoRA replaces only one an earlier load applied. "
                         f"Merge yours into the weights first (peft_model.merge_and_unload()), or load the heads "
                         f"onto a base model without it")
    before = _module_state(base_model)
    try:
        _remove_lora(base_model)
        # Under its own adapter name, which tells a later load that this LoRA is one it may replace.
        PeftModel.from_pretrained(base_model, str(lora_dir), adapter_name=LORA_ADAPTER)  # into base_model itself
    except BaseException as err:
        _restore_module_state(before)
        if isinstance(err, Exception):
            raise ValueError(f"{lora_dir}: peft could not apply this LoRA adapter to the base model ({err}); it "
                             f"belongs to another base model or is damaged: re-save it with save_heads(path, "
                             f"lora=peft_model), or delete {lora_dir} to load the heads alone") from err
        raise
    return base_model


def _module_state(model: nn.Module) -> tuple[list, list]:
    """What loading a peft adapter changes in `model`: each module's attributes (peft_config) and submodules
    (the wrapped layers), and which parameters train."""
    return ([(module, dict(vars(module)), dict(module._modules)) for module in model.modules()],
            [(param, param.requires_grad) for param in model.parameters()])


def _restore_module_state(state: tuple[list, list]) -> None:
    modules, params = state
    for module, attributes, children in modules:
        vars(module).clear()
        vars(module).update(attributes)
        module._modules.clear()
        module._modules.update(children)
    for param, requires_grad in params:
        param.requires_grad_(requires_grad)


def _adapter_names(model: nn.Module) -> set[str]:
    """The names of the peft adapters whose layers `model` holds."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name for module in model.modules() if isinstance(module, BaseTunerLayer)
            for layers in module.adapter_layer_names for name in getattr(module, layers, {})}


def _remove_lora(module: nn.Module) -> None:
    """Put back the layers peft wrapped, as PeftModel.unload() does, for a model whose PeftModel is gone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, child in list(module.named_children()):
        if hasattr(child, "unload_and_optionally_merge_module"):  # layers with their own unloading, as in peft
            setattr(module, name, child.unload_and_optionally_merge_module(merge=False, safe_merge=False,
                                                                           adapter_names=None))
        elif isinstance(child, BaseTunerLayer):
            setattr(module, name, child.get_base_layer())
        else:
            _remove_lora(child)
    vars(module).pop("peft_config", None)  # peft's record of the adapters it injected, on the model it wrapped
