"""POST a JSON request to a service, with a deadline, retries and backoff: what the sandbox
service's client (:mod:`rlhf_torchrl.envs.sandbox.remote`) and the remote rewards
(:mod:`rlhf_torchrl.rewards.remote`) share. Python's own ``http.client``: no dependency.

A refused or dropped connection, a timeout and an answer in :data:`RETRY_STATUSES` are tried
again, after ``backoff``, ``2 * backoff``, ... seconds (at most ``max_backoff``); any other HTTP
error ends the tries at once (the request itself is wrong: a 400, a 401, a 413). What did not
work raises :class:`ServiceError`, which says why in a few words.

What a service cannot do to the caller:

- hold it past the deadline: a request's time is wall-clock time for the whole exchange (connect,
  send, headers, body), not per read: a service that trickles a byte at a time is cut off at the
  deadline, its socket shut and closed, and the call returns (no thread is left reading);
- send it elsewhere: no redirect is followed (a 3xx is an error naming its ``Location``), so the
  body and the headers (a bearer token) go to ``url`` alone;
- flood it: at most ``max_bytes + 1`` bytes of an answer are read.

Example::

    >>> post_json("http://127.0.0.1:8000/score", b'{"responses": []}', attempts=3, timeout=10)
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import threading
import time
from urllib.parse import urlsplit

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
        url: the endpoint (``http://`` or ``https://``).
        body: the JSON request body.
        attempts: requests in all.
        timeout: seconds of wall-clock time each may take, from connecting to the answer's last
            byte (None: up to the deadline).
        deadline: a ``time.monotonic()`` instant: no request starts, nor waits, past it, and each
            gets the time left at most (None: none).
        backoff: the first wait between requests in seconds, doubled each time.
        max_backoff: the longest wait, in seconds.
        headers: extra request headers (sent to ``url`` only: no redirect is followed).
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
        try:
            status, reason, answer, location = _exchange(url, body, headers or {}, wait, max_bytes)
        except (OSError, http.client.HTTPException) as e:
            failure, status, detail = _failure(e, wait), None, ""
        else:
            if 200 <= status < 300:
                return answer
            failure, detail = f"HTTP {status} {reason}", _error_detail(answer)
            if 300 <= status < 400:
                failure += f" to {location or '(no Location)'}: not followed"
                break
            if status not in RETRY_STATUSES:
                break
        if attempt + 1 < attempts:
            pause = min(backoff * 2**attempt, max_backoff)
            if deadline is not None:
                pause = min(pause, max(0.0, deadline - time.monotonic()))
            if on_retry is not None:
                on_retry(failure, attempt + 1)
            time.sleep(pause)
    raise ServiceError(failure, sent, status, detail)


def _exchange(url: str, body: bytes, headers: dict[str, str], wait: float,
              max_bytes: int) -> tuple[int, str, bytes, str | None]:
    """One POST, over within ``wait`` seconds of wall-clock time: (status, reason, the answer's
    first ``max_bytes + 1`` bytes, its ``Location``). Raises :class:`TimeoutError` at the limit.

    A socket's timeout bounds each read, not their sum, so a watchdog shuts the socket down at the
    limit: a blocked read then returns at once, and the connection is closed before this returns.
    """
    parts = urlsplit(url)
    connection_class = (http.client.HTTPSConnection if parts.scheme == "https"
                        else http.client.HTTPConnection)
    limit = None if wait == math.inf else wait
    connection = connection_class(parts.hostname, parts.port, timeout=limit)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    cut = threading.Event()

    def shut() -> None:
        cut.set()
        sock = connection.sock
        if sock is not None:
            try:  # the plain socket's shutdown: it wakes a read blocked in another thread
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(limit, shut) if limit is not None else None
    if watchdog is not None:
        watchdog.daemon = True
        watchdog.start()
    try:
        connection.request("POST", target, body=body, headers={
            "Content-Type": "application/json", "Accept": "application/json",
            "Connection": "close", **headers})
        response = connection.getresponse()
        answer = response.read(max_bytes + 1)
        if cut.is_set():  # what came before the cut may look whole: it is not the answer
            raise TimeoutError("timed out")
        return response.status, response.reason, answer, response.getheader("Location")
    except (OSError, http.client.HTTPException, ValueError) as e:
        if cut.is_set():
            raise TimeoutError("timed out") from None
        if isinstance(e, ValueError):  # a read on a socket the watchdog closed under it
            raise OSError(str(e)) from None
        raise
    finally:
        if watchdog is not None:
            watchdog.cancel()
            watchdog.join()
        connection.close()


def _failure(error: BaseException, wait: float) -> str:
    """A transport failure in a few words (a timeout names its limit)."""
    if isinstance(error, TimeoutError) or "timed out" in str(error):
        return f"no answer within {wait:g} s"
    if isinstance(error, http.client.RemoteDisconnected):
        return "the connection closed without an answer"
    return str(error) or type(error).__name__


def _error_detail(answer: bytes) -> str:
    """What an error answer says: its JSON ``error`` or ``detail`` field, else its first 200
    characters."""
    text = answer[:4096].decode("utf-8", "replace").strip()
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict):
            text = str(parsed.get("error") or parsed.get("detail") or text)
    except ValueError:
        pass
    return " ".join(text.split())[:200]
