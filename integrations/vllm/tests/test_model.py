"""The real model, SmolLM2-135M-Instruct, imported from its GGUF by `starling model import`
(scripts/fetch-model.sh), against transformers and a real vLLM.

- the import equals transformers' own GGUF load cast to BF16, bit for bit, and its tokenizer
  encodes and decodes a corpus as transformers' GGUF tokenizer does;
- the directory loads unchanged in transformers; the built-in engine's logits on it are
  within float32's own error of transformers' (measured against float64);
- the hub's rendering and tokenization of chats equal `apply_chat_template(...,
  add_generation_prompt=True)` token for token;
- vLLM serves the same directory with its own tokenizer: its chat tokenization equals the
  hub's, and its greedy generations are compared with the built-in engine's token for token
  (where they part is measured and reported).

Skipped, with the reason printed, only where the wheel cannot be fetched (no PyPI).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import requests
import torch

from vllm_harness import Server, state_digest, write_patch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BIN = Path(os.environ.get("STARLING_BIN_DIR", "/var/tmp/starling-ci-target/release"))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATS = [
    [{"role": "user", "content": "What is 12+30?"}],
    [{"role": "system", "content": "You are a terse calculator."},
     {"role": "user", "content": "Tom has 12 apples and buys 30 more. How many apples?"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Traduis « naïve café » en 日本語 🚀, s'il te plaît."}],
    [{"role": "user", "content": ""}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  leading and trailing  \n\n"}],
]


@pytest.fixture(scope="module")
def model() -> tuple[Path, Path]:
    env = dict(os.environ, STARLING_BIN_DIR=str(BIN))
    r = subprocess.run([str(REPO / "scripts" / "fetch-model.sh")], capture_output=True, text=True, env=env)
    if r.returncode == 3:
        pytest.skip(f"the real model cannot be fetched here: {r.stderr.strip()}")
    assert r.returncode == 0, f"fetch-model.sh failed ({r.returncode}):\n{r.stderr}"
    d = Path(r.stdout.strip().splitlines()[-1])
    wheel_hash = d.name.split("-")[3]
    return d, d.parent / f"gguf-{wheel_hash}" / GGUF_NAME


def starling_run(model_dir: Path, reqs: list[dict]) -> list[dict]:
    """`starling model run`: the hub's rendering/tokenization and the engine's greedy decoding."""
    r = subprocess.run([str(BIN / "starling"), "model", "run", "--model", str(model_dir)],
                       input="".join(json.dumps(q) + "\n" for q in reqs), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def chat_ids(tok, messages) -> list[int]:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_import_equals_transformers_own_gguf_load(model, results):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, gguf = model
    t0 = time.time()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    want = {k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()}
    want.pop("lm_head.weight")  # tied: the embedding
    got = load_file(d / "model.safetensors")
    assert set(got) == set(want)
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and t.shape == want[name].shape, name
        assert torch.equal(t.view(torch.int16), want[name].view(torch.int16)), f"{name} differs"
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    for key in ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"]:
        assert config[key] == getattr(ref.config, key), key

    tg = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    to = AutoTokenizer.from_pretrained(d)
    corpus = [m["content"] for c in CHATS for m in c] + [
        "Hello world!", "12+30=42\n\n\tTabs  and   spaces", "don't won't I'll we've", "<|im_start|>user\nhi<|im_end|>",
        "ŁÓDŹ ß ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b zero-width", "def f(x):\n    return x**2  # comment", "😀😃😄😁" * 5,
    ]
    for text in corpus:
        ids = tg(text)["input_ids"]
        assert to(text)["input_ids"] == ids, text
        assert to.decode(ids, skip_special_tokens=True) == tg.decode(ids, skip_special_tokens=True), text
    results["model_import_check_seconds"] = round(time.time() - t0, 1)


def test_the_directory_runs_in_transformers_and_the_engine_logits_match(model, results):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, _ = model
    tok = AutoTokenizer.from_pretrained(d)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    seqs = [chat_ids(tok, CHATS[1]), tok("The capital of France is")["input_ids"]]
    worst = {"engine_vs_f32": 0.0, "engine_vs_f64": 0.0, "f32_vs_f64": 0.0}
    for ids in seqs:
        r = subprocess.run([str(BIN / "engine-logits"), str(d), *map(str, ids)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        got = torch.tensor(json.loads(r.stdout)["logits"], dtype=torch.float64)
        with torch.no_grad():
            f32 = m(torch.tensor([ids])).logits[0].double()
            f64 = m.double()(torch.tensor([ids])).logits[0]
            m.float()
        assert torch.equal(got.argmax(-1), f32.argmax(-1)), "greedy tokens differ"
        for k, v in [("engine_vs_f32", got - f32), ("engine_vs_f64", got - f64), ("f32_vs_f64", f32 - f64)]:
            worst[k] = max(worst[k], v.abs().max().item())
    results["logits_max_abs"] = {k: float(f"{v:.3g}") for k, v in worst.items()}
    # Within 1e-4 (max abs) of transformers' float32, and as close to the exact (float64)
    # logits as transformers' float32 is. SmolLM2's residual stream reaches ~25,000 (its
    # massive activations), so float32 itself is 0.6-1.3e-4 from float64 here
    # (docs/models.md): on longer prompts the 1e-4 between two float32 forwards is out of reach.
    assert worst["engine_vs_f32"] <= 1e-4, worst
    assert worst["engine_vs_f64"] <= max(1e-4, 1.5 * worst["f32_vs_f64"]), worst


def test_chat_rendering_and_tokenization_equal_apply_chat_template(model):
    from transformers import AutoTokenizer

    d, _ = model
    tok = AutoTokenizer.from_pretrained(d)
    answers = starling_run(d, [{"messages": c} for c in CHATS] + [{"text": "12+30="}])
    for chat, a in zip(CHATS, answers):
        assert "error" not in a, a
        assert a["prompt_text"] == tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert a["prompt_ids"] == chat_ids(tok, chat), chat
    assert answers[-1]["prompt_ids"] == tok("12+30=")["input_ids"]
    bad = starling_run(d, [{"messages": [{"role": "robot", "content": "beep"}]}])[0]
    assert "robot" in bad["error"] and "system, user, assistant" in bad["error"], bad


def test_add_bos_and_add_eos_token_tokenize_text_as_transformers(model, tmp_path, results):
    """`tokenizer_config.json`'s add_bos_token/add_eos_token set true and false in copies of
    the directory's text files: the hub's ids for text prompts and chats equal this venv's
    `tok(text)["input_ids"]` and `apply_chat_template` (text/src/lib.rs says why the flags
    change nothing on transformers 5 when tokenizer.json exists)."""
    from transformers import AutoTokenizer

    d, _ = model
    texts = ["12+30=", "The capital of France is", "", "Traduis « naïve café » en 日本語 🚀",
             "<|im_start|>user\nhi<|im_end|>\n"]
    base = json.loads((d / "tokenizer_config.json").read_text())
    variants = {"as imported": {}, "bos": {"add_bos_token": True},
                "eos": {"add_eos_token": True}, "bos+eos": {"add_bos_token": True, "add_eos_token": True},
                "neither": {"add_bos_token": False, "add_eos_token": False}}
    seen = {}
    for name, flags in variants.items():
        v = tmp_path / name.replace(" ", "-").replace("+", "-")
        v.mkdir()
        for f in ["tokenizer.json", "config.json", "generation_config.json", "special_tokens_map.json"]:
            if (d / f).exists():
                (v / f).write_bytes((d / f).read_bytes())
        (v / "tokenizer_config.json").write_text(json.dumps({**base, **flags}))
        tok = AutoTokenizer.from_pretrained(v)
        answers = starling_run(v, [{"text": t} for t in texts] + [{"messages": CHATS[1]}])
        for t, a in zip(texts, answers):
            assert "error" not in a, (name, a)
            assert a["prompt_ids"] == tok(t)["input_ids"], (name, t)
        assert answers[-1]["prompt_ids"] == chat_ids(tok, CHATS[1]), name
        seen[name] = [a["prompt_ids"] for a in answers]
    results["add_bos_eos_flags_change_text_ids"] = any(ids != seen["as imported"] for ids in seen.values())


def test_vllm_serves_the_imported_model_with_the_same_tokens(model, workdir, results):
    d, _ = model
    prompts = [{"messages": c} for c in CHATS[:4]] + [{"text": "The capital of France is"}]
    new = 24
    ours = starling_run(d, [dict(p, max_new_tokens=new) for p in prompts])
    s = Server(d, workdir / "vllm-real-model.log", extension=True, tokenizer=True,
               max_model_len=1024, max_num_seqs=64)
    try:
        served = requests.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for p, o in zip(prompts[:4], ours):
            r = requests.post(s.url + "/tokenize", json={"model": served, "messages": p["messages"],
                                                         "add_generation_prompt": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["tokens"] == o["prompt_ids"], p
        agree = []
        for o in ours:
            r = requests.post(s.url + "/v1/completions", json={
                "model": served, "prompt": o["prompt_ids"], "max_tokens": new, "temperature": 0.0,
                "logprobs": 1, "return_tokens_as_token_ids": True, "stop_token_ids": [2]}, timeout=300)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            theirs = [int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]]
            n = next((i for i, (a, b) in enumerate(zip(o["tokens"], theirs)) if a != b),
                     min(len(o["tokens"]), len(theirs)))
            agree.append({"engine": o["text"], "vllm": c["text"], "same_tokens": n,
                          "of": max(len(o["tokens"]), len(theirs))})
        results["greedy_engine_vs_vllm"] = agree
        # BF16 compute in vLLM against f32 in the engine: they may part at a near-tie; the
        # first token (the argmax of the prompt's last logits) must agree.
        assert all(a["same_tokens"] >= 1 for a in agree), agree

        # Throughput on this machine: 64 chat prompts, 32 new tokens each, temperature 1 (no
        # per-request seed: vLLM 0.32's CPU runner fails on seeded requests in a large batch,
        # "gen.set_offset(gen.get_offset() - 4)").
        chats = [[{"role": "user", "content": f"Tom has {12 + i} apples and buys {30 + i} more. "
                   "How many apples does he have? Answer with a number."}] for i in range(64)]
        ids = [o["prompt_ids"] for o in starling_run(d, [{"messages": c} for c in chats])]
        t0 = time.time()
        r = requests.post(s.url + "/v1/completions", json={
            "model": served, "prompt": ids, "max_tokens": 32, "temperature": 1.0,
            "ignore_eos": True}, timeout=600)
        assert r.status_code == 200, r.text
        wall = time.time() - t0
        tokens = r.json()["usage"]["completion_tokens"]
        results["vllm_real_model_tokens_per_s_batch64"] = round(tokens / wall, 1)

        # Weight updates in place on this Llama (tied embeddings, GQA): a 1% one-ULP step of
        # every tensor applied as a patch; the digest vLLM computes from its own parameters
        # afterwards must be the new weights'.
        from safetensors.torch import load_file

        old = load_file(d / "model.safetensors")
        r = s.rpc("starling_attach", "smollm2", "0")
        assert r["ok"] and r["digest"] == state_digest("smollm2", old), r
        g = torch.Generator().manual_seed(0)
        new = {}
        for name, t in old.items():
            flat = t.reshape(-1).view(torch.int16).clone()
            pick = torch.rand(flat.numel(), generator=g) < 0.01
            flat[pick] += 1
            new[name] = flat.view(torch.bfloat16).reshape(t.shape)
        p = write_patch(workdir / "smollm2-patch.safetensors", old, new, 0, 1, model_id="smollm2",
                        pre=r["digest"])
        assert s.post("/pause?mode=wait").status_code == 200
        r = s.rpc("starling_apply", str(workdir / "smollm2-patch.safetensors"))
        assert s.post("/resume").status_code == 200
        assert r["ok"] and r["version"] == 1, r
        assert r["digest"] == p.post_digest == state_digest("smollm2", new), r
        results["vllm_real_model_patch"] = {"changes": p.num_changes, "seconds": r["seconds"]["total"]}
    finally:
        s.stop()
