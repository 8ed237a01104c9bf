"""POST a JSON request to a service, with a timeout, retries and backoff: what the sandbox
service's client (:mod:`rlhf_torchrl.sandbox.remote`) and the remote rewards
(:mod:`rlhf_torchrl.remote_rewards`) share. Python's own ``urllib``: no dependency.

A refused or dropped connection, a timeout and an answer in :data:`RETRY_STATUSES` are tried
again, after ``backoff``, ``2 * backoff``, ... seconds (at most ``max_backoff``); any other HTTP
error ends the tries at once (the request itself is wrong: a 400, a 401, a 413). What did not
work raises :class:`ServiceError`, which says why in a few words.

Example::

    >>> post_json("http://127.0.0.1:8000/score", b'{"responses": []}', attempts=3, timeout=10)
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request

#: answers worth another try: the service is busy, restarting, or behind a gateway that gave up
RETRY_STATUSES = (429, 500, 502, 503, 504)


class ServiceError(RuntimeError):
    """A service that gave no usable answer.

    Args:
        failure: the last failure, in a few words.
        attempts: how many requests went out.
        status: the last HTTP status (None: no answer came).
        detail: the start of an error answer's body, when it had one.
    """

    def __init__(self, failure: str, attempts: int, status: int | None = None, detail: str = ""):
        self.failure, self.attempts, self.status, self.detail = failure, attempts, status, detail
        super().__init__(f"{failure} ({attempts} attempt{'s' * (attempts != 1)})")


def post_json(url: str, body: bytes, *, attempts: int, timeout: float | None = None,
              deadline: float | None = None, backoff: float = 0.5, max_backoff: float = math.inf,
              headers: dict[str, str] | None = None, max_bytes: int = 1 << 20,
              on_retry=None) -> bytes:
    """POST ``body`` (JSON) to ``url``; the answer's body, at most ``max_bytes + 1`` bytes (the
    caller tells an answer that is too long by its length).

    Raises :class:`ServiceError`.

    Args:
        url: the endpoint.
        body: the JSON request body.
        attempts: requests in all.
        timeout: seconds each may take (None: up to the deadline).
        deadline: a ``time.monotonic()`` instant: no request starts, nor waits, past it, and each
            gets the time left at most (None: none).
        backoff: the first wait between requests in seconds, doubled each time.
        max_backoff: the longest wait, in seconds.
        headers: extra request headers.
        max_bytes: the longest answer wanted, in bytes.
        on_retry (Callable | None): ``(failure, attempt)``, called before each wait (for a log
            line).
    """
    failure, status, detail, sent = "no time left", None, "", 0
    for attempt in range(attempts):
        left = math.inf if deadline is None else deadline - time.monotonic()
        if left <= 0:
            break
        wait = min(left, timeout if timeout is not None else math.inf)
        sent += 1
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(request, timeout=None if wait == math.inf else wait) as answer:
                return answer.read(max_bytes + 1)
        except urllib.error.HTTPError as e:
            failure, status, detail = f"HTTP {e.code} {e.reason}", e.code, _error_detail(e)
            if e.code not in RETRY_STATUSES:
                break
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            failure, status, detail = _failure(reason, wait), None, ""
        if attempt + 1 < attempts:
            pause = min(backoff * 2**attempt, max_backoff)
            if deadline is not None:
                pause = min(pause, max(0.0, deadline - time.monotonic()))
            if on_retry is not None:
                on_retry(failure, attempt + 1)
            time.sleep(pause)
    raise ServiceError(failure, sent, status, detail)


def _failure(reason, wait: float) -> str:
    """A transport failure in a few words (a timeout names its limit)."""
    if isinstance(reason, TimeoutError) or "timed out" in str(reason):
        return f"no answer within {wait:g} s"
    return str(reason) or type(reason).__name__


def _error_detail(error: urllib.error.HTTPError) -> str:
    """What an error answer says: its JSON ``error`` or ``detail`` field, else its first 200
    characters."""
    try:
        text = error.read(4096).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict):
            text = str(parsed.get("error") or parsed.get("detail") or text)
    except ValueError:
        pass
    return " ".join(text.split())[:200]
