"""examples/grpo_torch.py against a real cluster, and its PyTorch model against the actors'
log-probabilities (and against HF transformers, where installed)."""

from __future__ import annotations

import math

import pytest

from conftest import EXAMPLES, HAVE_TORCH, SRC, needs_torch

pytestmark = [
    needs_torch,
    pytest.mark.skipif(not (EXAMPLES / "grpo_torch.py").is_file(), reason=f"{EXAMPLES}/grpo_torch.py not found"),
]

if HAVE_TORCH:
    import torch

# Logprob agreement between the Rust engine and this PyTorch model, both FP32 compute on BF16
# weights. Measured ~1e-6 on the tiny model; the bound leaves room for other CPUs' kernels.
LOGPROB_TOL = 1e-3


def test_grpo_two_steps_and_logprob_agreement(fresh_cluster, tmp_path):
    import grpo_torch

    c = fresh_cluster
    hub = c.client()
    assert hub.latest_version() == 0
    ckpt_dir = tmp_path / "ckpt"
    temperature = 0.7
    out = grpo_torch.main(
        [
            "--hub", c.url,
            "--credentials", str(c.material.trainer_creds),
            "--init", str(c.material.init),
            "--checkpoint-dir", str(ckpt_dir),
            "--steps", "2",
            "--groups", "4",
            "-n", "4",
            "--max-new-tokens", "12",
            "--temperature", str(temperature),
            "--report", str(tmp_path / "report.json"),
        ]
    )
    hist = out["history"]
    assert [h["published"] for h in hist] == [1, 2], "two new versions"
    assert hub.latest_version() == 2
    assert math.isfinite(hist[0]["loss"]) and math.isfinite(hist[1]["loss"])
    assert [h["batch_version"] for h in hist] == [0, 1]
    assert (tmp_path / "report.json").is_file()
    listed = {v.version: v for v in hub.versions()}
    for h in hist:
        assert listed[h["published"]].digest == h["published_digest"]
        assert listed[h["published"]].step == h["step"] + 1
        assert c.actor_digest(h["published"]) == h["published_digest"], "the actor holds the published bits"

    # Recompute the behaviour log-probabilities of the example's rollouts with the PyTorch model
    # on the weights of the version each token is tagged with.
    weights = {0: str(c.material.init)}
    for h in hist:
        weights[h["published"]] = str(ckpt_dir / f"step-{h['step'] + 1:08d}.safetensors")
    config = str(c.material.ckpt / "config.json")
    models = {}

    def model(version):
        if version not in models:
            m = grpo_torch.Qwen3.from_checkpoint(weights[version], config)
            m.eval()
            models[version] = m
        return models[version]

    worst, compared = 0.0, 0
    for h in hist:
        rollouts = list(hub.batch(h["batch"]).results(wait_ms=0))
        assert len(rollouts) == 4
        for r in rollouts[:2]:
            for s in r.samples:
                assert s.versions
                for span in s.versions:
                    with torch.no_grad():
                        context = r.prompt_ids + s.tokens[: span.start]
                        (lp,) = grpo_torch.completion_logprobs(
                            model(span.version), [(context, s.tokens[span.start : span.end])], temperature
                        )
                    want = torch.tensor(s.logprobs[span.start : span.end])
                    d = float((lp - want).abs().max())
                    worst = max(worst, d)
                    compared += span.end - span.start
    print(f"logprobs: {compared} tokens compared, max |PyTorch - actor| = {worst:.3e}")
    assert compared > 0
    assert worst < LOGPROB_TOL, f"max logprob difference {worst:.3e} over {LOGPROB_TOL}"


def test_model_matches_transformers(material):
    transformers = pytest.importorskip("transformers", reason="transformers not installed (optional cross-check)")
    import grpo_torch

    m = grpo_torch.Qwen3.from_checkpoint(str(material.step1), str(material.ckpt / "config.json"))
    m.eval()
    cfg = transformers.AutoConfig.from_pretrained(str(material.ckpt))
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    hf.load_state_dict(m.state_dict(), strict=True)
    hf.eval()
    ids = torch.randint(3, cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        d = float((m(ids) - hf(ids).logits.float()).abs().max())
    print(f"max |logits - transformers| = {d:.3e}")
    assert d < 1e-4


def test_example_cli_help():
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / "grpo_torch.py"), "--help"], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr
    assert "--checkpoint-dir" in r.stdout
