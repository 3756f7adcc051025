"""Parts that need no vLLM server: the digest against the Rust implementation, patch files."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from starling_vllm import digest as dg
from starling_vllm import patch as sp
from vllm_harness import state_digest, write_patch

BIN = Path(os.environ.get("STARLING_BIN_DIR", "/var/tmp/starling-ci-target/release")) / "starling-hub"


def test_digest_equals_the_rust_state_digest(ckpts, workdir):
    if not BIN.is_file():
        pytest.skip(f"no {BIN} to cross-check the digest with (build the workspace in release)")
    old, new = ckpts[0] / "model.safetensors", ckpts[1] / "model.safetensors"
    out = subprocess.run(
        [str(BIN), "delta", "diff", str(old), str(new), "-o", str(workdir / "x.sdc"),
         "--model-id", "m-digest", "--json"],
        check=True, capture_output=True, text=True,
    ).stdout
    m = json.loads(out)
    assert state_digest("m-digest", load_file(old)) == m["pre_digest"]
    assert state_digest("m-digest", load_file(new)) == m["post_digest"]


def test_patch_round_trip_and_structure_errors(ckpts, workdir):
    old, new = load_file(ckpts[0] / "model.safetensors"), load_file(ckpts[1] / "model.safetensors")
    p = write_patch(workdir / "p.safetensors", old, new, 0, 1)
    q = sp.read(str(workdir / "p.safetensors"))
    assert (q.model_id, q.base_version, q.version) == (p.model_id, 0, 1)
    assert q.num_changes == p.num_changes > 0
    # applying the patch's changes to old gives new, bit for bit
    for c in q.changes:
        t = old[c.name].reshape(-1).clone()
        t[c.indices] = c.values
        assert torch.equal(t.view(torch.int16), new[c.name].reshape(-1).view(torch.int16))
    # not a patch file
    save_file({"a": torch.zeros(2)}, str(workdir / "plain.safetensors"))
    with pytest.raises(sp.PatchError, match="not a Starling patch file"):
        sp.read(str(workdir / "plain.safetensors"))
    with pytest.raises(sp.PatchError, match="does not exist"):
        sp.read(str(workdir / "missing.safetensors"))
    # NaN values cannot go through vLLM's sparse loader (NaN means "unchanged" there)
    c = q.changes[0]
    bad = sp.Patch("m", 0, 1, "00" * 16, "00" * 16,
                   [sp.TensorChange(c.name, c.shape, c.indices[:1], torch.tensor([float("nan")], dtype=torch.bfloat16))])
    sp.write(str(workdir / "nan.safetensors"), bad)
    with pytest.raises(sp.PatchError, match="NaN"):
        sp.read(str(workdir / "nan.safetensors"))


def test_digest_is_additive():
    key = dg.DigestKey("m")
    bits = torch.arange(1000, dtype=torch.int16).numpy().view("uint16")
    full = dg.tensor_sum(key, "t", bits)
    idx = torch.tensor([3, 500, 999]).numpy()
    new = bits.copy()
    new[idx] = [7, 8, 9]
    moved = (full - dg.tensor_sum(key, "t", bits[idx], idx) + dg.tensor_sum(key, "t", new[idx], idx)) & dg.MASK128
    assert moved == dg.tensor_sum(key, "t", new)


def test_confined_accepts_only_paths_under_the_root(tmp_path, monkeypatch):
    """The extension's file-path check, without a server: inside the root (links resolved)
    passes; outside, by path, by ``..`` or by a link, is refused with the same sentence whether
    the file exists or not; without STARLING_VLLM_ROOT every path is refused."""
    from starling_vllm import extension as ext

    root, outside = tmp_path / "store" / "vllm", tmp_path / "elsewhere"
    root.mkdir(parents=True)
    outside.mkdir()
    (root / "patch-1.safetensors").write_bytes(b"x")
    (outside / "secret").write_bytes(b"x")
    (root / "link").symlink_to(outside / "secret")
    monkeypatch.delenv(ext.ROOT_ENV, raising=False)
    with pytest.raises(ext.Refused, match="reads and writes no file paths"):
        ext.confined(str(root / "patch-1.safetensors"))
    monkeypatch.setenv(ext.ROOT_ENV, str(root))
    assert ext.confined(str(root / "patch-1.safetensors")) == os.path.realpath(root / "patch-1.safetensors")
    assert ext.confined(str(root / "not-yet.safetensors")) == os.path.realpath(root / "not-yet.safetensors")
    # A sibling whose name starts with the root's is outside too.
    (tmp_path / "store" / "vllm2").mkdir()
    for p in [outside / "secret", outside / "absent", root / "link", root / ".." / ".." / "elsewhere" / "secret",
              tmp_path / "store" / "vllm2" / "x", "/etc/hostname"]:
        with pytest.raises(ext.Refused, match="is outside"):
            ext.confined(str(p))
