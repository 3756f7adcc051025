"""The GRPO loop through a Starling hub, with one step of overlap.

Each step ``k``:

1. collect batch ``k``'s rollouts (every group once, with the actors' behaviour
   log-probabilities and the hub's ``math`` rewards);
2. submit batch ``k + 1`` for the newest published version, so the actors generate while the
   trainer computes (SparrowRL's one-step lag; the hub accepts tokens up to ``max_staleness``
   versions old);
3. check batch ``k``: every sample's log-probabilities recomputed on the version it is tagged
   with (:mod:`.behaviour`); groups from versions the trainer no longer holds are refused;
4. one AdamW step on the FP32 master weights with the clipped token-level GRPO loss;
5. cast to BF16 and publish: the hub diffs it against the previous version and ships the delta.

Every step is one JSON line in the report file (and a line on stdout): rewards, the check,
the published version's size and density, per-actor samples, and where the time went.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..client import Batch, Client
from ..types import Rollout
from .behaviour import BehaviourCheck, ExactScorer, VersionStore
from .objective import clipped_surrogate, group_advantages
from .policy import bf16_state, checkpoint_names, completion_logprobs, load_policy
from .tasks import ArithmeticProblems


@dataclass
class Settings:
    hub: str
    credentials: Optional[str]
    token: Optional[str]
    model: str
    checkpoint_dir: str
    steps: int = 10
    groups: int = 8
    n: int = 4
    max_new_tokens: int = 48
    temperature: float = 1.0
    lr: float = 3e-6
    clip_eps: float = 0.2
    max_grad_norm: float = 1.0
    max_staleness: int = 1
    seed: int = 1
    problems: int = 0
    chunk: int = 8
    threads: Optional[int] = None
    starling_bin: Optional[str] = None
    report: Optional[str] = None
    batch_timeout: float = 3600.0

    def validate(self) -> None:
        for name in ("steps", "groups", "n", "max_new_tokens", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, not {self.lr}")
        if not (0 < self.clip_eps < 1):
            raise ValueError(f"clip_eps must be in (0, 1), not {self.clip_eps}")
        if self.problems < 0:
            raise ValueError("problems must be at least 0 (0: a new problem every time)")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be at least 0")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"{self.model} is not a model directory (no config.json)")


class GrpoTrainer:
    def __init__(self, s: Settings):
        s.validate()
        self.s = s
        if s.threads:
            torch.set_num_threads(s.threads)
        torch.manual_seed(s.seed)
        self.client = Client(s.hub, token=s.token, credentials=s.credentials, checkpoint_dir=s.checkpoint_dir)
        latest = self.client.latest_version()
        if latest != 0:
            raise RuntimeError(
                f"the hub is at version {latest}: this trainer starts from {s.model}'s weights, the hub's "
                "version 0 (start the hub with --init at that directory and a new store)"
            )
        self.names = checkpoint_names(s.model)
        self.policy = load_policy(s.model)  # FP32 masters
        self.policy.train()
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
        self.versions = VersionStore(keep=s.max_staleness + 2)
        self.versions.add(0, bf16_state(self.policy, self.names), os.path.join(s.model, "model.safetensors"))
        self.parameters = sum(t.numel() for t in self.versions.state(0).values())
        self.exact = ExactScorer(s.starling_bin, s.model) if s.starling_bin else None
        self.engines: Dict[str, str] = {}
        self.check = BehaviourCheck(load_policy(s.model), self.versions, self.engines, self.exact, s.temperature)
        self.problems = ArithmeticProblems(s.seed, pool=s.problems)
        self.history: List[Dict[str, object]] = []

    def close(self) -> None:
        if self.exact is not None:
            self.exact.close()

    # ------------------------------------------------------------------------------------

    def _submit(self, step: int) -> Batch:
        groups = [p.group(self.s.n) for p in self.problems.batch(self.s.groups)]
        sampling = {
            "temperature": self.s.temperature,
            "max_new_tokens": self.s.max_new_tokens,
            "seed": self.s.seed * 1_000_003 + step,
        }
        return self.client.submit(groups, sampling=sampling, max_staleness=self.s.max_staleness)

    def _refresh_engines(self) -> None:
        """Which engine each actor runs, from the hub's status (actors may join any time)."""
        status = self.client.status()
        for a in status.get("actors", []):
            name, engine = a.get("name"), a.get("engine") or ""
            if name:
                self.engines[name] = "vllm" if engine.startswith("vllm") else (
                    "builtin" if engine.startswith("builtin") else engine
                )

    def _train(self, rollouts: Sequence[Rollout]) -> Dict[str, float]:
        """One optimizer step on ``rollouts``."""
        seqs, behaviour, adv = [], [], []
        for r in rollouts:
            a = group_advantages([s.reward or 0.0 for s in r.samples])
            if all(x == 0.0 for x in a):
                continue
            for s, x in zip(r.samples, a, strict=True):
                if s.tokens:
                    seqs.append((r.prompt_ids, s.tokens))
                    behaviour.append(torch.tensor(s.logprobs, dtype=torch.float32))
                    adv.append(x)
        total = sum(len(c) for _, c in seqs)
        self.optimizer.zero_grad(set_to_none=True)
        out = {"trained_samples": len(seqs), "trained_tokens": total, "loss": 0.0, "clipped": 0.0, "grad_norm": 0.0}
        if not seqs:
            return out  # every group scored the same: no gradient; the weights stay as they are
        loss_sum, clipped = 0.0, 0
        c = self.s.chunk
        for i in range(0, len(seqs), c):
            new = completion_logprobs(self.policy, seqs[i : i + c], self.s.temperature, chunk=c)
            loss, k = clipped_surrogate(new, behaviour[i : i + c], adv[i : i + c], self.s.clip_eps, total)
            if not torch.isfinite(loss):
                raise RuntimeError(f"the loss is {loss.item()}: refusing to step on it")
            loss.backward()
            loss_sum += loss.item()
            clipped += k
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.s.max_grad_norm)
        self.optimizer.step()
        out.update(loss=loss_sum, clipped=clipped / total, grad_norm=float(norm))
        return out

    def _publish(self, step: int):
        state = bf16_state(self.policy, self.names)
        bad = [n for n, t in state.items() if not torch.isfinite(t.float()).all()]
        if bad:
            raise RuntimeError(f"non-finite weights after step {step} in {bad[0]} ({len(bad)} tensors): not publishing")
        name = f"step-{step:08d}.safetensors"
        published_at_ms = time.time() * 1000
        # One version per step, also for a step that changed no weight (no group had a
        # gradient): the hub refuses an unchanged checkpoint unless allowed.
        v = self.client.publish(state, step=step, name=name, allow=("unchanged",))
        path = os.path.join(os.path.abspath(self.s.checkpoint_dir), name)
        self.versions.add(v.version, state, path)
        return v, published_at_ms, path

    # ------------------------------------------------------------------------------------

    def run(self) -> List[Dict[str, object]]:
        s = self.s
        report = open(s.report, "a") if s.report else None
        try:
            loop_started_ms = time.time() * 1000
            pending = self._submit(1)
            for step in range(1, s.steps + 1):
                t0 = time.monotonic()
                batch = pending
                rollouts = list(batch.results(wait_ms=10_000, timeout=s.batch_timeout))
                t_wait = time.monotonic() - t0
                if len(rollouts) != batch.groups:
                    st = batch.status()
                    raise RuntimeError(
                        f"batch {batch.id}: {len(rollouts)} of {batch.groups} groups came back "
                        f"(failures {st.failures}, refused {st.refused})"
                    )
                if step < s.steps:
                    pending = self._submit(step + 1)
                t1 = time.monotonic()
                self._refresh_engines()
                kept, check = self.check.check(rollouts)
                t2 = time.monotonic()
                trained = self._train(kept)
                t3 = time.monotonic()
                v, published_at_ms, path = self._publish(step)
                t4 = time.monotonic()
                rewards = [x.reward or 0.0 for r in rollouts for x in r.samples]
                per_actor, per_actor_tokens = Counter(), Counter()
                tokens = 0
                for r in rollouts:
                    n = sum(len(x.tokens) for x in r.samples)
                    per_actor[r.actor] += len(r.samples)
                    per_actor_tokens[r.actor] += n
                    tokens += n
                accepted = [r.accepted_at_ms for r in rollouts if r.accepted_at_ms is not None]
                status = batch.status()
                rec = {
                    "step": step,
                    "batch": batch.id,
                    "batch_version": batch.version,
                    "sample_versions": sorted({sp.version for r in rollouts for x in r.samples for sp in x.versions}),
                    "samples": len(rewards),
                    "completion_tokens": tokens,
                    "mean_reward": sum(rewards) / max(1, len(rewards)),
                    "solved": sum(1 for x in rewards if x >= 1.0) / max(1, len(rewards)),
                    **trained,
                    "check": check.to_json(),
                    "per_actor_samples": dict(sorted(per_actor.items())),
                    "per_actor_tokens": dict(sorted(per_actor_tokens.items())),
                    "batch_created_at_ms": status.created_at_ms,
                    "last_accepted_at_ms": max(accepted) if accepted else None,
                    "loop_started_at_unix_ms": loop_started_ms,
                    "ended_at_unix_ms": time.time() * 1000,
                    "published": {
                        "version": v.version,
                        "bytes": v.bytes,
                        "changes": v.changes,
                        "density": v.changes / self.parameters,
                        "digest": v.digest,
                        "at_unix_ms": published_at_ms,
                        "path": path,
                    },
                    "seconds": {
                        "wait": round(t_wait, 3),
                        "check": round(t2 - t1, 3),
                        "train": round(t3 - t2, 3),
                        "publish": round(t4 - t3, 3),
                        "step": round(t4 - t0, 3),
                    },
                }
                self.history.append(rec)
                if report:
                    report.write(json.dumps(rec) + "\n")
                    report.flush()
                agree = ", ".join(
                    f"{e} max|Δ| {a['max_abs_logprob_diff']:.1e}"
                    + (f" exact {a['exact_checked_samples'] - a['exact_mismatches']}/{a['exact_checked_samples']}"
                       if a["exact_checked_samples"] else "")
                    for e, a in rec["check"]["per_engine"].items()
                )
                print(
                    f"step {step}: batch {batch.id} (v{batch.version}) reward {rec['mean_reward']:.3f} "
                    f"solved {100 * rec['solved']:.0f}% loss {rec['loss']:+.4f} [{agree}] "
                    f"→ v{v.version} {v.changes} changes ({100 * rec['published']['density']:.2f}%), {v.bytes} B; "
                    f"wait {t_wait:.1f}s check {t2 - t1:.1f}s train {t3 - t2:.1f}s publish {t4 - t3:.1f}s",
                    flush=True,
                )
        finally:
            if report:
                report.close()
        return self.history
