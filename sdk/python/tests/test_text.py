"""Chat messages in, decoded text out, and rewards scored in Python on the trainer's side
(``verifier="none"``): on the tiny generated model (byte tokenizer) and on the real
SmolLM2-135M-Instruct with its own tokenizer and chat template (imported by
scripts/fetch-model.sh; skipped, saying why, only where it cannot be fetched)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import start_cluster
from starling import Group, Sampling, StarlingError

REPO = Path(__file__).resolve().parents[3]


def last_number(text: str):
    """The trainer's own reward: the last number in the completion."""
    found = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return float(found[-1]) if found else None


def score(text: str, answer: float) -> float:
    got = last_number(text)
    return 1.0 if got is not None and abs(got - answer) < 1e-6 else 0.0


def test_text_is_the_decoded_completion_on_the_byte_tokenizer(cluster):
    hub = cluster.client()
    batch = hub.submit([Group(prompt="12+30=", n=3, verifier="none")],
                       sampling=Sampling(temperature=1.0, max_new_tokens=8, seed=5))
    (r,) = list(batch.results(wait_ms=2000, timeout=120))
    for s in r.samples:
        # The byte tokenizer: id = byte + 3, eos 2 (the default stop token) cut off.
        body = s.tokens[: s.tokens.index(2)] if 2 in s.tokens else s.tokens
        want = bytes(t - 3 for t in body if 3 <= t < 259).decode("utf-8", errors="replace")
        assert s.text == want, (s.tokens, s.text)
        assert s.reward == 0.0, "verifier none: the trainer scores"


def test_messages_need_a_chat_template(cluster):
    hub = cluster.client()
    with pytest.raises(StarlingError) as e:
        hub.submit([Group(messages=[{"role": "user", "content": "hi"}], n=1)])
    assert e.value.code == "invalid_batch" and "chat template" in e.value.message


@pytest.fixture(scope="module")
def real_model() -> Path:
    env = dict(os.environ)
    r = subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], capture_output=True, text=True, env=env)
    if r.returncode == 3:
        pytest.skip(f"the real model cannot be fetched here: {r.stderr.strip()}")
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def real_cluster(material, real_model, tmp_path_factory):
    c = start_cluster(material, tmp_path_factory.mktemp("real"), init=real_model)
    try:
        yield c
    finally:
        c.actor.stop()
        c.hub.stop()


def test_chat_groups_on_the_real_model_are_scored_in_python(real_cluster):
    hub = real_cluster.client()
    problems = [(12, 30), (7, 8)]
    groups = [Group(messages=[{"role": "user", "content": f"What is {a}+{b}? Answer with a number."}],
                    n=2, verifier="none") for a, b in problems]
    # Greedy, so both samples of a group agree; the stop token defaults to the model's EOS
    # (<|im_end|>, id 2).
    batch = hub.submit(groups, sampling=Sampling(temperature=0.0, max_new_tokens=16))
    results = {r.group: r for r in batch.results(wait_ms=2000, timeout=300)}
    assert sorted(results) == [0, 1]
    for g, r in results.items():
        a, b = problems[g]
        # The chat template's default system line, then the user turn, then the assistant's.
        assert r.prompt_ids[0] == 1 and len(r.prompt_ids) > 20, r.prompt_ids
        texts = {s.text for s in r.samples}
        assert len(texts) == 1, "greedy samples agree"
        for s in r.samples:
            assert s.text.strip(), s
            assert "<|im_end|>" not in s.text, "special tokens are skipped"
            if s.finish == "stop":
                assert s.tokens[-1] == 2
            rewards = score(s.text, a + b)
            assert rewards in (0.0, 1.0)
    # A role the template does not know is refused before anything is posted.
    with pytest.raises(StarlingError) as e:
        hub.submit([Group(messages=[{"role": "robot", "content": "beep"}], n=1)])
    assert e.value.code == "invalid_batch" and "robot" in e.value.message
