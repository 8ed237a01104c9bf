"""Rewards scored by a service over HTTP: a served reward model (``rlhf-torchrl
serve-reward-model``, :mod:`rlhf_torchrl.rewards.server`; OpenRLHF's ``serve_rm``) or any endpoint
that scores responses (a verifier, an LLM judge).

Request: ``POST`` to the URL, JSON, one entry per response in the same order::

    {"prompts":   ["<prompt as the policy saw it, chat template applied>", ...],
     "responses": ["<response, decoded without special tokens>", ...],
     "query":     ["<prompt + response + the policy's stop token where it stopped>", ...],
     "has_stop":  [true, ...],              # whether each response ended with its stop token
     "messages":  [[{"role": "user", "content": "..."}], ...],  # each prompt's conversation
     "labels":    [...],                    # the column reward.remote_label_column names
     "fields":    {"<dataset column>": [...], ...}}              # every dataset column

``messages`` is sent when the rollout has the conversations, ``labels`` when a column is named;
a header ``Authorization: Bearer <token>`` when ``token_env`` names the variable that holds it.
Answer: ``{"rewards": [<float>, ...]}``, one per response (``"scores"`` is read where
``"rewards"`` is missing). That is OpenRLHF's remote reward API (``--remote_rm_url``: it sends
``query``, ``prompts`` and ``labels`` and reads ``rewards``), so an OpenRLHF reward server works
as it is; what it does not read it ignores.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.http_client import ServiceError, post_json
from rlhf_torchrl.rewards.scoring import RewardError

log = logging.getLogger(__name__)

#: seconds before the first retry (then doubled each time, at most :data:`MAX_BACKOFF`)
BACKOFF = 1.0
MAX_BACKOFF = 30.0


def is_url(text: str) -> bool:
    """Whether a reward names an HTTP endpoint rather than a function's dotted path.

    Args:
        text: a reward's name, as configured.
    """
    return text.startswith(("http://", "https://"))


def url_name(url: str, full: bool = False) -> str:
    """A metric name for the reward at ``url``: its last path segment (``score``), else its host;
    ``full``: host, port and path (where two rewards share the short name). ``/`` and ``:``
    become ``_`` (metric names are paths of the CSV logger).

    Args:
        url: the reward's URL.
        full: the long form, host, port and path.
    """
    parts = urlsplit(url)
    name = (f"{parts.netloc}{parts.path}" if full
            else parts.path.rstrip("/").rsplit("/", 1)[-1] or parts.netloc)
    return name.strip("/").replace("/", "_").replace(":", "_")


def bearer_token(token_env: str | None, setting: str = "reward.remote_token_env") -> str | None:
    """The token in environment variable ``token_env`` (None without one); an unset or empty
    variable is an error naming ``setting``.

    Args:
        token_env: the environment variable's name (None: no token).
        setting: the setting that named it, for the error.
    """
    if not token_env:
        return None
    token = os.environ.get(token_env, "")
    if not token:
        raise ConfigError(f"{setting}={token_env}: the environment variable {token_env} is not set "
                          f"(or empty): export {token_env}=<the server's token>, or drop the setting.")
    return token


class RemoteReward:
    """Scores responses by POSTing them to ``url`` (the module docstring gives the format): a
    reward function for :class:`~rlhf_torchrl.rewards.scoring.Scorer`.

    The scores come back in the rows' order. A refused connection, a timeout or a 429/5xx answer is
    tried again, with one warning when it first fails. Each request has ``timeout`` seconds of
    wall-clock time in all (a service that trickles its answer is cut off), and a redirect is an
    error, never followed: the token goes to ``url`` alone (:mod:`~rlhf_torchrl.http_client`). A service that stays down,
    an error answer (400, 401, 413, ...) or an answer other than one number per response raises
    :class:`~rlhf_torchrl.rewards.scoring.RewardError`, one line naming the URL and what came back: the
    run stops before its update, its last checkpoint intact. No score is ever made up.

    Args:
        url: the scoring endpoint.
        name: the reward's name in errors and metrics.
        token_env: the environment variable holding a bearer token (None: no token).
        timeout: seconds of wall-clock time each request may take, connect to last byte.
        retries: tries after the first, for a refused connection, a timeout or a 429/5xx answer.
        batch_size: responses per request.
        concurrency: requests in flight at once.
        label_column: the dataset column sent as ``labels`` (None: none).
        stop_text: appended to ``query`` where a response ended with its stop token (the policy's
            stop token as text).
        backoff: the first retry's wait in seconds, doubled each retry (at most 30).

    Example:
        >>> reward = RemoteReward("http://127.0.0.1:8000/score", name="reward_model")
        >>> reward(prompts, responses, rollout)  # (B,) float32
    """

    def __init__(self, url: str, *, name: str = "remote", token_env: str | None = None,
                 timeout: float = 60.0, retries: int = 8, batch_size: int = 64,
                 concurrency: int = 4, label_column: str | None = None, stop_text: str = "",
                 backoff: float = BACKOFF):
        if not is_url(url):
            raise ConfigError(f"Reward {name!r}: {url!r} is not an http:// or https:// URL (a "
                              "served reward model: http://HOST:PORT/score).")
        if timeout <= 0 or retries < 0 or batch_size < 1 or concurrency < 1:
            raise ConfigError(f"Reward {name!r}: timeout must be > 0, retries >= 0, batch_size and "
                              f"concurrency >= 1; got {timeout}, {retries}, {batch_size}, {concurrency}.")
        self.url, self.name, self.token_env = url, name, token_env
        self.token = bearer_token(token_env)
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), backoff
        self.batch_size, self.concurrency = int(batch_size), int(concurrency)
        self.label_column, self.stop_text = label_column, stop_text
        self._lock = threading.Lock()
        self._down = False  # warned that the service does not answer; cleared by its next answer

    def __call__(self, prompts: list[str], responses: list[str],
                 tensordict: TensorDictBase) -> torch.Tensor:
        rows = self.request_rows(prompts, responses, tensordict)
        requests = [{k: v[i:i + self.batch_size] if isinstance(v, list)
                     else {c: col[i:i + self.batch_size] for c, col in v.items()}
                     for k, v in rows.items()} for i in range(0, len(responses), self.batch_size)]
        if len(requests) <= 1 or self.concurrency == 1:
            scores = [self._score(request) for request in requests]
        else:
            with ThreadPoolExecutor(min(self.concurrency, len(requests))) as pool:
                scores = list(pool.map(self._score, requests))
        return torch.tensor([s for chunk in scores for s in chunk], dtype=torch.float32)

    def request_rows(self, prompts: list[str], responses: list[str],
                     tensordict: TensorDictBase) -> dict:
        """The request's fields for every row (the module docstring's format).

        Args:
            prompts: the rendered prompts.
            responses: the decoded responses.
            tensordict: the rollout (``has_stop_token``, the conversations, the label column).
        """
        keys = tensordict.keys(True)
        has_stop = (tensordict.get(K.HAS_STOP).tolist() if K.HAS_STOP in keys
                    else [True] * len(responses))
        rows = {"prompts": list(prompts), "responses": list(responses),
                "query": [p + r + (self.stop_text if s else "")
                          for p, r, s in zip(prompts, responses, has_stop)],
                "has_stop": [bool(s) for s in has_stop]}
        if K.PROMPT_MESSAGES in keys:
            rows["messages"] = tensordict.get(K.PROMPT_MESSAGES).tolist()
        columns = list(tensordict.get(K.DATA).keys()) if K.DATA in tensordict.keys() else []
        fields = {c: tensordict.get((K.DATA, c)).tolist() for c in columns}
        if self.label_column is not None:
            if self.label_column not in fields:
                raise ConfigError(f"reward.remote_label_column={self.label_column} is not a dataset "
                                  f"column: the prompts carry {sorted(fields) or 'no columns'}.")
            rows["labels"] = fields[self.label_column]
        rows["fields"] = fields
        return rows

    def _score(self, request: dict) -> list[float]:
        """POST one request; its scores, or a :class:`RewardError` saying what went wrong."""
        n = len(request["responses"])
        try:
            body = json.dumps(request, default=str).encode("utf-8")
        except (TypeError, ValueError) as e:
            raise RewardError(f"Reward {self.name!r}: the request cannot be written as JSON ({e}): "
                              "keep the dataset columns to strings, numbers and lists.") from None
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        start, limit = time.monotonic(), 64 * n + 65536  # an answer's bytes: ~40 a number
        try:
            answer = post_json(self.url, body, attempts=self.retries + 1, timeout=self.timeout,
                               backoff=self.backoff, max_backoff=MAX_BACKOFF, headers=headers,
                               max_bytes=limit, on_retry=self._warn_retry)
        except ServiceError as e:
            raise RewardError(self._failure(e, len(body), n, time.monotonic() - start)) from None
        with self._lock:
            if self._down:
                log.warning("Reward %r: the service at %s answers again.", self.name, self.url)
            self._down = False
        if len(answer) > limit:
            raise RewardError(f"Reward {self.name!r}: the service at {self.url} answered {n} "
                              f"responses with more than {limit} bytes: not a list of scores.")
        return self._scores(answer, n)

    def _warn_retry(self, failure: str, attempt: int) -> None:
        with self._lock:
            if self._down:
                return
            self._down = True
        waits = [min(self.backoff * 2**k, MAX_BACKOFF) for k in range(self.retries)]
        log.warning("Reward %r: the service at %s did not answer (%s); trying again %d more "
                    "time(s) over about %.0f s.", self.name, self.url, failure,
                    self.retries - attempt + 1, sum(waits[attempt - 1:]))

    def _failure(self, error: ServiceError, size: int, n: int, waited: float) -> str:
        """The one line that says what went wrong and what to do."""
        where = f"Reward {self.name!r}: the service at {self.url}"
        said = f" ({error.detail})" if error.detail else ""
        if error.status == 401 or error.status == 403:
            fix = (f"the token in ${self.token_env} is not the server's" if self.token else
                   "it wants a bearer token: set reward.remote_token_env to the environment "
                   "variable that holds it")
            return f"{where} refused the request: {error.failure}{said}; {fix}."
        if error.status is not None and 300 <= error.status < 400:
            return (f"{where} answered {error.failure}: a redirect is never followed, so the "
                    "request and its token go to the configured URL alone; set reward.remote_url "
                    "to the URL that scores.")
        if error.status == 413:
            return (f"{where} refused a request of {n} responses ({size} bytes) as too large: "
                    f"{error.failure}{said}; lower reward.remote_batch_size.")
        if error.status is not None and error.status < 500 and error.status != 429:
            return (f"{where} refused the request: {error.failure}{said}; is reward.remote_url "
                    "the scoring endpoint (e.g. http://HOST:PORT/score)?")
        return (f"{where} did not answer after {error.attempts} attempt"
                f"{'s' * (error.attempts != 1)} over {waited:.0f} s (last: {error.failure}{said}); "
                "no score was made up: the run stops here, before any update uses one; once the "
                "service is up, the same command continues from the last checkpoint (resume=auto). "
                "More patience: reward.remote_retries, reward.remote_timeout.")

    def _scores(self, answer: bytes, n: int) -> list[float]:
        where = f"Reward {self.name!r}: the service at {self.url}"
        try:
            parsed = json.loads(answer)
        except ValueError:
            shown = answer[:80].decode("utf-8", "replace")
            raise RewardError(f'{where} answered with something other than JSON {{"rewards": '
                              f'[...]}}: {shown!r}.') from None
        scores = None
        if isinstance(parsed, dict):
            scores = parsed.get("rewards", parsed.get("scores"))
        if not isinstance(scores, list) or not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
            shown = json.dumps(parsed)[:80]
            raise RewardError(f'{where} answered without a list of numbers under "rewards" '
                              f"(or \"scores\"): {shown}.")
        if len(scores) != n:
            raise RewardError(f"{where} returned {len(scores)} scores for {n} responses: it must "
                              "return one per response, in order.")
        return [float(s) for s in scores]  # a NaN/inf is left to the divergence guards
