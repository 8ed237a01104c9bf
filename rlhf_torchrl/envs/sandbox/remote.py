"""A sandbox service over HTTP: SandboxFusion's ``run_code`` API, as verl's client speaks it.

Request (JSON, ``POST`` to the endpoint, e.g. ``http://HOST:8080/run_code``)::

    {"code": "...", "language": "python", "compile_timeout": 10, "run_timeout": 10,
     "memory_limit_MB": 512, "stdin": "", "files": {}, "fetch_files": []}

Answer: ``{"status": "Success" | "Failed" | "SandboxError", "message": "...",
"run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code": 0,
"stdout": "...", "stderr": "...", "execution_time": 0.01}, ...}``. The service runs the code in
its own isolation (SandboxFusion: containers); processes, scratch space and network are its
settings, not this request's.
"""

from __future__ import annotations

import json
import logging
import time

from rlhf_torchrl.envs.sandbox import Execution, SandboxSpec
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.http_client import ServiceError, post_json

log = logging.getLogger(__name__)

#: seconds past the run's own limit the service may take to answer (queueing, start-up, network):
#: less than :data:`~rlhf_torchrl.envs.tools.ANSWER_GRACE`, so a call made by ``run_tool`` has ended its
#: request, socket closed, before ``run_tool`` stops waiting for it: no thread outlives the call
ANSWER_SLACK = 0.5


class RemoteSandbox:
    """Runs Python code on a SandboxFusion-compatible service at ``spec.url``.

    A call's HTTP requests get the run's limit plus :data:`ANSWER_SLACK`, in wall-clock time for
    them all: a service that trickles its answer is cut off then; a refused connection, a dropped
    one or an answer in :data:`~rlhf_torchrl.http_client.RETRY_STATUSES` is tried again, as long
    as the run's time allows (:func:`~rlhf_torchrl.http_client.post_json`). A redirect is an
    error, never followed. A
    service that stays down gives an :class:`~.Execution` ending in ``"error"`` whose message says
    so (and a warning in the log, once until it answers again).

    Args:
        spec: the limits and the service's ``url``.
        retries: requests in all.
        backoff: the first wait between requests, in seconds, doubled each time.

    Example::

        >>> RemoteSandbox(SandboxSpec(kind="remote", url="http://localhost:8080/run_code"))
    """

    def __init__(self, spec: SandboxSpec, *, retries: int = 3, backoff: float = 0.5):
        if not spec.url:
            raise ConfigError("env.python_sandbox=remote needs the service's run_code endpoint: "
                              "set env.sandbox_url (http://HOST:8080/run_code).")
        if not spec.url.startswith(("http://", "https://")):
            raise ConfigError(f"env.sandbox_url={spec.url!r} is not an http:// or https:// URL "
                              "(SandboxFusion's endpoint: http://HOST:8080/run_code).")
        self.spec, self.retries, self.backoff = spec, retries, backoff
        self._down = False  # warned that the service is down; cleared by its next answer

    def request(self, code: str, timeout: float) -> bytes:
        """The ``run_code`` request body for ``code`` with the config's limits.

        Args:
            code: the Python source.
            timeout: the run's limit, in seconds.
        """
        return json.dumps({"code": code, "language": "python", "compile_timeout": timeout,
                           "run_timeout": timeout, "memory_limit_MB": self.spec.memory_mb,
                           "stdin": "", "files": {}, "fetch_files": []}).encode("utf-8")

    def run(self, code: str, timeout: float | None = None) -> Execution:
        """Run ``code`` on the service; ``timeout`` (seconds, at most ``spec.timeout``) sooner.

        Args:
            code: the Python source.
            timeout: seconds, at most ``spec.timeout`` (None: ``spec.timeout``).
        """
        timeout = self.spec.timeout if timeout is None else min(self.spec.timeout, timeout)
        try:
            # the service's JSON escapes its output: a few times the bound, at most
            answer = post_json(self.spec.url, self.request(code, timeout), attempts=self.retries,
                               deadline=time.monotonic() + timeout + ANSWER_SLACK,
                               backoff=self.backoff, max_bytes=4 * self.spec.max_output_bytes + 65536)
        except ServiceError as e:
            message = (f"the sandbox service at {self.spec.url} did not answer ({e.attempts} "
                       f"attempt{'s' * (e.attempts != 1)}; last: {e.failure})")
            if e.status is not None and 300 <= e.status < 400:
                message = (f"the sandbox service at {self.spec.url} answered {e.failure}: set "
                           "env.sandbox_url to the run_code endpoint itself")
            if not self._down:
                log.warning("The python tool's %s: its calls fail until it answers.", message)
            self._down = True
            return Execution("", "error", message=message)
        if self._down:
            log.warning("The sandbox service at %s answers again.", self.spec.url)
        self._down = False
        return self._execution(answer)

    def _execution(self, answer: bytes) -> Execution:
        if len(answer) > 4 * self.spec.max_output_bytes + 65536:
            return Execution("", "output_limit")
        try:
            result = json.loads(answer)
            run = result.get("run_result") or {}
            output = ((run.get("stdout") or "") + (run.get("stderr") or "")).encode("utf-8")
        except (ValueError, AttributeError, TypeError):
            return Execution("", "error", message=f"the sandbox service at {self.spec.url} "
                             "answered with something other than run_code's JSON")
        text = output[:self.spec.max_output_bytes].decode("utf-8", "replace").strip()
        if len(output) > self.spec.max_output_bytes:
            return Execution(text, "output_limit")
        if result.get("status") == "SandboxError" or not run:
            return Execution(text, "error", message="the sandbox service failed: "
                             f"{result.get('message') or result.get('status')}")
        if run.get("status") == "TimeLimitExceeded":
            return Execution(text, "timeout")
        returncode = run.get("return_code")
        if returncode is None:  # "Error": it could not run
            returncode = 0 if run.get("status") == "Finished" else 1
        return Execution(text, "exit", returncode=int(returncode))
