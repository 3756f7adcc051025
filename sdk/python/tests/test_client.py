"""The SDK against a real hub and a real actor (built-in engine): publishing, batches, results,
cancelling, and every error path."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from conftest import needs_torch
from starling import Client, Group, Rollout, Sampling, StarlingError, Version, load_torch, read_raw

SAMPLING = {"temperature": 1.0, "max_new_tokens": 8, "stop_token_ids": [2], "seed": 7}


def bf16_bytes(t) -> bytes:
    """The little-endian bytes of ``t.to(torch.bfloat16)`` (without numpy, which torch does not need)."""
    import torch

    bits = t.to(torch.bfloat16).contiguous().view(torch.int16).flatten().tolist()
    return struct.pack(f"<{len(bits)}h", *bits)


def perturbed_state_dict(path, seed=0):
    """The checkpoint at ``path`` in FP32 with a few tensors nudged (like an optimizer step)."""
    import torch

    sd = {k: v.float() for k, v in load_torch(str(path)).items()}
    g = torch.Generator().manual_seed(seed)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"):
        sd[name] = sd[name] + 1e-2 * torch.randn(sd[name].shape, generator=g)
    return sd


# --------------------------------------------------------------------------------------------
# Versions


def test_versions_are_open_and_typed(cluster):
    vs = Client(cluster.url).versions()  # no token: GET /v1/versions is open
    assert vs, "the initial version is listed"
    v0 = [v for v in vs if v.version == 0][0]
    assert isinstance(v0, Version)
    assert v0.base is None and len(v0.digest) == 32
    assert v0.digest == cluster.actor_digest(0)


@needs_torch
def test_publish_state_dict_reaches_the_actor_bit_identical(cluster, tmp_path):
    hub = cluster.client()
    before = hub.latest_version()
    sd = perturbed_state_dict(cluster.material.step1)
    v = hub.publish(sd, step=11, directory=tmp_path)
    assert v.version == before + 1
    assert v.base == before and v.step == 11
    assert v.changes > 0 and v.bytes > 0
    # What the hub lists is what it answered.
    listed = {x.version: x for x in hub.versions()}
    assert listed[v.version].digest == v.digest and listed[v.version].step == 11
    assert hub.latest_version() == v.version
    # The file it read is the state dict cast by PyTorch.
    path = tmp_path / "step-00000011.safetensors"
    raw = read_raw(str(path))
    assert list(raw) == list(sd)
    for name, t in sd.items():
        assert raw[name].data == bf16_bytes(t), name
    # The actor applied the delta and holds exactly those weights: its digest is the hub's.
    assert cluster.actor_digest(v.version) == v.digest


@needs_torch
def test_a_handed_over_checkpoint_is_taken_and_a_refused_one_given_back(cluster, tmp_path):
    import shutil

    hub = cluster.client()
    before = hub.latest_version()
    sd = perturbed_state_dict(cluster.material.step1)
    # keep=False hands the file over: the hub renames it into its store (same file system).
    v = hub.publish(sd, step=13, directory=tmp_path / "given", keep=False, allow=["unchanged"])
    assert v.version == before + 1 and v.handed_over is True
    assert not any((tmp_path / "given").iterdir()), "the hub took the file"
    assert cluster.actor_digest(v.version) == v.digest
    # A path handed over and refused (identical to the latest version) is given back whole.
    again = tmp_path / "again.safetensors"
    shutil.copy(cluster.material.init, again)
    first = hub.publish(again, handover=True, allow=["unchanged"])
    assert first.handed_over is True and not again.exists()
    shutil.copy(cluster.material.init, again)
    data = again.read_bytes()
    with pytest.raises(StarlingError) as e:
        hub.publish(again, handover=True)
    assert e.value.code == "unchanged", repr(e.value)
    assert again.read_bytes() == data, "the refused file is back where it was"
    # A file with another hard link is copied, not taken.
    twin = tmp_path / "twin.safetensors"
    os.link(again, twin)
    v3 = hub.publish(again, handover=True, allow=["unchanged"])
    assert v3.handed_over is False and again.exists() and twin.exists()
    assert hub.latest_version() == v3.version


@needs_torch
def test_publish_path_and_relative_path(cluster, tmp_path, monkeypatch):
    hub = cluster.client()
    before = hub.latest_version()
    v = hub.publish(cluster.material.step1, step=12)
    assert v.version == before + 1 and v.step == 12
    assert cluster.actor_digest(v.version) == v.digest
    # A relative path is made absolute on the client's side.
    import shutil

    shutil.copy(cluster.material.init, tmp_path / "again.safetensors")
    monkeypatch.chdir(tmp_path)
    v2 = hub.publish("again.safetensors")
    assert v2.version == v.version + 1 and v2.step is None
    assert cluster.actor_digest(v2.version) == v2.digest


@needs_torch
def test_publish_layout_mismatch_is_refused_by_the_hub(cluster, tmp_path):
    import torch

    hub = cluster.client()
    before = hub.latest_version()
    sd = perturbed_state_dict(cluster.material.step1)
    renamed = dict(sd)
    renamed["model.norm.weight_renamed"] = renamed.pop("model.norm.weight")
    reshaped = dict(sd)
    reshaped["model.norm.weight"] = torch.ones(sd["model.norm.weight"].shape[0] + 1)
    missing = dict(sd)
    del missing["lm_head.weight"]
    extra = dict(sd)
    extra["model.extra.weight"] = torch.ones(3)
    codes = {}
    for what, bad in (("renamed", renamed), ("reshaped", reshaped), ("missing", missing), ("extra", extra)):
        with pytest.raises(StarlingError) as e:
            hub.publish(bad, directory=tmp_path / what)
        codes[what] = (e.value.code, e.value.status, e.value.message)
        assert e.value.code != "internal", f"{what}: the hub calls a bad checkpoint its own failure: {e.value!r}"
        assert e.value.code == "layout_mismatch" and e.value.status == 409, f"{what}: {e.value!r}"
        assert not any((tmp_path / what).iterdir()), f"{what}: the refused checkpoint is left behind"
        if what in ("renamed", "reshaped"):
            assert "model.norm.weight" in e.value.message, f"{what}: the reason names no tensor: {e.value!r}"
    print("layout refusals:", codes)
    assert hub.latest_version() == before, "nothing was published"


@needs_torch
def test_integer_tensor_is_refused_before_anything_is_written_or_sent(cluster, tmp_path):
    import torch

    hub = cluster.client()
    before = hub.latest_version()
    sd = perturbed_state_dict(cluster.material.step1)
    sd["model.layers.1.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].to(torch.int32)
    d = tmp_path / "ckpt"
    with pytest.raises(StarlingError) as e:
        hub.publish(sd, step=3, directory=d)
    assert e.value.code == "invalid_state_dict" and e.value.status is None
    assert "model.layers.1.mlp.up_proj.weight" in e.value.message
    assert not d.exists() or os.listdir(d) == [], "nothing was written"
    assert hub.latest_version() == before, "nothing was published"
    # Without a directory the SDK says so, also before writing anything.
    with pytest.raises(StarlingError) as e:
        Client(cluster.url, token=cluster.token).publish(perturbed_state_dict(cluster.material.step1))
    assert e.value.code == "no_checkpoint_dir"


def test_publish_non_tensor_values_are_refused(cluster, tmp_path):
    # Also without torch installed: the SDK refuses before writing or sending anything.
    hub = cluster.client()
    before = hub.latest_version()
    for bad in ({"w": [1.0, 2.0]}, {}):
        with pytest.raises(StarlingError) as e:
            hub.publish(bad, directory=tmp_path / "d")
        assert e.value.code == "invalid_state_dict", repr(e.value)
    assert not (tmp_path / "d").exists()
    assert hub.latest_version() == before


def test_publish_unreadable_path(cluster, tmp_path):
    hub = cluster.client()
    with pytest.raises(StarlingError) as e:
        hub.publish(tmp_path / "nothing-here.safetensors")
    assert (e.value.code, e.value.status) == ("unreadable_checkpoint", 422)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(StarlingError) as e:
        hub.publish(junk)
    assert (e.value.code, e.value.status) == ("unreadable_checkpoint", 422)


# --------------------------------------------------------------------------------------------
# Batches


def check_rollout(r: Rollout, n: int, batch_id: int, max_new_tokens: int) -> None:
    assert r.batch == batch_id
    assert r.prompt_ids, "the prompt's token ids are reported"
    assert len(r.samples) == n
    for s in r.samples:
        assert 1 <= len(s.tokens) <= max_new_tokens
        assert len(s.logprobs) == len(s.tokens)
        assert all(lp <= 0.0 for lp in s.logprobs)
        assert s.finish in ("stop", "length"), s.finish
        if s.finish == "stop":
            assert s.tokens[-1] == 2
        # The version spans cover the tokens exactly, in order, without gaps.
        assert s.versions, "every sample says which version produced it"
        assert s.versions[0].start == 0 and s.versions[-1].end == len(s.tokens)
        for a, b in zip(s.versions, s.versions[1:], strict=False):  # consecutive pairs
            assert a.end == b.start
        assert all(sp.version >= r.version - 1 for sp in s.versions)
        assert s.reward in (0.0, 1.0)


def test_submit_and_stream_results(cluster):
    hub = cluster.client()
    groups = [
        {"prompt": "12+30=", "n": 4, "verifier": "numeric", "answer": "42"},
        {"prompt": "1+1=", "n": 3, "verifier": "exact_match", "answer": "2"},
        {"prompt_ids": [1, 52, 53], "n": 2, "verifier": "none", "sampling": {"max_new_tokens": 4}},
    ]
    batch = hub.submit(groups, sampling=SAMPLING)
    assert batch.version == hub.latest_version()
    assert batch.groups == 3 and batch.samples == 9
    seen = {}
    for r in batch.results(wait_ms=2000, timeout=120):
        assert r.group not in seen, "each accepted group exactly once"
        seen[r.group] = r
    assert sorted(seen) == [0, 1, 2]
    for g, r in seen.items():
        check_rollout(r, groups[g]["n"], batch.id, 4 if g == 2 else SAMPLING["max_new_tokens"])
    assert seen[2].prompt_ids == [1, 52, 53]
    assert seen[0].prompt_ids == [b + 3 for b in b"12+30="], "byte tokenizer: id = byte + 3"
    cursors = sorted(r.cursor for r in seen.values())
    assert batch.cursor == cursors[-1]

    st = batch.status()
    assert st.state == "done" and st.finished
    assert st.groups.total == 3 and st.groups.done == 3
    assert st.batch == batch.id and st.version == batch.version
    assert st.refused["stale"] == 0 and "invalid_result" in st.refused, st.refused
    assert st.refused["nonfinite_logprob"] == 0 and st.refused["result_too_large"] == 0, st.refused
    assert st.failures == {"attempts": 0, "reward_service": 0, "result_too_large": 0, "cancelled": 0}, st.failures
    assert st.groups.scoring == 0 and st.archived is None

    # Resumable: after the first cursor, exactly the rest; after the last, nothing.
    rest = list(batch.results(after=cursors[0], wait_ms=0))
    assert [r.cursor for r in rest] == cursors[1:]
    assert list(batch.results(after=cursors[-1], wait_ms=0)) == []
    # From another handle (e.g. another process).
    again = hub.batch(batch.id)
    assert sorted(r.group for r in again.results(wait_ms=0)) == [0, 1, 2]


def test_typed_groups_and_greedy_determinism(cluster):
    hub = cluster.client()
    greedy = Sampling(temperature=0.0, max_new_tokens=6, stop_token_ids=[2])
    groups = [
        Group(prompt="7+8=", n=2, verifier="numeric", answer="15"),
        Group(prompt="7+8=", n=1, verifier="numeric", answer="15"),
        Group(prompt="7+8=", n=2, verifier="numeric", answer="15", sampling=Sampling(temperature=1.0, seed=3)),
    ]
    batch = hub.submit(groups, sampling=greedy, max_staleness=1)
    rs = {r.group: r for r in batch.results(wait_ms=2000, timeout=120)}
    assert sorted(rs) == [0, 1, 2]
    for g, r in rs.items():
        check_rollout(r, groups[g].n, batch.id, 6)
    # Greedy decoding on the same weights: the same tokens every time (unless a publish landed
    # in between, which this module does not do concurrently).
    toks = [tuple(s.tokens) for g in (0, 1) for s in rs[g].samples]
    if len({(sp.version,) for g in (0, 1) for s in rs[g].samples for sp in s.versions}) == 1:
        assert len(set(toks)) == 1, toks


def test_cancel(cluster):
    hub = cluster.client()
    groups = [{"prompt": f"{i}+{i}=", "n": 8, "verifier": "numeric", "answer": str(2 * i)} for i in range(200)]
    batch = hub.submit(groups, sampling={"temperature": 1.0, "max_new_tokens": 256, "stop_token_ids": []})
    cancelled = batch.cancel()
    assert 0 < cancelled <= 200
    st = batch.status()
    assert st.state == "cancelled" and st.finished
    # The results stream ends: what was accepted before the cancel, then done.
    got = list(batch.results(wait_ms=1000, timeout=60))
    assert len(got) + cancelled <= 200
    assert len({r.group for r in got}) == len(got)
    # The groups that yielded nothing are counted, and a strict reader is told.
    assert batch.failures == {"cancelled": cancelled}, batch.failures
    with pytest.raises(StarlingError) as e:
        list(batch.results(after=0, wait_ms=1000, timeout=60, strict=True))
    assert e.value.code == "groups_failed" and f"{cancelled} cancelled" in str(e.value), e.value
    with pytest.raises(StarlingError) as e:
        batch.cancel()
    print("cancelling a cancelled batch:", repr(e.value))
    assert e.value.code == "batch_finished" and e.value.status == 409


# --------------------------------------------------------------------------------------------
# Errors


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_unreachable_hub():
    url = f"http://127.0.0.1:{free_port()}"
    c = Client(url, token="trainer.t1.00", timeout=5)
    for call in (c.versions, lambda: c.submit([{"prompt": "a", "n": 1, "verifier": "none"}])):
        with pytest.raises(StarlingError) as e:
            call()
        assert e.value.code == "unreachable" and e.value.status is None
        assert url in e.value.message


def test_bad_and_missing_token(cluster, tmp_path):
    for c in (Client(cluster.url, token="trainer.t1." + "0" * 64), Client(cluster.url)):
        for call in (
            lambda c=c: c.publish(cluster.material.step1),
            lambda c=c: c.submit([{"prompt": "a", "n": 1, "verifier": "none"}]),
            lambda c=c: c.batch_status(1),
            lambda c=c: c.results_page(1),
            lambda c=c: c.cancel(1),
        ):
            with pytest.raises(StarlingError) as e:
                call()
            assert (e.value.code, e.value.status) == ("unauthorized", 401), repr(e.value)
    # A credentials directory without a token.
    with pytest.raises(StarlingError) as e:
        Client(cluster.url, credentials=tmp_path)
    assert e.value.code == "bad_credentials"
    with pytest.raises(ValueError):
        Client(cluster.url, token="x", credentials=tmp_path)


@pytest.mark.parametrize(
    "body, code, status",
    [
        ({"groups": []}, "invalid_batch", 400),
        ({"groups": [{"prompt": "a", "n": 0, "verifier": "numeric", "answer": "1"}]}, "invalid_batch", 400),
        ({"groups": [{"prompt": "", "n": 1, "verifier": "numeric", "answer": "1"}]}, "invalid_batch", 400),
        ({"groups": [{"prompt": "a", "prompt_ids": [5], "n": 1, "verifier": "none"}]}, "invalid_batch", 400),
        ({"groups": [{"prompt_ids": [100000], "n": 1, "verifier": "none"}]}, "invalid_batch", 400),
        ({"groups": [{"prompt": "a", "n": 1, "verifier": "none"}], "sampling": {"top_p": 0.0}}, "invalid_batch", 400),
        ({"groups": [{"prompt": "a", "n": 1, "verifier": "none"}], "sampling": {"temperature": -1.0}}, "invalid_batch", 400),
        ({"groups": [{"prompt": "a", "n": 1, "verifier": "regex", "answer": "1"}]}, "unknown_verifier", 400),
        # A verifier that compares needs an answer it can read.
        ({"groups": [{"prompt": "a", "n": 1, "verifier": "numeric"}]}, "invalid_batch", 400),
        ({"groups": [{"prompt": "a", "n": 1, "verifier": "math", "answer": "many"}]}, "invalid_batch", 400),
        # A group no job-protocol message could carry back.
        ({"groups": [{"prompt": "a", "n": 1024, "verifier": "none", "sampling": {"max_new_tokens": 2000}}]}, "too_large", 413),
        # Above the job protocol's cap of 65536 new tokens (proto::rollout::MAX_NEW_TOKENS), which
        # the hub checks before the context: invalid_batch, not prompt_too_long.
        ({"groups": [{"prompt": "a", "n": 1, "verifier": "none"}], "sampling": {"max_new_tokens": 100000}}, "invalid_batch", 400),
        # 1 prompt token + 2048 > the tiny model's context of 2048 (see the boundary test below).
        ({"groups": [{"prompt": "a", "n": 1, "verifier": "none"}], "sampling": {"max_new_tokens": 2048}}, "prompt_too_long", 400),
        # The same through a group's own sampling: 2 + 2047 > 2048.
        (
            {"groups": [{"prompt": "ab", "n": 1, "verifier": "none", "sampling": {"max_new_tokens": 2047}}]},
            "prompt_too_long",
            400,
        ),
        ({"groups": [{"prompt": "a", "n": 1, "verifier": "none"}], "version": 10**9}, "unknown_version", 409),
        ({"groups": [{"prompt": "a", "n": 1, "verifier": "none", "colour": "red"}]}, "bad_request", 400),
    ],
)
def test_invalid_batches(cluster, body, code, status):
    hub = cluster.client()
    kw = {k: v for k, v in body.items() if k != "groups"}
    with pytest.raises(StarlingError) as e:
        hub.submit(body["groups"], **kw)
    assert (e.value.code, e.value.status) == (code, status), repr(e.value)
    assert e.value.message


def test_prompt_plus_new_tokens_up_to_the_context_is_accepted(cluster):
    import json

    context = json.loads((cluster.material.ckpt / "config.json").read_text())["max_position_embeddings"]
    assert context == 2048, "test_invalid_batches assumes the tiny model's context of 2048"
    hub = cluster.client()
    batch = hub.submit([{"prompt": "a", "n": 1, "verifier": "none"}], sampling={"max_new_tokens": context - 1})
    assert batch.groups == 1
    try:
        batch.cancel()
    except StarlingError as e:  # the actor may already have finished it
        assert e.code == "batch_finished", repr(e)


def test_bad_arguments_are_value_errors(cluster, tmp_path):
    hub = cluster.client()
    for step in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError):
            hub.publish(cluster.material.step1, step=step)
    with pytest.raises(ValueError):
        hub.publish({"w": object()}, name="../escape.safetensors", directory=tmp_path)
    assert os.listdir(tmp_path) == []


def test_unknown_batch(cluster):
    hub = cluster.client()
    for call in (lambda: hub.batch_status(10**9), lambda: hub.results_page(10**9), lambda: hub.cancel(10**9)):
        with pytest.raises(StarlingError) as e:
            call()
        assert (e.value.code, e.value.status) == ("not_found", 404), repr(e.value)
