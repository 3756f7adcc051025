"""Patch files: one committed Starling version as sparse changes, in checkpoint coordinates.

A patch file is a safetensors file. Per changed checkpoint tensor NAME it holds

- ``NAME.indices``: flat positions into the tensor (row-major), strictly ascending, I64 or U32;
- ``NAME.values``: the new BF16 bits at those positions (same length).

and ``__metadata__`` (all strings): ``format`` = ``starling-patch-v1``, ``model_id``,
``base_version``, ``starling_version`` (the version it makes), ``pre_digest`` and
``post_digest`` (the state digests before and after, as in the delta's manifest; see
:mod:`starling_vllm.digest`), and ``shapes``: a JSON object NAME -> full shape of every
tensor the patch touches, so a reader validates shapes without the checkpoint.

This module writes and reads them (safetensors + torch only); the actor writes the same
layout from Rust (docs/vllm.md).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "starling-patch-v1"
META_KEYS = ("model_id", "base_version", "starling_version", "pre_digest", "post_digest", "shapes")


class PatchError(ValueError):
    """A patch file that cannot be applied, with a sentence saying why."""


@dataclass
class TensorChange:
    name: str
    shape: tuple[int, ...]
    indices: torch.Tensor  # int64, 1-D, ascending
    values: torch.Tensor  # bfloat16, 1-D


@dataclass
class Patch:
    model_id: str
    base_version: int
    version: int
    pre_digest: str
    post_digest: str
    changes: list[TensorChange] = field(default_factory=list)

    @property
    def num_changes(self) -> int:
        return sum(c.indices.numel() for c in self.changes)


def diff(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> list[TensorChange]:
    """The changes turning ``old`` into ``new`` (BF16 tensors with the same names and shapes),
    compared as bits (so -0.0 vs 0.0 and NaN payloads count as changes)."""
    out = []
    for name in sorted(new):
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
            raise PatchError(f"{name}: diff needs BF16 tensors of one shape")
        fa = a.reshape(-1).view(torch.int16)
        fb = b.reshape(-1).view(torch.int16)
        idx = torch.nonzero(fa != fb).reshape(-1).to(torch.int64)
        if idx.numel():
            out.append(TensorChange(name, tuple(b.shape), idx, b.reshape(-1)[idx].clone()))
    return out


def write(path: str, patch: Patch) -> None:
    """Writes ``patch`` atomically (temporary file + rename)."""
    tensors = {}
    for c in patch.changes:
        tensors[f"{c.name}.indices"] = c.indices.to(torch.int64).contiguous()
        tensors[f"{c.name}.values"] = c.values.to(torch.bfloat16).contiguous()
    meta = {
        "format": FORMAT,
        "model_id": patch.model_id,
        "base_version": str(patch.base_version),
        "starling_version": str(patch.version),
        "pre_digest": patch.pre_digest,
        "post_digest": patch.post_digest,
        "shapes": json.dumps({c.name: list(c.shape) for c in patch.changes}, sort_keys=True),
    }
    tmp = f"{path}.tmp.{os.getpid()}"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def read(path: str) -> Patch:
    """Reads and checks the structure of a patch file (not yet against a model)."""
    try:
        f = safe_open(path, framework="pt")
    except FileNotFoundError:
        raise PatchError(f"the patch file {path} does not exist") from None
    except Exception as e:  # safetensors raises its own error types
        raise PatchError(f"{path} is not a readable safetensors file: {e}") from None
    with f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise PatchError(
                f"{path} is not a Starling patch file (metadata format is "
                f"{meta.get('format')!r}, expected {FORMAT!r})"
            )
        missing = [k for k in META_KEYS if k not in meta]
        if missing:
            raise PatchError(f"{path}: metadata lacks {', '.join(missing)}")
        try:
            base, ver = int(meta["base_version"]), int(meta["starling_version"])
            shapes = {k: tuple(int(d) for d in v) for k, v in json.loads(meta["shapes"]).items()}
        except (ValueError, TypeError) as e:
            raise PatchError(f"{path}: malformed metadata ({e})") from None
        keys = set(f.keys())
        names = sorted({k.rsplit(".", 1)[0] for k in keys})
        changes = []
        for name in names:
            ik, vk = f"{name}.indices", f"{name}.values"
            if ik not in keys or vk not in keys:
                raise PatchError(f"{path}: tensor {name} needs both {ik} and {vk}")
            if name not in shapes:
                raise PatchError(f"{path}: tensor {name} has no shape in the metadata")
            idx, val = f.get_tensor(ik), f.get_tensor(vk)
            if idx.dtype not in (torch.int64, torch.uint32) or idx.ndim != 1:
                raise PatchError(f"{path}: {ik} must be a 1-D I64 or U32 tensor, not {idx.dtype} {tuple(idx.shape)}")
            if val.dtype != torch.bfloat16 or val.ndim != 1:
                raise PatchError(f"{path}: {vk} must be a 1-D BF16 tensor, not {val.dtype} {tuple(val.shape)}")
            if idx.numel() != val.numel():
                raise PatchError(f"{path}: {name} has {idx.numel()} positions but {val.numel()} values")
            idx = idx.to(torch.int64)
            numel = math.prod(shapes[name])
            if idx.numel():
                if not bool((idx[1:] > idx[:-1]).all()):
                    raise PatchError(f"{path}: {name}'s positions are not strictly ascending")
                if int(idx[0]) < 0 or int(idx[-1]) >= numel:
                    raise PatchError(f"{path}: {name} has positions outside its {numel} elements")
                if bool(torch.isnan(val).any()):
                    raise PatchError(
                        f"{path}: {name} sets NaN values; vLLM's sparse loader reserves NaN for "
                        "'unchanged', so such a version needs starling_load_full"
                    )
            changes.append(TensorChange(name, shapes[name], idx, val))
        extra = set(shapes) - set(names)
        if extra:
            raise PatchError(f"{path}: metadata shapes name tensors with no data: {sorted(extra)}")
    return Patch(meta["model_id"], base, ver, meta["pre_digest"], meta["post_digest"], changes)
