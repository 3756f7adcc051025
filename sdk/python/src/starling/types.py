"""Typed views of the hub's JSON (see ``docs/api.md``).

Parsing is lenient about *extra* fields (a newer hub may add some) and strict about the ones
the SDK relies on: a missing required field raises ``StarlingError("bad_response", …)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from .errors import StarlingError


def _req(obj: Mapping[str, Any], key: str, what: str) -> Any:
    try:
        return obj[key]
    except (KeyError, TypeError):
        raise StarlingError("bad_response", f"the hub's {what} has no {key!r} field: {obj!r:.200}") from None


# --------------------------------------------------------------------------------------------
# Requests


@dataclass
class Sampling:
    """Sampling parameters. ``None`` fields are left out of the request, so the hub's defaults
    apply (for a batch) or the batch's values apply (for a group's override)."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_new_tokens: Optional[int] = None
    stop_token_ids: Optional[Sequence[int]] = None
    seed: Optional[int] = None

    def to_json(self) -> Dict[str, Any]:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None:
                out[f.name] = list(v) if f.name == "stop_token_ids" else v
        return out


SamplingLike = Union[Sampling, Mapping[str, Any]]


def sampling_json(s: Optional[SamplingLike]) -> Optional[Dict[str, Any]]:
    if s is None:
        return None
    if isinstance(s, Sampling):
        return s.to_json()
    if isinstance(s, Mapping):
        return {k: (list(v) if k == "stop_token_ids" and v is not None else v) for k, v in s.items()}
    raise TypeError(f"sampling must be a Sampling or a dict, not {type(s).__name__}")


@dataclass
class Group:
    """One prompt sampled ``n`` times: the unit of leasing, retry and acceptance.

    Give exactly one of ``messages`` (a chat: ``[{"role": "user", "content": "..."}]``,
    rendered with the model's chat template and tokenized by the hub, as
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)`` would),
    ``prompt`` (text, tokenized with the model's tokenizer, or the byte tokenizer for a
    generated model) or ``prompt_ids``. ``verifier`` names the reward (``exact_match``,
    ``numeric``, ``math``, ``char_match``, an operator's reward service, or ``none`` to score
    ``Sample.text`` yourself) and ``answer`` its reference, kept by the hub.
    """

    prompt: Optional[str] = None
    prompt_ids: Optional[Sequence[int]] = None
    messages: Optional[Sequence[Mapping[str, str]]] = None
    n: int = 1
    verifier: str = "none"
    answer: Optional[str] = None
    sampling: Optional[SamplingLike] = None

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {}
        if self.messages is not None:
            out["messages"] = [{"role": str(m["role"]), "content": str(m["content"])} for m in self.messages]
        if self.prompt is not None:
            out["prompt"] = self.prompt
        if self.prompt_ids is not None:
            out["prompt_ids"] = [int(t) for t in self.prompt_ids]
        out["n"] = self.n
        out["verifier"] = self.verifier
        if self.answer is not None:
            out["answer"] = self.answer
        s = sampling_json(self.sampling)
        if s is not None:
            out["sampling"] = s
        return out


GroupLike = Union[Group, Mapping[str, Any]]


def group_json(g: GroupLike) -> Dict[str, Any]:
    if isinstance(g, Group):
        return g.to_json()
    if isinstance(g, Mapping):
        out = dict(g)
        if "sampling" in out and out["sampling"] is not None:
            out["sampling"] = sampling_json(out["sampling"])
        if "prompt_ids" in out and out["prompt_ids"] is not None:
            out["prompt_ids"] = [int(t) for t in out["prompt_ids"]]
        return out
    raise TypeError(f"a group must be a Group or a dict, not {type(g).__name__}")


# --------------------------------------------------------------------------------------------
# Answers


@dataclass(frozen=True)
class Version:
    """A published policy version (``POST /v1/versions``, ``GET /v1/versions``)."""

    version: int
    base: Optional[int]
    changes: int
    bytes: int
    digest: str
    step: Optional[int]
    created_at_ms: Optional[int] = None
    #: Whether the hub took the trainer's file (handover) rather than copying it; ``None``
    #: where the answer does not say (``GET /v1/versions``).
    handed_over: Optional[bool] = None

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> "Version":
        return cls(
            version=int(_req(j, "version", "version")),
            base=j.get("base"),
            changes=int(j.get("changes", 0)),
            bytes=int(j.get("bytes", 0)),
            digest=str(_req(j, "digest", "version")),
            step=j.get("step"),
            created_at_ms=j.get("created_at_ms"),
            handed_over=j.get("handed_over"),
        )


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of a sample were generated with weights ``version``."""

    version: int
    start: int
    end: int


@dataclass(frozen=True)
class Sample:
    """One completion of a group's prompt.

    ``logprobs[i]`` is the log-probability of ``tokens[i]`` under the weights that produced it,
    at the group's temperature over the full vocabulary (``docs/api.md``, "Log-probabilities");
    ``versions`` says which version produced which tokens (half-open spans). ``finish`` is
    ``stop`` (a stop token, which is the last token) or ``length`` (``max_new_tokens``).
    ``text`` is the completion decoded with the model's tokenizer, up to (without) the first
    stop token, special tokens skipped: what the hub's verifiers score, and what a trainer
    scores itself with ``verifier="none"``. ``reward`` is the group's verifier's. Timings,
    measured by the actor: ``ttft_ms`` (time to the first token) and ``tokens_per_s``
    (decode speed)."""

    tokens: List[int]
    logprobs: List[float]
    finish: str
    versions: List[Span]
    reward: Optional[float]
    ttft_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    text: str = ""

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> "Sample":
        return cls(
            tokens=[int(t) for t in _req(j, "tokens", "sample")],
            logprobs=[float(x) for x in _req(j, "logprobs", "sample")],
            finish=str(j.get("finish", "")),
            versions=[Span(int(s["version"]), int(s["start"]), int(s["end"])) for s in j.get("versions", [])],
            reward=None if j.get("reward") is None else float(j["reward"]),
            ttft_ms=j.get("ttft_ms"),
            tokens_per_s=j.get("tokens_per_s"),
            text=str(j.get("text", "")),
        )

    def version_of(self, i: int) -> Optional[int]:
        """The version that generated token ``i`` (``None`` if no span covers it)."""
        for s in self.versions:
            if s.start <= i < s.end:
                return s.version
        return None


@dataclass(frozen=True)
class Rollout:
    """One accepted group: its samples, with rewards computed by the hub's verifier.

    ``group`` is the group's index in the submitted batch, ``version`` the policy version of
    the job (every token is from it or a newer one within the batch's staleness bound),
    ``actor`` the actor that generated it, ``attempt`` its lease attempt (1 unless a lease
    expired), ``cursor`` the position in the batch's result stream (resume after it), and
    ``accepted_at_ms`` when the hub accepted it (Unix milliseconds)."""

    job: int
    batch: int
    group: int
    actor: str
    attempt: int
    version: int
    prompt_ids: List[int]
    samples: List[Sample]
    cursor: int
    accepted_at_ms: Optional[int] = None

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> "Rollout":
        return cls(
            job=int(_req(j, "job", "result")),
            batch=int(_req(j, "batch", "result")),
            group=int(_req(j, "group", "result")),
            actor=str(j.get("actor", "")),
            attempt=int(j.get("attempt", 1)),
            version=int(_req(j, "version", "result")),
            prompt_ids=[int(t) for t in _req(j, "prompt_ids", "result")],
            samples=[Sample.from_json(s) for s in _req(j, "samples", "result")],
            cursor=int(_req(j, "cursor", "result")),
            accepted_at_ms=j.get("accepted_at_ms"),
        )

    @property
    def rewards(self) -> List[Optional[float]]:
        return [s.reward for s in self.samples]


@dataclass(frozen=True)
class GroupCounts:
    """How many groups of a batch are in each state (``GET /v1/batches/{id}``)."""

    total: int = 0
    posted: int = 0
    pending: int = 0
    leased: int = 0
    scoring: int = 0
    done: int = 0
    failed: int = 0


# Why the hub refused results actors submitted (docs/api.md, "GET /v1/batches/{id}").
REFUSAL_REASONS = (
    "stale",
    "behind_job",
    "unknown_version",
    "digest",
    "lease_expired",
    "not_lease_holder",
    "duplicate",
    "cancelled",
    "job_failed",
    "invalid_result",
    "nonfinite_logprob",
    "result_too_large",
)

# Why groups of a batch failed (docs/api.md, "GET /v1/batches/{id}").
FAILURE_REASONS = ("attempts", "reward_service", "result_too_large", "cancelled")


@dataclass(frozen=True)
class BatchStatus:
    """``GET /v1/batches/{id}``. ``state`` is ``posted``, ``running``, ``done`` or
    ``cancelled``. ``refused`` counts the results the hub refused, by reason: every reason of
    :data:`REFUSAL_REASONS` is present (0 when the hub did not list it), and any reason a newer
    hub adds is kept too. ``failures`` counts the failed groups by reason the same way
    (:data:`FAILURE_REASONS`). ``groups.scoring`` counts groups accepted and waiting for their
    reward service (not readable yet). ``archived`` is the file retention moved the batch's
    results to (``None`` while they are in the ledger); :meth:`Batch.results` reads them
    either way."""

    batch: int
    version: int
    state: str
    max_staleness: int
    groups: GroupCounts
    refused: Dict[str, int] = field(default_factory=dict)
    failures: Dict[str, int] = field(default_factory=dict)
    created_at_ms: Optional[int] = None
    archived: Optional[str] = None

    @property
    def finished(self) -> bool:
        """Whether no group of the batch will be accepted any more (done or cancelled)."""
        return self.state in ("done", "cancelled")

    @classmethod
    def from_json(cls, j: Mapping[str, Any]) -> "BatchStatus":
        g = j.get("groups") or {}
        known = {f.name for f in fields(GroupCounts)}
        refused = {r: 0 for r in REFUSAL_REASONS}
        failures = {r: 0 for r in FAILURE_REASONS}
        try:
            refused.update({str(k): int(v) for k, v in (j.get("refused") or {}).items()})
            failures.update({str(k): int(v) for k, v in (j.get("failures") or {}).items()})
            archived = (j.get("archived") or {}).get("path")
            counts = GroupCounts(**{k: int(v) for k, v in g.items() if k in known})
        except (AttributeError, TypeError, ValueError):
            raise StarlingError("bad_response", f"the hub's batch status is malformed: {j!r:.200}") from None
        return cls(
            batch=int(_req(j, "batch", "batch status")),
            version=int(_req(j, "version", "batch status")),
            state=str(_req(j, "state", "batch status")),
            max_staleness=int(j.get("max_staleness", 1)),
            groups=counts,
            refused=refused,
            failures=failures,
            created_at_ms=j.get("created_at_ms"),
            archived=None if archived is None else str(archived),
        )


def as_dict(obj: Any) -> Dict[str, Any]:
    """A dataclass of this module as plain JSON-able dicts (e.g. to log a rollout)."""
    return asdict(obj)
