"""The trainer's check of every sample it consumes: its log-probabilities recomputed on the
version the sample is tagged with.

The trainer keeps the BF16 weights of the versions samples may still come from (the newest
``max_staleness + 2``: a batch is submitted for the newest version, its tokens may come from up
to ``max_staleness`` versions before it, and one more is in flight). A sample whose version it
no longer holds is refused: the trainer cannot know what generated it.

Two recomputations, on the tagged version's exact BF16 weights:

- **PyTorch** (every sample): transformers' forward in float32 from the BF16 weights. It agrees
  with the built-in engine to float32 rounding (different summation order; both are within
  1e-4 of float64 logits, ``docs/models.md``) and with vLLM to its BF16 activations: the
  agreement is reported per engine against a stated tolerance, and is what the importance
  ratio of the loss starts from.
- **Exact** (samples of built-in engine actors): the built-in engine's own scorer
  (``starling model score``, a child process), which reproduces what the actor's engine
  computed while generating bit for bit. Any difference means the actor did not run that
  version's weights (or reported something else) and is counted as a mismatch.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..types import Rollout, Sample
from .policy import completion_logprobs, load_bf16

# What each engine's log-probabilities are expected to agree with PyTorch's float32 recompute
# to (max absolute difference per token). The built-in engine computes in float32 from BF16
# weights like the recompute, in another order: ~1e-4 on logits. vLLM's CPU build keeps
# activations in BF16: measured up to ~0.07 on this model (integrations/vllm tests).
TOLERANCE = {"builtin": 2e-3, "vllm": 0.25}


class VersionStore:
    """BF16 weights (and the checkpoint file holding them) of the newest ``keep`` versions."""

    def __init__(self, keep: int):
        if keep < 1:
            raise ValueError("keep at least one version")
        self.keep = keep
        self._versions: "OrderedDict[int, Tuple[Dict[str, torch.Tensor], str]]" = OrderedDict()

    def add(self, version: int, state: Dict[str, torch.Tensor], path: str) -> None:
        self._versions[version] = (state, path)
        while len(self._versions) > self.keep:
            self._versions.popitem(last=False)

    def __contains__(self, version: int) -> bool:
        return version in self._versions

    def state(self, version: int) -> Dict[str, torch.Tensor]:
        return self._versions[version][0]

    def path(self, version: int) -> str:
        return self._versions[version][1]

    def held(self) -> List[int]:
        return list(self._versions)


class ExactScorer:
    """``starling model score --model DIR`` as a child process: one request per version."""

    def __init__(self, starling_bin: str, model_dir: str):
        self._proc = subprocess.Popen(
            [starling_bin, "model", "score", "--model", model_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def score(self, weights: str, items: Sequence[Tuple[Sequence[int], Sequence[int], float]]) -> List[List[float]]:
        req = {
            "weights": weights,
            "items": [{"prompt": list(p), "completion": list(c), "temperature": t} for p, c, t in items],
        }
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine scorer exited (status {self._proc.poll()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the engine scorer: {answer['error']}")
        return answer["logprobs"]

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


@dataclass
class EngineAgreement:
    """How one engine's log-probabilities compare with the trainer's recomputations."""

    samples: int = 0
    tokens: int = 0
    max_abs: float = 0.0
    sum_abs: float = 0.0
    over_tolerance: int = 0
    exact_samples: int = 0
    exact_mismatches: int = 0

    def to_json(self, engine: str) -> Dict[str, object]:
        return {
            "samples": self.samples,
            "tokens": self.tokens,
            "max_abs_logprob_diff": self.max_abs,
            "mean_abs_logprob_diff": self.sum_abs / self.tokens if self.tokens else 0.0,
            "tolerance": TOLERANCE.get(engine),
            "tokens_over_tolerance": self.over_tolerance,
            "exact_checked_samples": self.exact_samples,
            "exact_mismatches": self.exact_mismatches,
        }


@dataclass
class CheckReport:
    """What the check of one batch found."""

    per_engine: Dict[str, EngineAgreement] = field(default_factory=lambda: defaultdict(EngineAgreement))
    refused_groups: List[Tuple[int, str]] = field(default_factory=list)
    first_mismatch: Optional[str] = None
    seconds_torch: float = 0.0
    seconds_exact: float = 0.0

    def to_json(self) -> Dict[str, object]:
        return {
            "per_engine": {e: a.to_json(e) for e, a in sorted(self.per_engine.items())},
            "refused_groups": [{"group": g, "reason": r} for g, r in self.refused_groups],
            "first_mismatch": self.first_mismatch,
            "seconds": {"torch": round(self.seconds_torch, 3), "exact": round(self.seconds_exact, 3)},
        }


class BehaviourCheck:
    """Recomputes every consumed sample's log-probabilities on its tagged version."""

    def __init__(
        self,
        scorer_model: torch.nn.Module,
        versions: VersionStore,
        engines: Mapping[str, str],
        exact: Optional[ExactScorer],
        temperature: float,
    ):
        self.model = scorer_model.eval()
        self.versions = versions
        self.engines = engines  # actor name -> "builtin" | "vllm" | ...
        self.exact = exact
        self.temperature = temperature  # the batches' sampling temperature
        self._loaded: Optional[int] = None

    def _use(self, version: int) -> None:
        if self._loaded != version:
            load_bf16(self.model, self.versions.state(version))
            self._loaded = version

    def check(self, rollouts: Sequence[Rollout]) -> Tuple[List[Rollout], CheckReport]:
        """The rollouts the trainer may train on (every version they name is held), and what
        the recomputation found for them."""
        report = CheckReport()
        kept: List[Rollout] = []
        for r in rollouts:
            missing = sorted({sp.version for s in r.samples for sp in s.versions} - set(self.versions.held()))
            if missing:
                report.refused_groups.append(
                    (r.group, f"tagged with version {missing[0]}, which the trainer no longer holds "
                              f"(it holds {self.versions.held()})")
                )
                continue
            kept.append(r)
        # (rollout, sample) pairs by the version of each span.
        spans: Dict[int, List[Tuple[Rollout, Sample, int, int]]] = defaultdict(list)
        for r in kept:
            for s in r.samples:
                for sp in s.versions:
                    if sp.end > sp.start:
                        spans[sp.version].append((r, s, sp.start, sp.end))
        for version in sorted(spans):
            self._check_version(version, spans[version], report)
        return kept, report

    def _check_version(self, version: int, items: List[Tuple[Rollout, Sample, int, int]], report: CheckReport) -> None:
        self._use(version)
        # A span [start, end) of a sample is scored as the completion tokens[:end] after the
        # prompt, keeping the span's part.
        seqs = [(r.prompt_ids, s.tokens[:end]) for r, s, _, end in items]
        t0 = time.monotonic()
        with torch.no_grad():
            recomputed = completion_logprobs(self.model, seqs, self.temperature)
        t1 = time.monotonic()
        report.seconds_torch += t1 - t0
        exact_items = [i for i, (r, _, _, _) in enumerate(items) if self.engines.get(r.actor) == "builtin"]
        exact_out: Dict[int, List[float]] = {}
        if self.exact is not None and exact_items:
            answers = self.exact.score(
                self.versions.path(version),
                [(seqs[i][0], seqs[i][1], self.temperature) for i in exact_items],
            )
            exact_out = dict(zip(exact_items, answers, strict=True))
        report.seconds_exact += time.monotonic() - t1
        for i, (r, s, start, end) in enumerate(items):
            engine = self.engines.get(r.actor, "unknown")
            agg = report.per_engine[engine]
            reported = torch.tensor(s.logprobs[start:end], dtype=torch.float64)
            ours = recomputed[i][start:end].double()
            diff = (reported - ours).abs()
            agg.samples += 1
            agg.tokens += int(diff.numel())
            if diff.numel():
                agg.max_abs = max(agg.max_abs, float(diff.max()))
                agg.sum_abs += float(diff.sum())
                tol = TOLERANCE.get(engine)
                if tol is not None:
                    agg.over_tolerance += int((diff > tol).sum())
            if i in exact_out:
                agg.exact_samples += 1
                exact = exact_out[i][start:end]
                # Compared as float32 bits: both sides are f32 values written as JSON.
                ours32 = torch.tensor(exact, dtype=torch.float32)
                theirs32 = torch.tensor(s.logprobs[start:end], dtype=torch.float32)
                differ = (ours32 != theirs32).nonzero()
                if len(differ):
                    agg.exact_mismatches += 1
                    if report.first_mismatch is None:
                        j = int(differ[0])
                        report.first_mismatch = (
                            f"group {r.group} from {r.actor} (version {version}): token {start + j} "
                            f"reported {float(theirs32[j])!r}, the engine recomputes {float(ours32[j])!r}"
                        )
