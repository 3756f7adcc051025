"""The trainer's client of the hub's HTTP API (``docs/api.md`` in the Starling repository).

:class:`Client` maps each route to a method and each answer to a typed object
(``starling.types``); :class:`Batch` turns the long-polled results route into an iterator that
yields every accepted group exactly once and can resume from a cursor. It uses only the
standard library (``urllib``), so a trainer needs nothing but this package and, to publish a
state dict, PyTorch.

Invariants kept here:

* **Every failure is a** :class:`~starling.errors.StarlingError`: an answer outside 2xx
  carries the hub's ``code``, ``message`` and HTTP status; no connection, a timeout or a
  malformed answer get codes of their own (``unreachable``, ``timeout``, ``bad_response``).
  Wrong arguments (a negative step, a token *and* credentials) are ``ValueError``.
* **Nothing half-published.** A state dict is validated completely before a byte is written;
  it is written to a temporary file and renamed (``starling.safetensors``); only then is its
  path sent. A file the hub refuses (4xx: ``layout_mismatch``, ``unreadable_checkpoint``) is
  deleted, so the checkpoint directory holds only what the hub published (or may have, when
  the answer never came).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, TypeVar, Union

from .errors import StarlingError
from .safetensors import prepare_state_dict, write_bf16
from .types import (
    BatchStatus,
    GroupLike,
    Rollout,
    SamplingLike,
    Version,
    group_json,
    sampling_json,
)

PathLike = Union[str, "os.PathLike[str]"]
T = TypeVar("T")

# Long polls ask the hub to wait at most this long (the hub's own cap is 30 s).
MAX_WAIT_MS = 30_000


def _read_token(credentials: PathLike) -> str:
    path = os.path.join(os.fspath(credentials), "token")
    try:
        with open(path, "r", encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise StarlingError(
            "bad_credentials",
            f"cannot read the trainer token {path} ({e.strerror or e}); "
            "write it with `starling-hub issue --role trainer --name NAME -o DIR`",
        ) from None
    if not token:
        raise StarlingError("bad_credentials", f"the trainer token file {path} is empty")
    return token


class Client:
    """A trainer's connection to a Starling hub's HTTP API.

    ``url`` is the hub's ``--http`` address (``http://host:port``; a bare ``host:port`` is
    taken as http). Authenticate with ``token`` (the string) or ``credentials`` (the trainer's
    credentials directory, whose ``token`` file holds it). ``timeout`` bounds every request
    except publishes, which wait for the hub to diff and store the checkpoint and are bounded by
    ``publish_timeout``. ``checkpoint_dir`` is where :meth:`publish` writes state dicts when the
    call names no ``directory``.

    Environment proxies are ignored: the hub's HTTP API lives on loopback or a private network.
    """

    def __init__(
        self,
        url: str,
        token: Optional[str] = None,
        credentials: Optional[PathLike] = None,
        timeout: float = 60.0,
        *,
        publish_timeout: float = 3600.0,
        checkpoint_dir: Optional[PathLike] = None,
    ):
        if token is not None and credentials is not None:
            raise ValueError("give token or credentials, not both")
        if "://" not in url:
            url = "http://" + url
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https"):
            raise ValueError(f"the hub's URL must be http://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self.token = token if token is not None else (_read_token(credentials) if credentials is not None else None)
        self.timeout = timeout
        self.publish_timeout = publish_timeout
        self.checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:
        return f"Client({self.url!r}, token={'set' if self.token else None})"

    # ----------------------------------------------------------------------------------------
    # Transport

    def _request(
        self,
        method: str,
        path: str,
        body: Optional[Any] = None,
        query: Optional[Mapping[str, Any]] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        url = self.url + path
        if query:
            q = {k: v for k, v in query.items() if v is not None}
            if q:
                url += "?" + urllib.parse.urlencode(q)
        headers = {"accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["content-type"] = "application/json"
        if self.token is not None:
            headers["authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        t = self.timeout if timeout is None else timeout
        try:
            with self._opener.open(req, timeout=t) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as e:
            raise self._http_error(method, path, e) from None
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise self._timeout(method, path, t) from None
            raise StarlingError(
                "unreachable",
                f"cannot reach the Starling hub at {self.url} ({_describe(reason)}); "
                "is `starling-hub serve --http` running there?",
            ) from None
        except (socket.timeout, TimeoutError):
            raise self._timeout(method, path, t) from None
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            raise StarlingError(
                "unreachable",
                f"the connection to the Starling hub at {self.url} failed during {method} {path} ({_describe(e)})",
            ) from None
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise StarlingError(
                "bad_response",
                f"{method} {path} answered {status} with a body that is not JSON: {raw[:200]!r}",
                status,
            ) from None

    def _timeout(self, method: str, path: str, t: float) -> StarlingError:
        return StarlingError(
            "timeout", f"the Starling hub at {self.url} did not answer {method} {path} within {t:g} s"
        )

    @staticmethod
    def _http_error(method: str, path: str, e: urllib.error.HTTPError) -> StarlingError:
        try:
            raw = e.read()
        except (OSError, http.client.HTTPException):  # the status alone still says something
            raw = b""
        try:
            j = json.loads(raw)
            return StarlingError(str(j["code"]), str(j.get("message", "")), e.code)
        except (ValueError, KeyError, TypeError):
            text = raw.decode("utf-8", "replace").strip()[:300] or (e.reason or "")
            return StarlingError(f"http_{e.code}", f"{method} {path}: {e.code} {text}", e.code)

    # ----------------------------------------------------------------------------------------
    # Versions

    def versions(self) -> List[Version]:
        """The published versions, newest first (the hub lists the newest 64 at most)."""
        j = self._request("GET", "/v1/versions")
        return _parse("GET /v1/versions", j, lambda j: [Version.from_json(v) for v in j.get("versions", [])])

    def status(self) -> Dict[str, Any]:
        """The run as the hub sees it (``GET /v1/status``, ``docs/observability.md``): versions,
        regions, actors (with their ``engine``), batches, faults — the dashboard's data, as a
        dict."""
        j = self._request("GET", "/v1/status")
        if not isinstance(j, dict):
            raise StarlingError("bad_response", f"GET /v1/status answered {j!r:.200}")
        return j

    def latest_version(self) -> int:
        """The newest published version number."""
        j = self._request("GET", "/v1/versions")
        return _parse("GET /v1/versions", j, lambda j: int(j["latest"]))

    def publish(
        self,
        path_or_state_dict: Union[PathLike, Mapping[str, Any]],
        step: Optional[int] = None,
        *,
        directory: Optional[PathLike] = None,
        name: Optional[str] = None,
        keep: bool = True,
        allow: Iterable[str] = (),
        handover: Optional[bool] = None,
    ) -> Version:
        """Publish a checkpoint as the next version and return it once the hub has stored it.

        * A path (a ``.safetensors`` file or a sharded directory, on the hub's machine) is sent
          as is (made absolute).
        * A state dict (``{name: torch.Tensor}``) is validated, cast to BF16 exactly as
          ``tensor.to(torch.bfloat16)`` does, written atomically into ``directory`` (or the
          client's ``checkpoint_dir``) as ``name`` (default ``step-NNNNNNNN.safetensors``, or a
          time-stamped name without a step), replacing a file of that name, then published by
          path. The directory must be readable by the hub under the same path. A state dict
          the SDK cannot publish (``invalid_state_dict``: not a tensor, not floating point, on
          the meta device) is refused before anything is written or sent; a file the hub
          refuses (``layout_mismatch`` when tensor names or shapes differ from the run's) is
          deleted. With ``keep=False`` the file is handed over (below) and deleted once
          published if the hub copied it instead.

        ``handover`` (default: ``not keep`` for a state dict, ``False`` for a path) gives the
        file to the hub: it renames it into its store instead of copying it, which saves
        writing the whole checkpoint a second time before the first delta segment. The hub
        takes it only when it can own it outright (one file, on the store's file system, with no
        other hard link) and copies it otherwise; ``Version.handed_over`` says which happened.
        A refused publish gives the file back. Do not write to a handed-over file again. An
        explicit ``handover=True`` gives the file away even with ``keep=True``.

        ``step`` is the trainer's own step number, recorded beside the version.

        The hub refuses NaN or ±Inf weights (``nonfinite_weights``), a checkpoint identical to
        the latest version (``unchanged``: a retried publish that already succeeded) and a
        step lower than the latest version's (``step_backwards``); ``allow`` names the checks
        to skip (``"nonfinite"``, ``"unchanged"``, ``"step_backwards"``). The path must lie in
        one of the hub's ``--publish-dir`` directories (``path_not_allowed``).
        """
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        allow = [str(a) for a in allow]
        if isinstance(path_or_state_dict, Mapping):
            hand = (not keep) if handover is None else bool(handover)
            return self._publish_state_dict(path_or_state_dict, step, directory, name, keep, allow, hand)
        path = os.path.abspath(os.fspath(path_or_state_dict))
        return self._publish_path(path, step, allow, bool(handover))

    def _publish_path(self, path: str, step: Optional[int], allow: List[str], handover: bool = False) -> Version:
        body: Dict[str, Any] = {"path": path}
        if step is not None:
            body["step"] = step
        if allow:
            body["allow"] = allow
        if handover:
            # Sent only when set: a hub that predates it refuses the unknown field.
            body["handover"] = True
        j = self._request("POST", "/v1/versions", body, timeout=self.publish_timeout)
        return _parse("POST /v1/versions", j, Version.from_json)

    def _publish_state_dict(
        self,
        state_dict: Mapping[str, Any],
        step: Optional[int],
        directory: Optional[PathLike],
        name: Optional[str],
        keep: bool,
        allow: List[str],
        handover: bool,
    ) -> Version:
        if name is not None and (os.sep in name or name in ("", ".", "..") or name.endswith(".tmp")):
            raise ValueError(f"name must be a plain file name not ending in .tmp, got {name!r}")
        prepared = prepare_state_dict(state_dict)
        d = os.fspath(directory) if directory is not None else self.checkpoint_dir
        if d is None:
            raise StarlingError(
                "no_checkpoint_dir",
                "publishing a state dict needs a directory the hub can read: "
                "publish(state_dict, step, directory=...) or Client(..., checkpoint_dir=...)",
            )
        if name is None:
            name = f"step-{step:08d}.safetensors" if step is not None else f"ckpt-{time.time_ns()}.safetensors"
        d = os.path.abspath(d)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise StarlingError(
                "no_checkpoint_dir", f"cannot create the checkpoint directory {d} ({_describe(e)})"
            ) from None
        path = os.path.join(d, name)
        try:
            write_bf16(prepared, path, None if step is None else {"step": str(step)})
        except OSError as e:
            raise StarlingError("write_failed", f"cannot write the checkpoint {path} ({_describe(e)})") from None
        published = False
        try:
            v = self._publish_path(path, step, allow, handover)
            published = True
            return v
        except StarlingError as e:
            # A 4xx answer means the hub did not publish it: leave no file that looks like a
            # checkpoint of the run. Without an answer it may have, so the file stays.
            if e.status is not None and 400 <= e.status < 500:
                _unlink_quietly(path)
            raise
        finally:
            # A handed-over file is the hub's now; one it copied instead is still ours.
            if published and not keep and not v.handed_over:
                _unlink_quietly(path)

    # ----------------------------------------------------------------------------------------
    # Batches

    def submit(
        self,
        groups: Iterable[GroupLike],
        sampling: Optional[SamplingLike] = None,
        max_staleness: Optional[int] = 1,
        version: Optional[int] = None,
    ) -> "Batch":
        """Submit a batch of groups and return its handle.

        ``groups``: :class:`Group` objects or dicts with the API's keys (``messages``,
        ``prompt`` or ``prompt_ids``, ``n``, ``verifier``, ``answer``, an optional ``sampling``
        override).
        ``sampling``: the batch's :class:`Sampling` (or dict); keys left out take the hub's
        defaults. ``max_staleness``: how many versions behind the newest a result's tokens may
        be (``None``: the hub's default, 1). ``version``: the policy version the batch is for
        (default: the latest published). A batch the hub refuses raises
        :class:`StarlingError` with its code (``invalid_batch``, ``unknown_verifier``,
        ``prompt_too_long``, ``unknown_version``, ``too_large``, ``bad_request``).
        """
        body: Dict[str, Any] = {"groups": [group_json(g) for g in groups]}
        s = sampling_json(sampling)
        if s is not None:
            body["sampling"] = s
        if max_staleness is not None:
            body["max_staleness"] = int(max_staleness)
        if version is not None:
            body["version"] = int(version)
        j = self._request("POST", "/v1/batches", body)
        return _parse(
            "POST /v1/batches",
            j,
            lambda j: Batch(
                self,
                int(j["batch"]),
                version=int(j["version"]),
                groups=j.get("groups"),
                samples=j.get("samples"),
                max_staleness=j.get("max_staleness"),
            ),
        )

    def batch(self, batch_id: int) -> "Batch":
        """A handle on an existing batch (e.g. to resume reading its results after a restart)."""
        st = self.batch_status(batch_id)
        return Batch(self, batch_id, version=st.version, groups=st.groups.total, max_staleness=st.max_staleness)

    def batch_status(self, batch_id: int) -> BatchStatus:
        """The batch's state, its groups by state, and the results refused by reason."""
        path = f"/v1/batches/{int(batch_id)}"
        return _parse(f"GET {path}", self._request("GET", path), BatchStatus.from_json)

    def cancel(self, batch_id: int) -> int:
        """Cancel a batch's pending and leased groups; returns how many were cancelled."""
        path = f"/v1/batches/{int(batch_id)}/cancel"
        return _parse(f"POST {path}", self._request("POST", path), lambda j: int(j["cancelled"]))

    def results_page(
        self, batch_id: int, after: int = 0, limit: int = 64, wait_ms: int = 0
    ) -> "ResultsPage":
        """One long poll of ``GET /v1/batches/{id}/results``: the accepted groups after cursor
        ``after`` (at most ``limit``), waiting up to ``wait_ms`` (at most 30 s) for one."""
        wait_ms = max(0, min(int(wait_ms), MAX_WAIT_MS))
        path = f"/v1/batches/{int(batch_id)}/results"
        j = self._request(
            "GET",
            path,
            query={"after": int(after), "limit": int(limit), "wait_ms": wait_ms},
            timeout=max(self.timeout, wait_ms / 1000.0 + 30.0),
        )
        return _parse(
            f"GET {path}",
            j,
            lambda j: ResultsPage([Rollout.from_json(r) for r in j["results"]], int(j["cursor"]), bool(j["done"])),
        )


class ResultsPage:
    """One answer of the results endpoint: accepted groups, the cursor to resume after, and
    whether the batch is finished with nothing after ``cursor``."""

    __slots__ = ("results", "cursor", "done")

    def __init__(self, results: List[Rollout], cursor: int, done: bool):
        self.results = results
        self.cursor = cursor
        self.done = done

    def __repr__(self) -> str:
        return f"ResultsPage({len(self.results)} results, cursor={self.cursor}, done={self.done})"


class Batch:
    """A submitted batch. ``cursor`` is the cursor of the last rollout :meth:`results` yielded:
    pass it as ``after`` to resume (also from another process, via ``Client.batch(id)``)."""

    def __init__(
        self,
        client: Client,
        batch_id: int,
        version: int,
        groups: Optional[int] = None,
        samples: Optional[int] = None,
        max_staleness: Optional[int] = None,
    ):
        self.client = client
        self.id = batch_id
        self.version = version
        self.groups = groups
        self.samples = samples
        self.max_staleness = max_staleness
        self.cursor = 0
        # Failed groups by reason, once :meth:`results` has run to the batch's end.
        self.failures: Optional[Dict[str, int]] = None

    def __repr__(self) -> str:
        return f"Batch(id={self.id}, version={self.version}, groups={self.groups})"

    def status(self) -> BatchStatus:
        return self.client.batch_status(self.id)

    def cancel(self) -> int:
        """Cancel the pending and leased groups; returns how many were cancelled. Accepted
        results stay readable."""
        return self.client.cancel(self.id)

    def results(
        self,
        after: Optional[int] = None,
        wait_ms: int = 10_000,
        limit: int = 64,
        timeout: Optional[float] = None,
        strict: bool = False,
    ) -> Iterator[Rollout]:
        """Every accepted group after ``after`` (default: where this handle's iteration stopped),
        each exactly once in cursor order, until the batch is finished (done or cancelled) and
        nothing remains. Long-polls ``wait_ms`` at a time. ``timeout`` (seconds, default none)
        bounds the whole iteration: past it, ``StarlingError("timeout")`` is raised and the
        iteration can be resumed with ``after=batch.cursor``.

        Groups that ended without a result (out of attempts, their reward service failed,
        their result too large, the batch cancelled) yield nothing: at the end ``failures``
        holds their counts by reason (only reasons with any), and with ``strict=True`` the
        iteration ends by raising ``StarlingError("groups_failed")`` naming them."""
        cursor = self.cursor if after is None else int(after)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = wait_ms
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StarlingError(
                        "timeout",
                        f"batch {self.id} not finished within {timeout:g} s; resume with results(after={cursor})",
                    )
                wait = min(wait, int(left * 1000))
            page = self.client.results_page(self.id, after=cursor, limit=limit, wait_ms=wait)
            for r in page.results:
                if r.cursor <= cursor:  # never yield a group twice, whatever the hub sends
                    continue
                cursor = r.cursor
                self.cursor = cursor
                yield r
            cursor = max(cursor, page.cursor)
            if page.done:
                failed = {k: v for k, v in self.status().failures.items() if v}
                self.failures = failed
                if strict and failed:
                    said = ", ".join(f"{n} {reason}" for reason, n in sorted(failed.items()))
                    raise StarlingError(
                        "groups_failed",
                        f"batch {self.id} finished with groups that delivered no result: {said}",
                    )
                return

    def collect(self, **kwargs: Any) -> List[Rollout]:
        """``list(self.results(**kwargs))``."""
        return list(self.results(**kwargs))


def _parse(what: str, j: Any, parse: Callable[[Mapping[str, Any]], T]) -> T:
    """``parse(j)``, with any shape the API does not promise reported as ``bad_response``."""
    if not isinstance(j, Mapping):
        raise StarlingError("bad_response", f"{what} answered {j!r:.200} where a JSON object was expected")
    try:
        return parse(j)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise StarlingError("bad_response", f"{what} answered {j!r:.200}") from None


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _describe(e: Any) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__
