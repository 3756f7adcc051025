"""The SDK's one exception type, :class:`StarlingError`.

One type, with the hub's machine-readable ``code``, so that a trainer can catch every failure of
a hub call in one place and branch on the code, as the hub's own API does (``docs/api.md``,
"Errors"). Python's own ``ValueError``/``TypeError`` are kept for calls that are wrong in
themselves (a negative step, a token *and* a credentials directory), which no retry can fix.
"""

from __future__ import annotations

from typing import Optional


class StarlingError(Exception):
    """A request the hub refused, a hub that could not be reached, or input the SDK refused.

    ``code`` is machine-readable and stable:

    * for an HTTP answer outside 2xx it is the hub's own ``code`` (``bad_request``,
      ``invalid_batch``, ``unknown_verifier``, ``prompt_too_long``, ``unauthorized``,
      ``not_found``, ``layout_mismatch``, ``unknown_version``, ``batch_finished``,
      ``too_large``, ``unreadable_checkpoint``, ``nonfinite_weights``, ``unchanged``,
      ``step_backwards``, ``path_not_allowed``, ``too_many_connections``, ``internal``; see
      ``docs/api.md``) and
      ``status`` is the HTTP status (an answer without the hub's JSON gets ``http_<status>``);
    * ``unreachable``: no connection to the hub (``status`` is ``None``);
    * ``timeout``: the hub accepted the connection but did not answer in time, or
      ``Batch.results(timeout=...)`` ran out;
    * ``bad_response``: a 2xx answer that is not the JSON the API promises;
    * ``bad_credentials``: the credentials directory has no readable, non-empty ``token``;
    * ``invalid_state_dict``, ``no_checkpoint_dir``: the SDK refused a ``publish`` before
      writing or sending anything; ``write_failed``: writing the checkpoint failed (nothing
      was sent, no partial file is left);
    * ``groups_failed``: ``Batch.results(strict=True)`` reached the end of a batch some of
      whose groups delivered no result (the message counts them by reason).

    ``message`` is a sentence that says what to fix. ``status`` is ``None`` for every code the
    SDK raises itself.
    """

    def __init__(self, code: str, message: str, status: Optional[int] = None):
        super().__init__(f"{code}: {message}" if status is None else f"{code} ({status}): {message}")
        self.code = code
        self.message = message
        self.status = status

    def __repr__(self) -> str:
        return f"StarlingError(code={self.code!r}, message={self.message!r}, status={self.status!r})"
