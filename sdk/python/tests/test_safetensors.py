"""The BF16 safetensors writer: PyTorch's cast bit for bit, a well-formed file, atomic writes."""

from __future__ import annotations

import os
import struct

import pytest

from conftest import needs_torch
from starling import StarlingError, read_raw, save_bf16
from starling.safetensors import read_header

pytestmark = needs_torch


def _torch():
    import torch

    return torch


def rne_reference(bits32: int) -> int:
    """Round-to-nearest-even from an F32 bit pattern to BF16 (non-NaN inputs), written out
    independently of PyTorch."""
    lsb = (bits32 >> 16) & 1
    return ((bits32 + 0x7FFF + lsb) >> 16) & 0xFFFF


def f32_bits(values) -> list:
    return [struct.unpack("<I", struct.pack("<f", v))[0] for v in values]


def tricky_f32():
    """F32 values whose BF16 rounding is easy to get wrong."""
    torch = _torch()
    bits = [
        0x00000000, 0x80000000,  # ±0
        0x7F800000, 0xFF800000,  # ±inf
        0x7FC00000, 0xFFC00000,  # quiet NaNs
        0x7F800001, 0x7FA00000, 0xFF800001,  # signalling NaNs / payloads
        0x7FFFFFFF, 0xFFFFFFFF,  # all-ones NaNs
        0x00000001, 0x80000001,  # smallest subnormals (round to ±0)
        0x00008000, 0x00018000,  # subnormal ties: to even (down), to even (up)
        0x007FFFFF, 0x00400000,  # largest subnormal (rounds up to the smallest normal), a BF16 subnormal
        0x00800000,  # smallest normal
        0x3F808000,  # 1 + 2^-8: a tie, rounds down to even 1.0
        0x3F818000,  # a tie, rounds up to even
        0x3F808001,  # just over a tie: up
        0x3F807FFF,  # just under a tie: down
        0x7F7FFFFF,  # FLT_MAX: rounds to inf
        0x7F7F7FFF,  # just under BF16's rounding boundary: stays finite
        0x7F7F8000,  # the tie at BF16 max: rounds to inf (to even)
        0xC0490FDB,  # -pi
        0x3DCCCCCD,  # 0.1
    ]
    t = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return t, bits


def test_bf16_bits_equal_torch_cast(tmp_path):
    torch = _torch()
    tricky, bits = tricky_f32()
    g = torch.Generator().manual_seed(0)
    # Random values of every magnitude, in shapes that exercise both PyTorch's vectorised and
    # scalar cast paths (lengths around multiples of 8, 16 and 32).
    random_bits = torch.randint(0, 2**32, (4099,), generator=g, dtype=torch.int64).to(torch.int32)
    state = {
        "tricky": tricky,
        "tricky_long": tricky.repeat(37),  # vectorised path over the same values
        "random_bits": random_bits.view(torch.float32),
        "randn": torch.randn(33, 17, generator=g) * 1e3,
        "f64": torch.randn(5, 7, generator=g, dtype=torch.float64) * 1e-40,  # F64 subnormal range
        "f16": torch.randn(31, generator=g).to(torch.float16),
        "bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "transposed": torch.randn(6, 10, generator=g).t(),  # not contiguous
        "strided": torch.randn(40, generator=g)[::3],  # not contiguous
        "scalar": torch.tensor(3.0),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "x.safetensors"
    save_bf16(state, str(path))
    raw = read_raw(str(path))
    assert list(raw) == list(state)
    for name, t in state.items():
        e = raw[name]
        assert e.dtype == "BF16"
        assert e.shape == tuple(t.shape), name
        want = t.to(torch.bfloat16).contiguous().view(torch.int16).flatten().tolist()
        got = list(struct.unpack(f"<{len(e.data) // 2}h", e.data))
        assert got == want, f"{name}: BF16 bits differ from tensor.to(torch.bfloat16)"

    # The non-NaN values also agree with round-to-nearest-even written out by hand.
    got = struct.unpack(f"<{len(raw['tricky'].data) // 2}H", raw["tricky"].data)
    for b, g16 in zip(bits, got, strict=True):
        if (b & 0x7F800000) == 0x7F800000 and (b & 0x007FFFFF):
            assert (g16 & 0x7F80) == 0x7F80 and (g16 & 0x7F), f"NaN {b:#010x} became {g16:#06x}, not a NaN"
        else:
            assert g16 == rne_reference(b), f"{b:#010x}: got {g16:#06x}, want {rne_reference(b):#06x}"


def test_file_layout(tmp_path):
    torch = _torch()
    state = {"b": torch.ones(3), "a": torch.zeros(2, 2), "c.weight": torch.full((5,), -2.5)}
    path = tmp_path / "m.safetensors"
    size = save_bf16(state, str(path), metadata={"step": "7"})
    assert size == os.path.getsize(path)
    header, start = read_header(str(path))
    assert start % 8 == 0, "tensor data must start 8-byte aligned"
    assert header["__metadata__"] == {"format": "pt", "step": "7"}
    # Data in the state dict's order, back to back from offset 0, sized shape x 2 bytes.
    end = 0
    for name, t in state.items():
        info = header[name]
        assert info["dtype"] == "BF16"
        assert info["shape"] == list(t.shape)
        assert info["data_offsets"] == [end, end + 2 * t.numel()]
        end += 2 * t.numel()
    assert start + end == size
    assert struct.unpack("<H", read_raw(str(path))["c.weight"].data[:2])[0] == 0xC020  # -2.5
    assert os.listdir(tmp_path) == ["m.safetensors"], "no temporary file is left behind"
    # The writer's output is what the reference `safetensors` package reads, when installed.
    st = pytest.importorskip("safetensors.torch", reason="safetensors not installed (optional cross-check)")
    loaded = st.load_file(str(path))
    for name, t in state.items():
        assert torch.equal(loaded[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16))


def test_invalid_state_dicts_write_nothing(tmp_path):
    torch = _torch()
    good = torch.ones(2)
    cases = {
        "int": ({"w": good, "ids": torch.arange(3)}, "ids"),
        "bool": ({"mask": torch.ones(2, dtype=torch.bool)}, "mask"),
        "not a tensor": ({"w": good, "lr": 0.1}, "lr"),
        "meta": ({"w": torch.empty(2, device="meta")}, "w"),
        "reserved": ({"__metadata__": good}, "__metadata__"),
        "empty": ({}, "empty"),
    }
    for what, (state, named) in cases.items():
        path = tmp_path / "x.safetensors"
        with pytest.raises(StarlingError) as e:
            save_bf16(state, str(path))
        assert e.value.code == "invalid_state_dict", what
        assert named in e.value.message, f"{what}: {e.value.message!r} does not name {named}"
        assert os.listdir(tmp_path) == [], f"{what}: something was written"


def test_replace_is_atomic(tmp_path):
    torch = _torch()
    path = tmp_path / "m.safetensors"
    save_bf16({"w": torch.ones(4)}, str(path))
    ino = os.stat(path).st_ino
    save_bf16({"w": torch.full((4,), 2.0)}, str(path))
    # A new file renamed into place: a reader (or the hub's mmap) of the old one is unaffected.
    assert os.stat(path).st_ino != ino
    assert read_raw(str(path))["w"].data == struct.pack("<4H", *([0x4000] * 4))
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
