"""Writing a PyTorch state dict as a BF16 safetensors file, and reading safetensors back,
without the ``safetensors`` package.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header mapping each tensor's name to ``{"dtype", "shape", "data_offsets"}``
(offsets relative to the end of the header), optionally ``"__metadata__"`` (string values),
then the raw little-endian bytes. The header is padded with spaces to a multiple of 8 bytes so
that every tensor is 8-byte aligned in the file (the hub memory-maps BF16 tensors in place when
they are 2-byte aligned).

Invariants kept here:

* **The cast is PyTorch's.** Every tensor becomes BF16 through ``tensor.to(torch.bfloat16)`` on
  its own device, so the published bits are exactly what a PyTorch trainer would get
  (round-to-nearest-even, and whatever NaN payload PyTorch's kernels produce). Nothing here
  re-implements the rounding.
* **Validate, then write.** :func:`prepare_state_dict` checks every entry before a byte is
  written; :func:`write_bf16` only writes what it was given.
* **Atomic.** The file is written as ``NAME.tmp``, fsynced, renamed over ``NAME`` with
  ``os.replace``, and the directory is fsynced: a reader sees the old file, the whole new file,
  or nothing. A published file is never rewritten in place (the hub memory-maps it).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from .errors import StarlingError

# Bytes per element of the dtypes the reader understands.
DTYPE_SIZES = {
    "BF16": 2,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "I8": 1,
    "U8": 1,
    "I16": 2,
    "I32": 4,
    "I64": 8,
    "BOOL": 1,
}

MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class PreparedTensor:
    """One validated state-dict entry, not yet cast."""

    name: str
    tensor: Any  # torch.Tensor
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return 2 * n


def _invalid(message: str) -> StarlingError:
    return StarlingError("invalid_state_dict", message)


def prepare_state_dict(state_dict: Mapping[str, Any]) -> List[PreparedTensor]:
    """Check every entry of ``state_dict`` and return them in order, ready for :func:`write_bf16`.

    Raises :class:`StarlingError` (code ``invalid_state_dict``) naming the first bad tensor:
    a key that is not a non-empty string, a value that is not a floating-point dense tensor,
    or a tensor on the ``meta`` device.
    """
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise _invalid(
            "publishing a state dict needs PyTorch (pip install torch); "
            "or publish the path of a safetensors file"
        ) from e
    if not isinstance(state_dict, Mapping):
        raise _invalid(f"expected a mapping of names to tensors, got {type(state_dict).__name__}")
    if len(state_dict) == 0:
        raise _invalid("the state dict is empty")
    out: List[PreparedTensor] = []
    for name, t in state_dict.items():
        if not isinstance(name, str) or not name:
            raise _invalid(f"tensor names must be non-empty strings, got {name!r}")
        if name == "__metadata__":
            raise _invalid("a tensor cannot be named __metadata__ (reserved by safetensors)")
        if not isinstance(t, torch.Tensor):
            raise _invalid(f"{name} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise _invalid(f"{name} has layout {t.layout}; only dense tensors can be published")
        if not t.is_floating_point():
            raise _invalid(
                f"{name} has dtype {t.dtype}; only floating-point tensors can be published "
                "(they are cast to BF16)"
            )
        if t.device.type == "meta":
            raise _invalid(f"{name} is on the meta device and holds no values")
        out.append(PreparedTensor(name, t, tuple(int(d) for d in t.shape)))
    return out


def to_bf16_cpu(t: Any) -> Any:
    """``t`` cast to BF16 exactly as ``t.to(torch.bfloat16)`` does, then moved to the CPU and
    made contiguous (both of which copy bits unchanged)."""
    import torch

    return t.detach().to(torch.bfloat16).to("cpu").contiguous()


def _raw_bytes(t: Any) -> memoryview:
    """The little-endian bytes of a contiguous CPU tensor, without copying where possible."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    if sys.byteorder == "little":
        buf = (ctypes.c_char * n).from_address(t.data_ptr())
        return memoryview(buf).cast("B")
    # Big-endian host: swap each element's bytes.
    import array

    a = array.array("H", ctypes.string_at(t.data_ptr(), n))
    a.byteswap()
    return memoryview(a.tobytes())


def _header_bytes(prepared: List[PreparedTensor], metadata: Optional[Mapping[str, str]]) -> bytes:
    header: Dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for p in prepared:
        header[p.name] = {
            "dtype": "BF16",
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return raw


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def write_bf16(
    prepared: List[PreparedTensor],
    path: str,
    metadata: Optional[Mapping[str, str]] = None,
) -> int:
    """Write the prepared tensors to ``path`` as BF16 safetensors, atomically. Returns the file's
    size in bytes. Tensors are cast one at a time, so the peak extra memory is one tensor."""
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    tmp = path + ".tmp"
    header = _header_bytes(prepared, {"format": "pt", **(metadata or {})})
    size = 8 + len(header)
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for p in prepared:
                b = to_bf16_cpu(p.tensor)
                if tuple(b.shape) != p.shape:  # pragma: no cover - a cast keeps the shape
                    raise _invalid(f"{p.name} changed shape while being written")
                view = _raw_bytes(b)
                if len(view) != p.nbytes:  # pragma: no cover
                    raise _invalid(f"{p.name}: {len(view)} bytes for {p.nbytes} expected")
                f.write(view)
                size += len(view)
                del view, b
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)
    return size


def save_bf16(state_dict: Mapping[str, Any], path: str, metadata: Optional[Mapping[str, str]] = None) -> int:
    """Validate ``state_dict`` and write it to ``path`` as BF16 safetensors (atomically)."""
    return write_bf16(prepare_state_dict(state_dict), path, metadata)


# --------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: its dtype name, shape and raw little-endian bytes."""

    dtype: str
    shape: Tuple[int, ...]
    data: bytes


def read_header(path: str) -> Tuple[Dict[str, Any], int]:
    """The parsed JSON header of a safetensors file and the offset where its data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise ValueError(f"{path}: header length {n} is over the 100 MB limit")
        header = f.read(n)
        if len(header) != n:
            raise ValueError(f"{path}: truncated header")
    return json.loads(header), 8 + n


def read_raw(path: str) -> Dict[str, TensorEntry]:
    """Every tensor of a safetensors file as raw bytes (checks the offsets against the file)."""
    header, start = read_header(path)
    file_len = os.path.getsize(path)
    out: Dict[str, TensorEntry] = {}
    with open(path, "rb") as f:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = info["dtype"]
            shape = tuple(int(d) for d in info["shape"])
            a, b = (int(x) for x in info["data_offsets"])
            numel = 1
            for d in shape:
                numel *= d
            size = DTYPE_SIZES.get(dtype)
            if size is None:
                raise ValueError(f"{path}: {name} has dtype {dtype}, which this reader does not know")
            if b < a or b - a != numel * size or start + b > file_len:
                raise ValueError(f"{path}: {name}: data_offsets {a, b} do not match its shape or the file")
            f.seek(start + a)
            out[name] = TensorEntry(dtype, shape, f.read(b - a))
    return out


def load_torch(path: str, names: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """A safetensors file as ``{name: torch.Tensor}`` in the file's dtypes (needs torch)."""
    import torch

    dtypes = {
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "F64": torch.float64,
        "I8": torch.int8,
        "U8": torch.uint8,
        "I16": torch.int16,
        "I32": torch.int32,
        "I64": torch.int64,
        "BOOL": torch.bool,
    }
    wanted = set(names) if names is not None else None
    out = {}
    for name, e in read_raw(path).items():
        if wanted is not None and name not in wanted:
            continue
        if sys.byteorder != "little":  # pragma: no cover
            raise NotImplementedError("load_torch reads little-endian hosts only")
        if len(e.data) == 0:
            t = torch.empty(e.shape, dtype=dtypes[e.dtype])
        else:
            t = torch.frombuffer(bytearray(e.data), dtype=dtypes[e.dtype]).reshape(e.shape)
        out[name] = t
    return out
