"""vLLM worker extension: Starling versions applied in place, in checkpoint coordinates.

Start vLLM with ``--worker-extension-cls starling_vllm.extension.StarlingWorkerExtension``
(and ``VLLM_SERVER_DEV_MODE=1`` for ``POST /collective_rpc``). Every method takes strings and
returns a JSON object; failures are returned as ``{"ok": false, "error": "<sentence>",
"fenced": bool}``, never raised (``/collective_rpc`` would turn an exception into a bare 500).
The interface is documented in docs/vllm.md.

vLLM's dev routes carry no authentication: bind the server to loopback (``--host 127.0.0.1``,
what the actor does). And the methods that take a file path read or write only under the
directory named by ``STARLING_VLLM_ROOT`` (the actor sets it to its store's ``vllm``
directory when it starts vLLM); without it they refuse every path, so nobody who reaches the
port can make vLLM read or write a file elsewhere.

CPU build: vLLM's CPU backend prepacks every linear layer's weight (oneDNN / sgl kernels) and
normally frees the BF16 parameter, so writing into parameters would change nothing the model
computes. Importing this module (vLLM imports it in each worker before loading the model)
makes the prepack keep the BF16 parameters (``remove_weight=False``); after a write, every
touched layer is packed again. On a GPU nothing is wrapped and there is nothing to re-pack.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import digest as dg
from .patch import PatchError, read as read_patch

try:  # keep the BF16 weights of prepacked CPU linear layers (see the module doc)
    from vllm.platforms import current_platform
    import vllm.model_executor.layers.utils as _vllm_layer_utils

    _ORIGINAL_DISPATCH = getattr(_vllm_layer_utils, "dispatch_cpu_unquantized_gemm", None)
    IS_CPU = bool(current_platform.is_cpu())
    if IS_CPU and _ORIGINAL_DISPATCH is not None and not getattr(
        _ORIGINAL_DISPATCH, "_starling_keeps_weight", False
    ):

        def _dispatch_keeping_weight(layer, remove_weight=True):
            return _ORIGINAL_DISPATCH(layer, False)

        _dispatch_keeping_weight._starling_keeps_weight = True
        _vllm_layer_utils.dispatch_cpu_unquantized_gemm = _dispatch_keeping_weight
except ImportError:  # imported without vLLM (unit tests of the pure parts)
    _ORIGINAL_DISPATCH = None
    IS_CPU = False


@dataclass
class Slot:
    """Where checkpoint tensor ``name`` lives in vLLM: rows [row0, row0+rows) of ``param``."""

    param_name: str
    param: torch.nn.Parameter
    row0: int
    rows: int
    shape: tuple[int, ...]

    def view(self) -> torch.Tensor:
        t = self.param.data
        if t.ndim >= 2 or self.rows != t.shape[0] or self.row0 != 0:
            t = t[self.row0 : self.row0 + self.rows]
        return t.reshape(self.shape)


class Refused(Exception):
    """Refused before anything was written."""


ROOT_ENV = "STARLING_VLLM_ROOT"


def confined(path: str) -> str:
    """``path`` with its links resolved, if it lies under ``$STARLING_VLLM_ROOT``; refused
    otherwise (the same sentence whether the file exists or not)."""
    root = os.environ.get(ROOT_ENV)
    if not root:
        raise Refused(
            f"this vLLM reads and writes no file paths: start it with {ROOT_ENV} naming the "
            "directory patches and checkpoints come from (the actor sets it to its store)"
        )
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise Refused(f"{path} is outside {root} ({ROOT_ENV}), the only directory this vLLM reads or writes")
    return real


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's BF16 bits, read on the host (a GPU parameter is copied; a CPU one is not)."""
    return t.detach().contiguous().reshape(-1).view(torch.int16).cpu().numpy().view(np.uint16)


def _beside(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``t`` (read from a patch, on the host) on ``param``'s device, where writing into
    ``param`` needs it; the same tensor where they already share one (CPU)."""
    return t if t.device == param.device else t.to(param.device, non_blocking=False)


class StarlingWorkerExtension:
    # -- helpers -------------------------------------------------------------------------
    def _st(self) -> dict:
        st = getattr(self, "_starling_state", None)
        if st is None:
            st = {"model_id": None, "version": None, "digest": None, "fenced": False, "reason": None}
            self._starling_state = st
        return st

    def _model(self) -> torch.nn.Module:
        mr = self.model_runner
        return mr.get_model() if hasattr(mr, "get_model") else mr.model

    def _tp(self) -> int:
        try:
            from vllm.distributed import get_tensor_model_parallel_world_size

            return get_tensor_model_parallel_world_size()
        except Exception:
            return 1

    def _max_num_seqs(self) -> int | None:
        """The sequences vLLM's scheduler runs at once (``--max-num-seqs``, or vLLM's default
        for the device): an actor attached to a server it did not start reads it here and keeps
        no more than that in flight, so that none of its requests waits silently in vLLM's
        queue."""
        n = getattr(getattr(getattr(self, "vllm_config", None), "scheduler_config", None), "max_num_seqs", None)
        return n if isinstance(n, int) and n > 0 else None

    def _layout(self) -> dict[str, Slot]:
        """Checkpoint name -> Slot, for every parameter (fused ones split back)."""
        cached = getattr(self, "_starling_layout", None)
        if cached is not None:
            return cached
        model = self._model()
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        out: dict[str, Slot] = {}
        for pname, p in model.named_parameters():
            if p.numel() == 0:
                raise RuntimeError(
                    f"vLLM parameter {pname} is empty: its layer was prepacked without keeping "
                    "the weight. Start vLLM with --worker-extension-cls "
                    "starling_vllm.extension.StarlingWorkerExtension so the extension is "
                    "imported before the model loads"
                )
            mod_path, _, pleaf = pname.rpartition(".")
            leaf = mod_path.rpartition(".")[2]
            module = model.get_submodule(mod_path)
            if leaf in packed and pleaf == "weight" and hasattr(module, "output_sizes"):
                sizes = list(module.output_sizes)
                subs = packed[leaf]
                if len(sizes) != len(subs) or sum(sizes) != p.shape[0]:
                    raise RuntimeError(f"cannot split {pname} {tuple(p.shape)} into {subs} {sizes}")
                row = 0
                for sub, n in zip(subs, sizes):
                    ck = f"{mod_path.rpartition('.')[0]}.{sub}.{pleaf}"
                    out[ck] = Slot(pname, p, row, n, (n, *p.shape[1:]))
                    row += n
            elif hasattr(module, "org_vocab_size") and p.ndim == 2:
                n = int(module.org_vocab_size)
                out[pname] = Slot(pname, p, 0, n, (n, *p.shape[1:]))
            else:
                out[pname] = Slot(pname, p, 0, p.shape[0] if p.ndim else 1, tuple(p.shape))
        self._starling_layout = out
        return out

    def _repack(self, param_names) -> int:
        """Packs again the CPU layers owning ``param_names``; returns how many."""
        if not IS_CPU or _ORIGINAL_DISPATCH is None:
            return 0
        model = self._model()
        n = 0
        for mod_path in sorted({p.rpartition(".")[0] for p in param_names}):
            module = model.get_submodule(mod_path)
            if hasattr(module, "cpu_linear") and getattr(module, "weight", None) is not None:
                _ORIGINAL_DISPATCH(module, False)
                n += 1
        return n

    def _full_digest(self, model_id: str) -> int:
        key = dg.DigestKey(model_id)
        total = 0
        for name, slot in sorted(self._layout().items()):
            total += dg.tensor_sum(key, name, _bits(slot.view()))
        return total & dg.MASK128

    def _fail(self, e: Exception, fenced: bool) -> dict:
        st = self._st()
        if fenced:
            st["fenced"] = True
            st["reason"] = str(e)
        return {"ok": False, "error": str(e), "fenced": st["fenced"], "version": st["version"]}

    def _check_tp1(self, what: str) -> None:
        if self._tp() != 1:
            raise Refused(f"{what} reads vLLM's parameters whole; tensor parallel > 1 is not supported yet")

    # -- methods for /collective_rpc -----------------------------------------------------
    def starling_status(self) -> dict:
        st = self._st()
        return {
            "ok": True,
            "model_id": st["model_id"],
            "version": st["version"],
            "digest": None if st["digest"] is None else dg.to_hex(st["digest"]),
            "fenced": st["fenced"],
            "reason": st["reason"],
            "tensors": len(self._layout()),
            "tp": self._tp(),
            "max_num_seqs": self._max_num_seqs(),
        }

    def starling_attach(self, model_id: str, version: str) -> dict:
        """Declares what vLLM was started with; returns its state digest read back from vLLM's
        parameters. The actor takes work only if that digest equals its own for ``version``."""
        try:
            self._check_tp1("starling_attach")
            t0 = time.perf_counter()
            d = self._full_digest(model_id)
            st = self._st()
            st.update(model_id=model_id, version=int(version), digest=d, fenced=False, reason=None)
            return {"ok": True, "model_id": model_id, "version": int(version), "digest": dg.to_hex(d),
                    "seconds": time.perf_counter() - t0}
        except Exception as e:
            return self._fail(e, False)

    def starling_apply(self, path: str, mode: str = "auto") -> dict:
        """Applies one patch file in place (docs/vllm.md); answers the state digest reached.

        ``mode``: ``loader`` writes through vLLM's ``load_checkpoint_weight_patches`` (the
        model's own ``load_weights``: its name mapping and tensor-parallel slicing; O(tensor)
        per touched tensor, since unchanged positions ride as NaN in a full-size staging
        tensor); ``scatter`` writes the positions straight into the parameters through the
        extension's checkpoint-coordinate views (O(changes); tensor parallel 1 only);
        ``auto`` (default): ``scatter`` when tensor parallel is 1, else ``loader``. Both copy
        bits; the tests alternate them and compare with vLLM's own load."""
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        st = self._st()
        wrote = False
        try:
            t0 = time.perf_counter()
            # A path outside the root is refused before anything else is said about it.
            path = confined(path)
            if st["fenced"]:
                raise Refused(
                    f"this vLLM is fenced since a failed update ({st['reason']}); reload a full "
                    "checkpoint with starling_load_full before applying versions"
                )
            if st["model_id"] is None:
                raise Refused("no version is known: call starling_attach or starling_load_full first")
            self._check_tp1("starling_apply")
            if mode not in ("auto", "loader", "scatter"):
                raise Refused(f"mode must be auto, loader or scatter, not {mode!r}")
            if mode == "auto":
                mode = "scatter" if self._tp() == 1 else "loader"
            p = read_patch(path)
            if p.model_id != st["model_id"]:
                raise Refused(
                    f"the patch is for model {p.model_id!r} but this vLLM serves {st['model_id']!r}: "
                    "send it to an actor of that model"
                )
            if p.base_version != st["version"]:
                raise Refused(
                    f"the patch turns version {p.base_version} into {p.version} but this vLLM holds "
                    f"version {st['version']}: apply the versions in between, or starling_load_full"
                )
            if dg.from_hex(p.pre_digest) != st["digest"]:
                raise Refused(
                    f"the patch's base digest {p.pre_digest} differs from this vLLM's "
                    f"{dg.to_hex(st['digest'])} for version {st['version']}: another run or base; "
                    "reload with starling_load_full"
                )
            layout = self._layout()
            for c in p.changes:
                slot = layout.get(c.name)
                if slot is None:
                    near = sorted(layout)[:3]
                    raise Refused(
                        f"the patch names tensor {c.name!r}, which this vLLM model does not have "
                        f"(its checkpoint names are like {near}): wrong model or a name mapping is missing"
                    )
                if tuple(c.shape) != slot.shape:
                    raise Refused(
                        f"tensor {c.name} has shape {list(slot.shape)} in this vLLM but "
                        f"{list(c.shape)} in the patch: wrong model or config"
                    )
                if slot.param.dtype != torch.bfloat16:
                    raise Refused(f"{c.name} is {slot.param.dtype} in vLLM, not bfloat16: start vLLM with --dtype bfloat16")
            key = dg.DigestKey(p.model_id)
            old_sum = 0
            for c in p.changes:
                flat = layout[c.name].view().reshape(-1)
                old = flat[_beside(c.indices, flat)]
                old_sum += dg.tensor_sum(key, c.name, _bits(old), c.indices.numpy())
            t1 = time.perf_counter()
            wrote = True
            if mode == "loader":
                loaded = load_checkpoint_weight_patches(
                    self._model(),
                    [CheckpointWeightPatch(c.name, tuple(c.shape), torch.bfloat16, c.values, c.indices)
                     for c in p.changes],
                )
            else:
                loaded = set()
                for c in p.changes:
                    slot = layout[c.name]
                    # a view into the parameter's storage (rows of a contiguous tensor); the
                    # read-back below would catch a copy
                    dst = slot.view().reshape(-1)
                    dst.index_copy_(0, _beside(c.indices, dst), _beside(c.values, dst))
                    loaded.add(slot.param_name)
            t2 = time.perf_counter()
            repacked = self._repack(loaded)
            t3 = time.perf_counter()
            new_sum = 0
            for c in p.changes:
                flat = layout[c.name].view().reshape(-1)
                got = flat[_beside(c.indices, flat)].cpu()
                if not torch.equal(got.view(torch.int16), c.values.view(torch.int16)):
                    raise RuntimeError(f"{c.name} does not read back the values just written")
                new_sum += dg.tensor_sum(key, c.name, _bits(got), c.indices.numpy())
            d = (st["digest"] + new_sum - old_sum) & dg.MASK128
            if d != dg.from_hex(p.post_digest):
                raise RuntimeError(
                    f"after applying version {p.version} vLLM's state digest is {dg.to_hex(d)}, "
                    f"not the manifest's {p.post_digest}"
                )
            t4 = time.perf_counter()
            st.update(version=p.version, digest=d)
            return {
                "ok": True, "version": p.version, "digest": dg.to_hex(d), "changes": p.num_changes,
                "tensors": len(p.changes), "layers_repacked": repacked, "mode": mode,
                "seconds": {"validate": t1 - t0, "write": t2 - t1, "repack": t3 - t2,
                            "verify": t4 - t3, "total": t4 - t0},
            }
        except (Refused, PatchError) as e:
            return self._fail(e, fenced=wrote)
        except Exception as e:  # a failure after writing started fences this vLLM
            return self._fail(RuntimeError(f"applying {path} failed: {e}"), fenced=wrote)

    def starling_load_full(self, path: str, model_id: str, version: str) -> dict:
        """Fallback: loads a whole checkpoint (a .safetensors file or a directory of them) into
        the running model in place through the model's own load_weights, re-packs every layer,
        and answers the state digest read back (clears a fence only if the load succeeds)."""
        from safetensors import safe_open

        wrote = False
        try:
            t0 = time.perf_counter()
            self._check_tp1("starling_load_full")
            path = confined(path)
            files = (
                sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
                if os.path.isdir(path) else [path]
            )
            if not files:
                raise Refused(f"{path} holds no .safetensors file")
            files = [confined(f) for f in files]
            layout = self._layout()
            seen: dict[str, str] = {}
            handles = [safe_open(f, framework="pt") for f in files]
            for f, h in zip(files, handles):
                for name in h.keys():
                    sl = h.get_slice(name)
                    shape = tuple(sl.get_shape())
                    slot = layout.get(name)
                    if slot is None:
                        raise Refused(f"{f} has tensor {name!r}, which this vLLM model does not have")
                    if shape != slot.shape:
                        raise Refused(f"tensor {name} has shape {list(slot.shape)} in vLLM but {list(shape)} in {f}")
                    if sl.get_dtype() != "BF16":
                        raise Refused(f"tensor {name} in {f} is {sl.get_dtype()}, not BF16")
                    seen[name] = f
            missing = sorted(set(layout) - set(seen))
            if missing:
                raise Refused(f"{path} lacks {len(missing)} tensors of this model, e.g. {missing[:3]}")
            t1 = time.perf_counter()

            def weights():
                for h in handles:
                    for name in h.keys():
                        yield name, h.get_tensor(name)

            wrote = True
            loaded = self._model().load_weights(weights())
            t2 = time.perf_counter()
            repacked = self._repack(loaded or [s.param_name for s in layout.values()])
            t3 = time.perf_counter()
            d = self._full_digest(model_id)
            t4 = time.perf_counter()
            st = self._st()
            st.update(model_id=model_id, version=int(version), digest=d, fenced=False, reason=None)
            return {"ok": True, "model_id": model_id, "version": int(version), "digest": dg.to_hex(d),
                    "layers_repacked": repacked,
                    "seconds": {"validate": t1 - t0, "write": t2 - t1, "repack": t3 - t2,
                                "digest": t4 - t3, "total": t4 - t0}}
        except Exception as e:
            return self._fail(e, fenced=wrote)

    def starling_fingerprint(self, model_id: str = "") -> dict:
        """The state digest recomputed from all of vLLM's parameters (O(model); the apply
        answer's digest is the O(changes) form of the same number)."""
        try:
            self._check_tp1("starling_fingerprint")
            st = self._st()
            mid = model_id or st["model_id"]
            if not mid:
                raise Refused("name the model id (the digest is keyed by it)")
            t0 = time.perf_counter()
            d = self._full_digest(mid)
            return {"ok": True, "model_id": mid, "version": st["version"], "digest": dg.to_hex(d),
                    "matches_state": st["digest"] == d, "seconds": time.perf_counter() - t0}
        except Exception as e:
            return self._fail(e, False)

    def starling_read_back(self, names_csv: str, out_path: str) -> dict:
        """Writes the named checkpoint tensors (comma-separated; empty: all), read back from
        vLLM's parameters in checkpoint coordinates (fused qkv/gate_up split), to a
        safetensors file ``out_path``, for bit-for-bit comparison."""
        from safetensors.torch import save_file

        try:
            self._check_tp1("starling_read_back")
            out_path = confined(out_path)
            layout = self._layout()
            names = [n for n in names_csv.split(",") if n] or sorted(layout)
            unknown = [n for n in names if n not in layout]
            if unknown:
                raise Refused(f"this vLLM model has no tensors {unknown}")
            tensors = {n: layout[n].view().detach().contiguous().cpu().clone() for n in names}
            tmp = f"{out_path}.tmp.{os.getpid()}"
            save_file(tensors, tmp, metadata={"version": str(self._st()["version"])})
            os.replace(tmp, out_path)
            return {"ok": True, "path": out_path, "tensors": len(tensors),
                    "elements": int(sum(t.numel() for t in tensors.values()))}
        except Exception as e:
            return self._fail(e, False)
