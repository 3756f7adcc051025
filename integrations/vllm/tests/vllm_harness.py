"""What the tests share: checkpoints, patch files made from them, a vLLM server process."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch
from safetensors.torch import load_file, save_file

from starling_vllm import digest as dg
from starling_vllm import patch as sp

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
MODEL_ID = "starling-small"
EXTENSION = "starling_vllm.extension.StarlingWorkerExtension"


def state_digest(model_id: str, tensors: dict[str, torch.Tensor]) -> str:
    key = dg.DigestKey(model_id)
    total = 0
    for name, t in tensors.items():
        total += dg.tensor_sum(key, name, t.reshape(-1).view(torch.int16).numpy().view("uint16"))
    return dg.to_hex(total)


def make_checkpoints(out: Path, versions: int) -> tuple[list[Path], str]:
    """Writes versions+1 checkpoint directories out/v0000.. (config.json + model.safetensors).

    With the repo's workload generator (`starling-hub bench gen --model small`: Qwen3 layout,
    7.0 M parameters, real Adam steps at lr 3e-6 so ~1.8% of the elements change per step)
    when the binary is found, else with transformers (Qwen3ForCausalLM, same sizes, random
    init) and Adam-like steps in Python (2% of each tensor moved by one BF16 ULP). Returns
    the directories and which generator was used."""
    out.mkdir(parents=True, exist_ok=True)
    bin_dir = Path(os.environ.get("STARLING_BIN_DIR", "/var/tmp/starling-ci-target/release"))
    hub = bin_dir / "starling-hub"
    raw = out / "raw"
    if hub.is_file() and os.access(hub, os.X_OK):
        subprocess.run(
            [str(hub), "bench", "gen", "--model", "small", "--steps", str(versions), "-o", str(raw)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        files = [raw / f"step-{i:04}.safetensors" for i in range(versions + 1)]
        config = (raw / "config.json").read_text()
        how = f"starling-hub bench gen --model small ({hub})"
    else:
        files, config = _transformers_checkpoints(raw, versions)
        how = "transformers Qwen3ForCausalLM + 2% one-ULP steps (no starling-hub binary found)"
    dirs = []
    for i, f in enumerate(files):
        d = out / f"v{i:04}"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(config)
        # vLLM loads every *.safetensors of the directory: one file per version directory.
        target = d / "model.safetensors"
        if not target.exists():
            os.link(f, target) if f.stat().st_dev == d.stat().st_dev else shutil.copy(f, target)
        dirs.append(d)
    return dirs, how


def _transformers_checkpoints(raw: Path, versions: int) -> tuple[list[Path], str]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    raw.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3Config(
        vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(raw / "hf", safe_serialization=True)
    state = load_file(raw / "hf" / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    files = []
    for i in range(versions + 1):
        if i:
            for name, t in state.items():
                flat = t.reshape(-1).view(torch.int16).clone()
                pick = torch.rand(flat.numel(), generator=g) < 0.02
                step = torch.where(torch.rand(flat.numel(), generator=g) < 0.5, 1, -1).to(torch.int16)
                # one ULP up or down in magnitude (bits ±1), never into Inf/NaN for normal weights
                flat[pick] = flat[pick] + step[pick]
                state[name] = flat.view(torch.bfloat16).reshape(t.shape)
        f = raw / f"step-{i:04}.safetensors"
        save_file(state, f, metadata={"format": "pt"})
        files.append(f)
    return files, (raw / "hf" / "config.json").read_text()


def write_patch(path: Path, old: dict, new: dict, base: int, version: int, model_id: str = MODEL_ID,
                pre: str | None = None, post: str | None = None) -> sp.Patch:
    """The patch old -> new. Digests: ``pre`` if given (else hashed from ``old``); ``post`` if
    given, else ``pre`` moved by the changed elements only (the additive digest)."""
    changes = sp.diff(old, new)
    pre = pre or state_digest(model_id, old)
    if post is None:
        key = dg.DigestKey(model_id)
        d = dg.from_hex(pre)
        for c in changes:
            idx = c.indices.numpy()
            d -= dg.tensor_sum(key, c.name, old[c.name].reshape(-1)[c.indices].view(torch.int16).numpy().view("uint16"), idx)
            d += dg.tensor_sum(key, c.name, c.values.view(torch.int16).numpy().view("uint16"), idx)
        post = dg.to_hex(d)
    p = sp.Patch(model_id=model_id, base_version=base, version=version, pre_digest=pre,
                 post_digest=post, changes=changes)
    sp.write(str(path), p)
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m vllm.entrypoints.openai.api_server` on a checkpoint directory, bound to
    loopback, with the extension (confined to ``root``, default the log's directory), the dev
    routes and no tokenizer (with the model's own with `tokenizer=True`)."""

    def __init__(self, model_dir: Path, log: Path, extension: bool = True, tokenizer: bool = False,
                 max_model_len: int = 256, max_num_seqs: int = 8, root: Path | None = None) -> None:
        self.model_dir = str(model_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
        env["VLLM_SERVER_DEV_MODE"] = "1"
        # The only directory the extension reads patches and checkpoints from, and writes
        # read-backs into: the test's working directory (the log's).
        self.root = Path(root or log.parent)
        env["STARLING_VLLM_ROOT"] = str(self.root)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir, "--port", str(self.port), "--host", "127.0.0.1",
            "--enforce-eager", "--dtype", "bfloat16",
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs), "--seed", "0",
            # Log-probabilities after the temperature, as Starling defines them (docs/vllm.md).
            "--logprobs-mode", "processed_logprobs",
            # Sampling as the request says, not as the model's generation_config.json would.
            "--generation-config", "vllm",
        ]
        if not tokenizer:
            cmd += ["--skip-tokenizer-init"]
        if extension:
            cmd += ["--worker-extension-cls", EXTENSION]
        self.log = log
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}; log {log}:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() - t0 > 300:
                self.stop()
                raise RuntimeError(f"vLLM did not become healthy in 300 s; log {log}:\n{self.tail()}")
            time.sleep(0.5)
        self.start_seconds = time.time() - t0

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def rpc(self, method: str, *args: str) -> dict:
        r = requests.post(self.url + "/collective_rpc", json={"method": method, "args": list(args)}, timeout=300)
        assert r.status_code == 200, f"{method}: HTTP {r.status_code} {r.text[:500]}"
        results = r.json()["results"]
        assert len(results) == 1, results
        return results[0]

    def post(self, route: str) -> requests.Response:
        return requests.post(self.url + route, timeout=60)

    def greedy(self, prompt: list[int], max_tokens: int = 12) -> tuple[list[int], list[float]]:
        r = requests.post(self.url + "/v1/completions", json={
            "model": self.model_dir, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True,
        }, timeout=120)
        assert r.status_code == 200, r.text[:500]
        lp = r.json()["choices"][0]["logprobs"]
        ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
        return ids, [float(x) for x in lp["token_logprobs"]]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
