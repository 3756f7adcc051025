#!/usr/bin/env python3
"""GRPO in plain PyTorch, training through a Starling hub.

The policy is a small Qwen3-shaped model written out here in PyTorch, with the checkpoint's
tensor names, loaded from the run's initial safetensors and its ``config.json``. Each step:

1. submit a batch of groups of a verifiable task ("3+4=", answer checked by the hub's
   ``numeric`` verifier) for the latest version;
2. collect the accepted rollouts (each group once, with the actors' behaviour log-probabilities
   and the hub's rewards);
3. compute group-normalised advantages, A = (r - mean(r_group)) / (std(r_group) + eps);
4. minimise the token-level clipped policy-gradient loss
   ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``, averaged over every completion token
   of the batch, with ``ratio = exp(logprob_new - logprob_behaviour)`` and
   ``logprob = log_softmax(logits / T)[token]`` over the full vocabulary (the hub's definition);
5. AdamW on FP32 master weights, then publish the state dict (cast to BF16 by the SDK) as the
   next version, which the actors apply before the next batch.

Run against a hub (see sdk/python/README.md for a cluster on one machine):

    python examples/grpo_torch.py --hub http://127.0.0.1:8080 --credentials T1 \\
        --init CKPT/step-0000.safetensors --steps 5 --checkpoint-dir DIR

``DIR`` must be readable by the hub under the same path (the hub reads what it publishes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

# torch warns at import when numpy is missing; nothing here uses numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from starling import Client, Rollout, load_torch  # noqa: E402

BYTE_OFFSET = 3  # the byte tokenizer: token id = byte + 3
BOS, EOS = 1, 2


def encode(text: str) -> List[int]:
    return [b + BYTE_OFFSET for b in text.encode("utf-8")]


def decode(ids: Sequence[int]) -> str:
    return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET).decode("utf-8", "replace")


# --------------------------------------------------------------------------------------------
# The model (Qwen3: RMSNorm, q/k norm per head before rotary, HF rotate_half rotary, grouped KV
# heads, SwiGLU MLP, untied lm_head)


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool = False

    @classmethod
    def load(cls, path: str) -> "Config":
        with open(path) as f:
            j = json.load(f)
        heads = j["num_attention_heads"]
        return cls(
            vocab_size=j["vocab_size"],
            hidden_size=j["hidden_size"],
            intermediate_size=j["intermediate_size"],
            num_hidden_layers=j["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=j.get("num_key_value_heads", heads),
            head_dim=j.get("head_dim") or j["hidden_size"] // heads,
            rms_norm_eps=float(j["rms_norm_eps"]),
            rope_theta=float(j.get("rope_theta", 10000.0)),
            tie_word_embeddings=bool(j.get("tie_word_embeddings", False)),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = c.num_attention_heads // c.num_key_value_heads
        k = k.repeat_interleave(rep, dim=1)  # KV head j serves query heads j*rep .. (j+1)*rep-1
        v = v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * (c.head_dim ** -0.5)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(b, t, c.num_attention_heads * c.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3(nn.Module):
    """Qwen3ForCausalLM's computation; ``state_dict()`` names match the HF checkpoint's."""

    def __init__(self, c: Config):
        super().__init__()
        if c.tie_word_embeddings:
            raise ValueError("this example expects an untied lm_head (tie_word_embeddings = false)")
        self.config = c
        self.model = Backbone(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def rotary(self, t: int, device, dtype):
        c = self.config
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.int64, device=device).float() / c.head_dim))
        freqs = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits for every position of ``ids`` ([batch, time]); causal, positions from 0."""
        b, t = ids.shape
        x = self.model.embed_tokens(ids)
        cos, sin = self.rotary(t, ids.device, x.dtype)
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.model.norm(x)).float()

    @classmethod
    def from_checkpoint(cls, weights: str, config: str, dtype=torch.float32) -> "Qwen3":
        m = cls(Config.load(config))
        sd = {k: v.to(dtype) for k, v in load_torch(weights).items()}
        m.load_state_dict(sd, strict=True)
        return m.to(dtype)


def completion_logprobs(
    model: Qwen3, seqs: Sequence[tuple], temperature: float, device="cpu"
) -> List[torch.Tensor]:
    """For each ``(prompt_ids, tokens)``: ``log_softmax(logits / T)[token]`` of every completion
    token (``T = 1`` when the temperature is 0), in one right-padded forward pass."""
    t = temperature if temperature > 0 else 1.0
    lens = [len(p) + len(c) for p, c in seqs]
    width = max(lens)
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    for i, (p, c) in enumerate(seqs):
        ids[i, : lens[i]] = torch.tensor(list(p) + list(c), dtype=torch.long)
    logp = torch.log_softmax(model(ids) / t, dim=-1)
    out = []
    for i, (p, c) in enumerate(seqs):
        pos = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=device)  # position predicting token j
        out.append(logp[i, pos, torch.tensor(list(c), dtype=torch.long, device=device)])
    return out


# --------------------------------------------------------------------------------------------
# GRPO


def task(rng: random.Random) -> tuple:
    """A single-digit sum: small enough that a random policy sometimes gets it right."""
    a = rng.randrange(0, 5)
    b = rng.randrange(0, 5)
    return f"{a}+{b}=", str(a + b)


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> List[float]:
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


def grpo_loss(
    model: Qwen3,
    rollouts: Sequence[Rollout],
    temperature: float,
    clip_eps: float,
    device="cpu",
) -> tuple:
    """The token-level clipped surrogate over every completion token of ``rollouts``, and
    diagnostics (ratio statistics against the behaviour log-probabilities)."""
    seqs, behaviour, adv = [], [], []
    for r in rollouts:
        rewards = [s.reward or 0.0 for s in r.samples]
        for s, a in zip(r.samples, group_advantages(rewards), strict=True):
            if not s.tokens:
                continue
            seqs.append((r.prompt_ids, s.tokens))
            behaviour.append(torch.tensor(s.logprobs, dtype=torch.float32, device=device))
            adv.append(a)
    new = completion_logprobs(model, seqs, temperature, device)
    new_all = torch.cat(new)
    old_all = torch.cat(behaviour)
    adv_all = torch.cat([torch.full((len(x),), a, device=device) for x, a in zip(new, adv, strict=True)])
    ratio = torch.exp(new_all - old_all)
    surrogate = torch.minimum(ratio * adv_all, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv_all)
    loss = -surrogate.mean()
    with torch.no_grad():
        diff = (new_all - old_all).abs()
        stats = {
            "tokens": int(new_all.numel()),
            "logprob_diff_max": float(diff.max()),
            "logprob_diff_mean": float(diff.mean()),
            "clipped": float(((ratio - 1).abs() > clip_eps).float().mean()),
        }
    return loss, stats


def run(args: argparse.Namespace) -> Dict:
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    config = args.config or os.path.join(os.path.dirname(os.path.abspath(args.init)), "config.json")
    model = Qwen3.from_checkpoint(args.init, config)  # FP32 masters
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=args.weight_decay)
    hub = Client(args.hub, token=args.token, credentials=args.credentials, checkpoint_dir=args.checkpoint_dir)
    sampling = {
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "stop_token_ids": [EOS],
    }
    history = []
    for step in range(args.steps):
        t0 = time.monotonic()
        groups = []
        for _ in range(args.groups):
            prompt, answer = task(rng)
            groups.append({"prompt": prompt, "n": args.n, "verifier": "numeric", "answer": answer})
        batch = hub.submit(groups, sampling={**sampling, "seed": args.seed * 100_003 + step})
        rollouts = list(batch.results(wait_ms=5000, timeout=args.batch_timeout))
        if len(rollouts) != len(groups):
            raise RuntimeError(f"batch {batch.id}: {len(rollouts)} of {len(groups)} groups came back")
        t_roll = time.monotonic() - t0
        rewards = [s.reward or 0.0 for r in rollouts for s in r.samples]
        for epoch in range(args.epochs):
            opt.zero_grad(set_to_none=True)
            loss, stats = grpo_loss(model, rollouts, args.temperature, args.clip_eps)
            if not torch.isfinite(loss):
                raise RuntimeError(f"step {step}: the loss is {loss.item()}")
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            opt.step()
            if epoch == 0:
                first = (float(loss.item()), stats)
        # One version per step, also for a step whose samples all scored alike (no gradient,
        # the same BF16 weights): the hub refuses an unchanged checkpoint unless told.
        v = hub.publish(model.state_dict(), step=step + 1, allow=("unchanged",))
        rec = {
            "step": step,
            "batch": batch.id,
            "batch_version": batch.version,
            "loss": first[0],
            "mean_reward": sum(rewards) / max(1, len(rewards)),
            **first[1],
            "published": v.version,
            "published_digest": v.digest,
            "delta_bytes": v.bytes,
            "changes": v.changes,
            "rollout_s": round(t_roll, 3),
            "step_s": round(time.monotonic() - t0, 3),
        }
        history.append(rec)
        print(
            f"step {step}: batch {batch.id} (v{batch.version}) reward {rec['mean_reward']:.3f} "
            f"loss {rec['loss']:+.5f} |Δlogprob| max {rec['logprob_diff_max']:.2e} "
            f"→ published v{v.version} ({v.changes} changes, {v.bytes} B) in {rec['step_s']:.2f}s",
            flush=True,
        )
    return {"history": history, "config": config}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hub", required=True, help="the hub's HTTP address, e.g. http://127.0.0.1:8080")
    auth = p.add_mutually_exclusive_group(required=True)
    auth.add_argument("--credentials", help="trainer credentials directory (starling-hub issue --role trainer)")
    auth.add_argument("--token", help="the trainer token itself")
    p.add_argument("--init", required=True, help="the run's initial safetensors checkpoint (what the hub started from)")
    p.add_argument("--config", help="the model's config.json (default: beside --init)")
    p.add_argument("--checkpoint-dir", required=True, help="where published checkpoints are written (readable by the hub)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--groups", type=int, default=8, help="groups (prompts) per batch")
    p.add_argument("-n", type=int, default=8, help="samples per group")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--epochs", type=int, default=1, help="optimizer steps per batch (>1 exercises the clipping)")
    p.add_argument("--batch-timeout", type=float, default=600.0, help="seconds to wait for a batch's rollouts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", help="write the per-step history here as JSON")
    args = p.parse_args(argv)
    for name in ("steps", "groups", "n", "max_new_tokens", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"{'-n' if name == 'n' else '--' + name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    args = parse_args(argv)
    out = run(args)
    if args.report:
        with open(args.report, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
