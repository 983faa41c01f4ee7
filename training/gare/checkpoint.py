"""Self-describing, pickle-free checkpoints.

A GARE checkpoint is one safetensors file: tensors `model.*` (the state dict) and `queue.*` (the NCL query
queues), and a JSON header in the safetensors metadata with the format version, the ModelConfig, the
training arguments and free-form info. Loading never unpickles anything.

Trainer state (optimizer, scheduler, RNG, step) goes through `save_tree` / `load_tree`: any nested
dict/list of tensors and JSON scalars, tensors in safetensors and the structure in the header.

Every write goes to a temporary name in the same folder, is fsynced, then `os.replace`d into place.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gare.atomic import atomic_write
from gare.config import ModelConfig
from gare.model import GARE

FORMAT = "gare-checkpoint"
FORMAT_VERSION = 1
TREE_FORMAT = "gare-tree"


class CheckpointError(ValueError):
    pass


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex digest of a file's bytes (the one hashing helper of checkpoints, indexes and banks)."""
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _contiguous_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _read_gare_file(path: str | os.PathLike, fmt: str, no_header: str,
                    select: Callable[[str], bool] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The one reader of the project's safetensors files: (the GARE header, checked to be format `fmt`, and the
    tensors; with `select`, only the tensors whose names it accepts are read from the file). `no_header` is the
    error's text when the file has no GARE header."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys() if select is None or select(k)}
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    try:
        header = json.loads(meta["gare"])
    except (KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: {no_header}") from e
    if header.get("format") != fmt:
        raise CheckpointError(f"{path}: format {header.get('format')!r} is not {fmt!r}")
    return header, tensors


@dataclass
class Checkpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    queues: dict[str, torch.Tensor] = field(default_factory=dict)
    train_args: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    @property
    def sha256(self) -> str:
        if self.path is None:
            raise CheckpointError("checkpoint has no file")
        return file_sha256(self.path)


def save_checkpoint(
    path: str | os.PathLike,
    model: torch.nn.Module,
    *,
    queues: dict[str, torch.Tensor] | None = None,
    train_args: dict[str, Any] | None = None,
    info: dict[str, Any] | None = None,
) -> None:
    cfg: ModelConfig = model.cfg  # type: ignore[assignment]
    tensors = {f"model.{k}": _contiguous_cpu(v) for k, v in model.state_dict().items()}
    for name, q in (queues or {}).items():
        tensors[f"queue.{name}"] = _contiguous_cpu(q)
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "train_args": train_args or {},
        "info": info or {},
        "queues": sorted(queues or {}),
    }
    meta = {"gare": json.dumps(header, sort_keys=True, default=str)}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    header, tensors = _read_gare_file(path, FORMAT, "no GARE header; is this a GARE checkpoint? (try gare-train import-official)")
    if header.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {header.get('version')} is not supported (expected {FORMAT_VERSION})")
    cfg = ModelConfig.from_dict(header["model_config"])
    sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    queues = {k[len("queue."):]: v for k, v in tensors.items() if k.startswith("queue.")}
    return Checkpoint(cfg, sd, queues, header.get("train_args", {}), header.get("info", {}), str(path))


def read_checkpoint_subset(path: str | os.PathLike, prefixes: Sequence[str]) -> Checkpoint:
    """A checkpoint holding only the model tensors whose state-dict names start with one of `prefixes` (e.g.
    ``("psi.",)``) and no queues: safetensors reads just those tensors from the file, so a process that needs one
    module of the model (a shard replica: psi) never loads the others (the CLIP towers). The header is checked
    as :func:`read_checkpoint` checks it; CheckpointError when no tensor matches."""
    want = tuple(f"model.{p}" for p in prefixes)
    if not want:
        raise ValueError("read_checkpoint_subset: give at least one prefix")
    header, tensors = _read_gare_file(path, FORMAT, "no GARE header; is this a GARE checkpoint? (try gare-train import-official)",
                                      select=lambda k: k.startswith(want))
    if header.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {header.get('version')} is not supported (expected {FORMAT_VERSION})")
    if not tensors:
        raise CheckpointError(f"{path}: no model tensor starts with {list(prefixes)}")
    sd = {k[len("model."):]: v for k, v in tensors.items()}
    return Checkpoint(ModelConfig.from_dict(header["model_config"]), sd, {}, header.get("train_args", {}),
                      header.get("info", {}), str(path))


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", *, eval_mode: bool = True):
    """Rebuild the model from the checkpoint alone (no download: the backbone starts empty)."""
    ckpt = read_checkpoint(path)
    model = GARE.build(ckpt.config, pretrained="none")
    missing, unexpected = model.load_state_dict(ckpt.state_dict, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not fit {ckpt.config.backbone}: missing={missing[:5]} unexpected={unexpected[:5]}")
    model.to(device)
    if eval_mode:
        model.eval()
    return model, ckpt


# ---------------------------------------------------------------- generic trees (trainer state)
def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = _contiguous_cpu(obj)
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError(f"{prefix}: only str/int keys can be saved")
        return {"__dict__": [[k, _flatten(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_flatten(v, f"{prefix}[{i}]", tensors) for i, v in enumerate(obj)], "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{prefix}: cannot save a {type(obj).__name__} without pickle")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: _unflatten(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            items = [_unflatten(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj.get("tuple") else items
    return obj


def save_tree(path: str | os.PathLike, tree: Any) -> None:
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(tree, "", tensors)
    meta = {"gare": json.dumps({"format": TREE_FORMAT, "version": FORMAT_VERSION, "tree": structure})}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))


def load_tree(path: str | os.PathLike) -> Any:
    header, tensors = _read_gare_file(path, TREE_FORMAT, "not a GARE state file")
    return _unflatten(header["tree"], tensors)
