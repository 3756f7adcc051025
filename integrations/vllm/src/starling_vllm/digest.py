"""Starling's 128-bit additive state digest, bit for bit the same as `proto/src/delta/digest.rs`.

``D(W) = Σ h(tensor, i, W[tensor][i]) mod 2**128`` over every element of every tensor, with
the element hash keyed by the model id (BLAKE3 ``derive_key("starling state digest v1",
model_id)``) and the tensor name (keyed BLAKE3 of the name). Because it is a sum, a change
of some elements moves it by ``Σ h(new) - h(old)`` over those elements only, which is how
``starling_apply`` proves a version in O(changes). Rendered as the hex of its 16
little-endian bytes, like ``StateDigest``'s ``Display`` (``pre_digest``/``post_digest`` in a
delta's manifest and in ``starling-hub delta diff --output json``).

Vectorised with numpy uint64 arithmetic (the 64x64->128 products are built from 32-bit
halves); ~0.2 s per million elements on this machine's CPU.
"""

from __future__ import annotations

import blake3
import numpy as np

MASK128 = (1 << 128) - 1
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _u64(b: bytes) -> int:
    return int.from_bytes(b, "little")


class DigestKey:
    """The per-model key of the element hash."""

    def __init__(self, model_id: str) -> None:
        h = blake3.blake3(model_id.encode(), derive_key_context="starling state digest v1")
        self.key = h.digest()
        self.seeds = [(_u64(self.key[i * 8 : i * 8 + 8]) | 1) for i in range(4)]

    def tensor(self, name: str) -> tuple[int, int]:
        b = blake3.blake3(name.encode(), key=self.key).digest()
        return _u64(b[:8]), _u64(b[8:16])


def _fold_mul(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(x*y as 128 bits) low64 XOR high64, element-wise on uint64 arrays."""
    xl, xh = x & _M32, x >> _S32
    yl, yh = y & _M32, y >> _S32
    ll = xl * yl
    lh = xl * yh
    hl = xh * yl
    hh = xh * yh
    mid = (ll >> _S32) + (lh & _M32) + (hl & _M32)
    lo = (ll & _M32) | (mid << _S32)
    hi = hh + (lh >> _S32) + (hl >> _S32) + (mid >> _S32)
    return lo ^ hi


def _sum_u64(a: np.ndarray) -> int:
    """Exact sum of uint64 values as a Python int."""
    if a.size == 0:
        return 0
    return int((a & _M32).sum(dtype=np.uint64)) + (int((a >> _S32).sum(dtype=np.uint64)) << 32)


_CHUNK = 1 << 22


def tensor_sum(key: DigestKey, name: str, bits: np.ndarray, index: np.ndarray | None = None) -> int:
    """Σ h(name, i, bits[i]) over the elements (flat positions ``index``, or 0..len) mod 2**128.

    ``bits``: uint16 array of BF16 bit patterns (flat)."""
    a, b = key.tensor(name)
    s0, s1, s2, s3 = (np.uint64(s) for s in key.seeds)
    bits = np.ascontiguousarray(bits).reshape(-1)
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, bits.size, _CHUNK):
            chunk = bits[start : start + _CHUNK].astype(np.uint64)
            if index is None:
                idx = np.arange(start, start + chunk.size, dtype=np.uint64)
            else:
                idx = np.ascontiguousarray(index[start : start + _CHUNK]).astype(np.uint64)
            x = idx ^ np.uint64(a)
            y = (chunk ^ np.uint64(b)) * _GOLDEN
            lo = _fold_mul(x ^ s0, y ^ s1)
            rot = (x << np.uint64(29)) | (x >> np.uint64(35))
            hi = _fold_mul(lo ^ s2, rot ^ y ^ s3)
            total += _sum_u64(lo) + (_sum_u64(hi) << 64)
    return total & MASK128


def to_hex(d: int) -> str:
    return (d & MASK128).to_bytes(16, "little").hex()


def from_hex(s: str) -> int:
    b = bytes.fromhex(s)
    if len(b) != 16:
        raise ValueError(f"a state digest is 16 bytes (32 hex digits), not {len(b)}")
    return int.from_bytes(b, "little")
