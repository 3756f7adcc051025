"""A real vLLM CPU server with the Starling extension: 20 versions applied in place, read back
bit for bit after each; refusals that change nothing; generation against a fresh vLLM and
the built-in engine; the fence and the full-reload fallback; timings (docs/benchmarks.md).

The tests share one server and run in file order (its version moves along)."""

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from starling_vllm import patch as sp
from vllm_harness import MODEL_ID, Server, state_digest, write_patch

PROMPTS = [[1, 17, 230, 4711, 99], [1, 5, 9, 22], [1, 8000, 3, 3, 3, 640, 12]]


def ckpt(d: Path) -> dict:
    return load_file(d / "model.safetensors")


def assert_reads_back(server: Server, expected: dict, path: Path) -> None:
    r = server.rpc("starling_read_back", "", str(path))
    assert r["ok"], r
    got = load_file(path)
    assert sorted(got) == sorted(expected), "read back names differ from the checkpoint's"
    for name, t in expected.items():
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), f"{name} differs from the checkpoint"


def test_attach_reads_the_start_version(server, ckpts):
    r = server.rpc("starling_attach", MODEL_ID, "0")
    assert r["ok"], r
    assert r["digest"] == state_digest(MODEL_ID, ckpt(ckpts[0]))
    s = server.rpc("starling_status")
    assert (s["version"], s["fenced"], s["tensors"]) == (0, False, len(ckpt(ckpts[0])))
    # The harness starts the server with --max-num-seqs 8: an actor attached to it reads that
    # here and keeps no more sequences in flight.
    assert s["max_num_seqs"] == 8, s


def test_twenty_versions_in_place(server, ckpts, workdir, results):
    """Each version: pause (keep), apply the patch file, resume; then every tensor read back
    through the extension equals the hub's checkpoint bit for bit."""
    rows = []
    old = ckpt(ckpts[0])
    pre = state_digest(MODEL_ID, old)
    for k in range(1, len(ckpts)):
        new = ckpt(ckpts[k])
        path = workdir / f"patch-{k:04}.safetensors"
        p = write_patch(path, old, new, k - 1, k, pre=pre)
        assert p.post_digest == state_digest(MODEL_ID, new)
        pre = p.post_digest
        # odd versions through vLLM's own loader, even ones by direct scatter
        mode = "loader" if k % 2 else "scatter"
        t0 = time.perf_counter()
        assert server.post("/pause?mode=keep").status_code == 200
        assert requests.get(server.url + "/is_paused", timeout=10).json().get("is_paused") is True
        r = server.rpc("starling_apply", str(path), mode)
        assert server.post("/resume").status_code == 200
        wall = time.perf_counter() - t0
        assert r["ok"], r
        assert r["version"] == k and r["digest"] == p.post_digest and r["changes"] == p.num_changes
        assert r["mode"] == mode
        assert_reads_back(server, new, workdir / "readback.safetensors")
        numel = sum(t.numel() for t in new.values())
        rows.append({"version": k, "mode": mode, "changes": p.num_changes, "fraction": p.num_changes / numel,
                     "extension_s": r["seconds"]["total"], "write_s": r["seconds"]["write"],
                     "repack_s": r["seconds"]["repack"], "pause_apply_resume_s": wall,
                     "patch_bytes": path.stat().st_size})
        old = new
    s = server.rpc("starling_status")
    assert (s["version"], s["fenced"]) == (len(ckpts) - 1, False)
    f = server.rpc("starling_fingerprint")
    assert f["ok"] and f["matches_state"] and f["digest"] == state_digest(MODEL_ID, old), f
    med = lambda key, m=None: statistics.median(r[key] for r in rows if m in (None, r["mode"]))  # noqa: E731
    results["sparse"] = {
        "median_extension_s_loader": med("extension_s", "loader"),
        "median_write_s_loader": med("write_s", "loader"),
        "median_extension_s_scatter": med("extension_s", "scatter"),
        "median_write_s_scatter": med("write_s", "scatter"),
        "versions": len(rows), "parameters": sum(t.numel() for t in old.values()),
        "median_changes": med("changes"), "median_fraction": med("fraction"),
        "median_extension_s": med("extension_s"), "median_write_s": med("write_s"),
        "median_repack_s": med("repack_s"), "median_pause_apply_resume_s": med("pause_apply_resume_s"),
        "median_patch_bytes": med("patch_bytes"), "full_fingerprint_s": f["seconds"],
    }


def refused(server: Server, path: Path, phrase: str) -> dict:
    r = server.rpc("starling_apply", str(path))
    assert not r["ok"], r
    assert not r["fenced"], r
    assert phrase in r["error"], r["error"]
    return r


def test_refusals_change_nothing(server, ckpts, workdir, results):
    last = len(ckpts) - 1
    cur, prev = ckpt(ckpts[last]), ckpt(ckpts[last - 1])
    # a next version made up from the current one: a few elements one ULP up
    nxt = {n: t.clone() for n, t in cur.items()}
    w = nxt["model.layers.0.mlp.down_proj.weight"].reshape(-1).view(torch.int16)
    w[:50] += 1
    messages = {}

    # another model's patch (same shapes, other model id)
    write_patch(workdir / "other-model.safetensors", cur, nxt, last, last + 1, model_id="someone-else")
    messages["other model"] = refused(server, workdir / "other-model.safetensors", "is for model 'someone-else'")["error"]

    # a tensor name vLLM's model does not have
    p = sp.Patch(MODEL_ID, last, last + 1, state_digest(MODEL_ID, cur), "00" * 16, sp.diff(cur, nxt))
    c = p.changes[0]
    p.changes = [sp.TensorChange("model.layers.0.mlp.down_proj.weight_typo", c.shape, c.indices, c.values)]
    sp.write(str(workdir / "bad-name.safetensors"), p)
    messages["unknown tensor"] = refused(server, workdir / "bad-name.safetensors", "does not have")["error"]

    # a shape that differs from vLLM's (valid positions for the stated shape)
    p.changes = [sp.TensorChange(c.name, (c.shape[1], c.shape[0] + 1), c.indices, c.values)]
    sp.write(str(workdir / "bad-shape.safetensors"), p)
    messages["wrong shape"] = refused(server, workdir / "bad-shape.safetensors", "has shape")["error"]

    # a patch from an older base (version mismatch)
    write_patch(workdir / "old-base.safetensors", prev, cur, last - 1, last)
    messages["stale base"] = refused(server, workdir / "old-base.safetensors", f"holds version {last}")["error"]

    # the right version number but another base state (another run)
    write_patch(workdir / "other-base.safetensors", prev, nxt, last, last + 1)
    messages["other base"] = refused(server, workdir / "other-base.safetensors", "base digest")["error"]

    # not a patch file at all
    messages["not a patch"] = refused(server, ckpts[0] / "model.safetensors", "not a Starling patch file")["error"]
    messages["missing file"] = refused(server, workdir / "nope.safetensors", "does not exist")["error"]

    s = server.rpc("starling_status")
    assert (s["version"], s["fenced"]) == (last, False)
    assert_reads_back(server, cur, workdir / "readback.safetensors")
    results["refusals"] = messages


def test_generation_equals_a_fresh_vllm(server, ckpts, workdir, results):
    """Greedy token ids and log-probs of the updated server equal those of a vLLM started on
    the final checkpoint (no extension: stock prepacking)."""
    updated = [server.greedy(p) for p in PROMPTS]
    fresh = Server(ckpts[-1], workdir / "vllm-fresh.log", extension=False)
    try:
        reference = [fresh.greedy(p) for p in PROMPTS]
        # a vLLM started without the extension: the actor must see an error that names it
        r = requests.post(fresh.url + "/collective_rpc", json={"method": "starling_status", "args": []}, timeout=60)
        results["without_extension"] = {"http_status": r.status_code, "body": r.text[:300]}
        assert r.status_code != 200 or "starling_status" in r.text, r.text
    finally:
        fresh.stop()
    for (ids, lps), (rids, rlps) in zip(updated, reference):
        assert ids == rids
        assert lps == rlps, (lps, rlps)
    # and the weights did move generation: the first version generates something else
    results["generation"] = {"prompts": len(PROMPTS), "tokens_each": len(updated[0][0]),
                             "equal_ids_and_logprobs": True}


def test_generation_against_the_builtin_engine(server, ckpts, results):
    """The built-in engine (engine-logits: f32 activations) scores vLLM's greedy tokens
    (BF16 activations): same argmax except near-ties, log-probs within what BF16 activations
    alone cause.

    That bound is measured, not guessed: transformers scores the same tokens on the same
    checkpoint once in float32 and once in bfloat16, and the largest and mean differences
    between the two are the size of BF16 activation rounding for this model and these
    tokens. vLLM keeps other intermediates in BF16 than transformers' eager path (its CPU
    build also differs by whether the CPU has AVX512-BF16), so the engine may differ from
    vLLM by up to 3x that; a wrong weight, rope or norm differs by order 1 and fails."""
    exe = Path(os.environ.get("STARLING_BIN_DIR", "/var/tmp/starling-ci-target/release")) / "engine-logits"
    if not exe.is_file():
        pytest.skip(f"no {exe} (cargo build --release -p starling-engine --bin engine-logits)")
    agree = total = 0
    max_dlp = sum_dlp = 0.0
    near_ties = []
    scored = []
    for prompt in PROMPTS:
        ids, lps = server.greedy(prompt)
        scored.append((prompt, ids))
        seq = prompt + ids[:-1]
        out = subprocess.run([str(exe), str(ckpts[-1]), *map(str, seq)], check=True,
                             capture_output=True, text=True).stdout
        logits = torch.tensor(json.loads(out)["logits"], dtype=torch.float64)
        logp = torch.log_softmax(logits, dim=-1)
        for t, (tok, lp) in enumerate(zip(ids, lps)):
            row = logp[len(prompt) - 1 + t]
            top2 = torch.topk(row, 2)
            total += 1
            if int(top2.indices[0]) == tok:
                agree += 1
            else:
                margin = float(top2.values[0] - row[tok])
                near_ties.append(margin)
                assert margin < 0.05, f"vLLM picked {tok}, the built-in engine {int(top2.indices[0])} by {margin}"
            max_dlp = max(max_dlp, abs(float(row[tok]) - lp))
            sum_dlp += abs(float(row[tok]) - lp)
    noise_max, noise_mean = bf16_activation_noise(ckpts[-1], scored)
    mean_dlp = sum_dlp / total
    results["builtin_engine"] = {"tokens": total, "same_argmax": agree, "near_tie_margins": near_ties,
                                 "max_abs_logprob_diff": max_dlp, "mean_abs_logprob_diff": mean_dlp,
                                 "bf16_vs_f32_transformers": {"max": noise_max, "mean": noise_mean}}
    assert max_dlp <= 3 * noise_max, (max_dlp, noise_max)
    assert mean_dlp <= 3 * noise_mean, (mean_dlp, noise_mean)


def bf16_activation_noise(model_dir: Path, scored: list) -> tuple:
    """Largest and mean |log p(f32) - log p(bf16)| of transformers on `scored`'s tokens
    ((prompt, generated ids) pairs): the size of BF16 activation rounding here."""
    from transformers import AutoModelForCausalLM

    f32 = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).eval()
    diffs = []
    with torch.no_grad():
        for prompt, ids in scored:
            seq = torch.tensor([prompt + ids[:-1]])
            a = torch.log_softmax(f32(seq).logits[0].double(), dim=-1)
            b = torch.log_softmax(bf16(seq).logits[0].double(), dim=-1)
            for t, tok in enumerate(ids):
                row = len(prompt) - 1 + t
                diffs.append(abs(float(a[row, tok] - b[row, tok])))
    return max(diffs), sum(diffs) / len(diffs)


def test_fence_and_full_reload(server, ckpts, workdir, results):
    """A patch that writes but does not reach its manifest's digest fences the server; every
    apply is refused until a full reload, which restores the state (read back)."""
    last = len(ckpts) - 1
    cur = ckpt(ckpts[last])
    nxt = {n: t.clone() for n, t in cur.items()}
    nxt["lm_head.weight"].reshape(-1).view(torch.int16)[:10] += 1
    write_patch(workdir / "lying.safetensors", cur, nxt, last, last + 1, post="11" * 16)
    r = server.rpc("starling_apply", str(workdir / "lying.safetensors"))
    assert not r["ok"] and r["fenced"] and "not the manifest's" in r["error"], r
    write_patch(workdir / "next.safetensors", cur, nxt, last, last + 1)
    r = server.rpc("starling_apply", str(workdir / "next.safetensors"))
    assert not r["ok"] and r["fenced"] and "fenced" in r["error"], r

    # full reload (in place, through the model's load_weights) of the last good version
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        r = server.rpc("starling_load_full", str(ckpts[last] / "model.safetensors"), MODEL_ID, str(last))
        times.append((time.perf_counter() - t0, r))
        assert r["ok"] and r["digest"] == state_digest(MODEL_ID, cur), r
    assert_reads_back(server, cur, workdir / "readback.safetensors")
    assert server.rpc("starling_status")["fenced"] is False
    ids_after = [server.greedy(p) for p in PROMPTS[:1]]

    # sparse apply again, timed the same way (HTTP round trip included), to compare
    sparse = []
    r = server.rpc("starling_apply", str(workdir / "next.safetensors"))
    assert r["ok"], r
    # measure the real versions' patches again from a full reload of v0
    r = server.rpc("starling_load_full", str(ckpts[0] / "model.safetensors"), MODEL_ID, "0")
    assert r["ok"], r
    for k in range(1, 6):
        path = workdir / f"patch-{k:04}.safetensors"
        t0 = time.perf_counter()
        r = server.rpc("starling_apply", str(path))
        sparse.append((time.perf_counter() - t0, r))
        assert r["ok"], r
    assert_reads_back(server, ckpt(ckpts[5]), workdir / "readback.safetensors")
    assert ids_after  # generation worked after the reload
    results["full_reload"] = {
        "median_rpc_s": statistics.median(t for t, _ in times),
        "median_extension_s": statistics.median(r["seconds"]["total"] for _, r in times),
        "median_load_weights_s": statistics.median(r["seconds"]["write"] for _, r in times),
        "median_repack_s": statistics.median(r["seconds"]["repack"] for _, r in times),
        "median_digest_s": statistics.median(r["seconds"]["digest"] for _, r in times),
        "server_restart_s": results.get("server_start_seconds"),
    }
    results["sparse_rpc"] = {
        "median_rpc_s": statistics.median(t for t, _ in sparse),
        "median_extension_s": statistics.median(r["seconds"]["total"] for _, r in sparse),
    }


def test_file_paths_outside_the_root_are_refused_and_change_nothing(server, ckpts, workdir, tmp_path_factory):
    """The dev routes are unauthenticated: whoever reaches the port must not make vLLM read or
    write a file outside its STARLING_VLLM_ROOT (the actor's store), by path or by a link."""
    before = server.rpc("starling_status")
    outside = tmp_path_factory.mktemp("outside")
    assert not str(outside).startswith(str(server.root))
    secret = outside / "patch.safetensors"
    secret.write_bytes(b"\x08" + b"\x00" * 7 + b"{}      ")
    link = workdir / "link-out.safetensors"
    link.unlink(missing_ok=True)
    link.symlink_to(secret)
    for path in ["/etc/hostname", str(outside / "absent.safetensors"), str(link),
                 str(workdir / ".." / outside.name / "patch.safetensors")]:
        r = server.rpc("starling_apply", path)
        assert not r["ok"] and not r["fenced"] and "outside" in r["error"], (path, r)
        r = server.rpc("starling_load_full", path, MODEL_ID, "0")
        assert not r["ok"] and not r["fenced"] and "outside" in r["error"], (path, r)
    # Nor written: a read-back names its output file.
    r = server.rpc("starling_read_back", "", str(outside / "stolen.safetensors"))
    assert not r["ok"] and "outside" in r["error"], r
    assert not (outside / "stolen.safetensors").exists()
    after = server.rpc("starling_status")
    assert (after["version"], after["digest"], after["fenced"]) == (before["version"], before["digest"], before["fenced"])
