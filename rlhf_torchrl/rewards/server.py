"""A reward model served over HTTP: ``rlhf-torchrl serve-reward-model model=<dir or id>``.

The stack is Starlette (the ASGI toolkit FastAPI is built on) under uvicorn, the ASGI server vLLM,
Ray Serve and OpenRLHF's ``serve_rm`` run on: two small, maintained packages (``pip install
'rlhf_torchrl[serve]'``) with streamed request bodies, graceful shutdown and nothing else. The
trainer's side needs neither (:mod:`rlhf_torchrl.rewards.remote` speaks HTTP with Python's own
``urllib``).

Endpoints:

- ``POST /score`` (also ``/get_reward``, OpenRLHF's path): the request of
  :mod:`rlhf_torchrl.rewards.remote` (``prompts``, ``responses``, ``messages``, ``has_stop``):
  the server renders each conversation with the reward model's own chat template and tokenizer,
  as the in-process :class:`~rlhf_torchrl.rewards.reward_model.RewardModel` does, so the scores are the same.
  OpenRLHF's ``{"query": [text, ...]}`` alone is scored as given. Answer: ``{"rewards": [...],
  "scores": [...]}`` (the same numbers under both of OpenRLHF's names).
- ``GET /health``: ``{"status": "ok"}`` to anyone (a load balancer's probe needs no secret);
  with the token (or on a server without one) also the counters ``requests``, ``rounds``,
  ``texts`` and ``queued``, which say how busy the server is.

Batching: requests wait in one queue; a round takes every request waiting, up to ``max_batch``
texts (a request is never split), after waiting ``max_wait`` seconds for others to join the
first, and scores them together (in forwards of the model's ``batch_size``) on a thread of its
own, so the server keeps answering while the model runs.

Who gets in: the server binds ``127.0.0.1`` unless told otherwise; with a token, every ``POST``
needs ``Authorization: Bearer <token>`` (compared with :func:`hmac.compare_digest`, in constant
time), else 401, answered from the headers: an unknown caller's body is never read into memory (a
small one is dropped as it arrives, so the caller reads its 401; a larger one, over
:data:`SMALL_BODY` bytes or of unknown length, has its connection closed).

Bounds, each answered before the request reaches the queue, so the other callers' requests are
never dropped: a body must arrive within ``body_timeout`` seconds (else 408) and hold at most
``max_request_bytes`` (else 413) and ``max_request_responses`` responses (else 413); JSON that is
malformed or nested too deeply for the parser, or fields of the wrong type, get 400; a text of
more than ``max_text_tokens`` tokens as the reward model reads it gets 400 (it is refused, not
cut: a cut text would get another text's score; under the bound the model cuts a text to its own
``max_length`` from the left, as in-process). A text of more than
``max_text_tokens * MAX_CHARS_PER_TOKEN`` characters is refused before it is tokenized, so
counting its tokens cannot hold the server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from rlhf_torchrl.errors import ConfigError, MissingDependencyError

log = logging.getLogger(__name__)

#: the bodies a client sends past ``max_request_bytes`` that are read and dropped before the 413
#: (a server that closes a connection with unread data makes the client's kernel discard the
#: answer: the client would see a reset, not the 413), as a multiple of the limit
DRAIN_FACTOR = 8
#: the largest body of an unknown caller dropped as it arrives (its 401 then reaches it); a larger
#: one has its connection closed after the 401 (what a socket's buffers hold anyway)
SMALL_BODY = 64 << 10
#: characters per token no text averages (English runs near 4, code near 3): a longer text is over
#: ``max_text_tokens`` without counting
MAX_CHARS_PER_TOKEN = 16


#: the header that has the server close the connection after its answer (a body left unread)
CLOSE = {"Connection": "close"}


class RequestError(Exception):
    """A request the server refuses.

    Args:
        status: the HTTP status (4xx).
        message: the error, for the caller.
    """

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class Batcher:
    """Scores the texts of concurrent requests together: ``await batcher.score(texts)``.

    ``score_fn`` runs on one worker thread, a round at a time; a round takes the requests waiting
    (whole ones, ``max_batch`` texts at most, one request at least) after ``max_wait`` seconds. A
    round that fails fails its own requests, no others.

    Args:
        score_fn (Callable): ``texts -> list[float]``.
        max_batch: the most texts a round takes (a request is never split).
        max_wait: seconds a round waits for other requests to join the first.
    """

    def __init__(self, score_fn, *, max_batch: int = 256, max_wait: float = 0.005):
        self.score_fn, self.max_batch, self.max_wait = score_fn, max_batch, max_wait
        self.stats = {"requests": 0, "rounds": 0, "texts": 0}
        self._queue: asyncio.Queue | None = None
        self._held = None  # a request that did not fit the last round: the next one's first

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="reward-model")
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._task.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn, *args):
        """``fn(*args)`` on the scoring thread, between rounds: a tokenizer is not shared across
        threads (a fast tokenizer's settings change under a call in another)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    @property
    def queued(self) -> int:
        return self._queue.qsize() if self._queue is not None else 0

    async def score(self, texts: list[str]) -> list[float]:
        future = asyncio.get_running_loop().create_future()
        self.stats["requests"] += 1
        await self._queue.put((texts, future))
        return await future

    def _take(self, round_: list, size: int) -> int:
        """Add the waiting requests that fit to ``round_``; the new size."""
        while size < self.max_batch and not self._queue.empty():
            item = self._queue.get_nowait()
            if size + len(item[0]) > self.max_batch:
                self._held = item
                break
            round_.append(item)
            size += len(item[0])
        return size

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first, self._held = self._held or await self._queue.get(), None
            round_ = [first]
            size = self._take(round_, len(first[0]))
            if size < self.max_batch and self._held is None and self.max_wait > 0:
                await asyncio.sleep(self.max_wait)  # let the other callers' requests join
                self._take(round_, size)
            round_ = [(texts, f) for texts, f in round_ if not f.done()]  # callers that left
            texts = [t for part, _ in round_ for t in part]
            if not texts:
                continue
            try:
                scores = await loop.run_in_executor(self._worker, self.score_fn, texts)
            except Exception as error:  # noqa: BLE001 - the round's callers get it, the server goes on
                log.exception("Scoring a round of %d texts failed", len(texts))
                for _, future in round_:
                    if not future.done():
                        future.set_exception(error)
                continue
            self.stats["rounds"] += 1
            self.stats["texts"] += len(texts)
            start = 0
            for part, future in round_:
                if not future.done():
                    future.set_result(scores[start : start + len(part)])
                start += len(part)


def _strings(value, name: str, n: int | None = None) -> list:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(400, f'"{name}" must be a list of strings')
    if n is not None and len(value) != n:
        raise RequestError(400, f'"{name}" has {len(value)} entries for {n} responses')
    return value


def request_texts(request, reward_model, max_responses: int) -> list[str]:
    """The texts to score for a parsed request body (the module docstring's format), rendered as
    the reward model reads them; :class:`RequestError` (400, 413) for a request it cannot take.

    Args:
        request (dict): the parsed request body.
        reward_model (rlhf_torchrl.rewards.reward_model.RewardModel): renders the texts.
        max_responses: the most responses a request may hold (more: 413).
    """
    if not isinstance(request, dict):
        raise RequestError(400, "the body must be a JSON object")
    if "responses" not in request and "query" not in request:
        raise RequestError(400, 'give "responses" with "prompts" (and "messages" for a reward '
                                'model with a chat template), or OpenRLHF\'s "query"')
    if "responses" not in request:
        texts = _strings(request["query"], "query")
        if len(texts) > max_responses:
            raise RequestError(413, f"{len(texts)} texts in one request: at most {max_responses}")
        return texts
    responses = _strings(request["responses"], "responses")
    n = len(responses)
    if n > max_responses:
        raise RequestError(413, f"{n} responses in one request: at most {max_responses}")
    prompts = _strings(request.get("prompts", [""] * n), "prompts", n)
    messages = request.get("messages")
    if messages is not None:
        if not isinstance(messages, list) or len(messages) != n or not all(
                isinstance(c, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                            and isinstance(m.get("content"), str) for m in c)
                for c in messages):
            raise RequestError(400, '"messages" must hold one list of {"role", "content"} '
                                    "string pairs per response")
    has_stop = request.get("has_stop")
    if has_stop is not None and (not isinstance(has_stop, list) or len(has_stop) != n
                                 or not all(isinstance(s, bool) for s in has_stop)):
        raise RequestError(400, '"has_stop" must hold one true or false per response')
    if messages is None and reward_model.has_chat_template:
        raise RequestError(400, 'this reward model reads conversations in its own chat template: '
                                'send "messages", each prompt\'s conversation')
    try:
        return reward_model.render(prompts, responses, messages=messages, has_stop=has_stop)
    except Exception as error:  # noqa: BLE001 - the template's own (jinja) error on this input
        raise RequestError(400, f"cannot render the request with the reward model's chat "
                                f"template: {type(error).__name__}: {error}") from None


def make_app(reward_model, *, token: str | None = None, max_request_bytes: int = 16 << 20,
             max_request_responses: int = 1024, max_text_tokens: int = 16384,
             body_timeout: float = 30.0, max_batch: int = 256, max_wait: float = 0.005):
    """The Starlette app serving ``reward_model``: the module docstring's endpoints, batching and
    limits.

    Args:
        reward_model (rlhf_torchrl.rewards.reward_model.RewardModel): the model that scores.
        token: the bearer token every ``POST`` needs (None: none).
        max_request_bytes: a larger body gets 413.
        max_request_responses: a request with more responses gets 413.
        max_text_tokens: a text with more tokens, as the reward model reads it, gets 400.
        body_timeout: seconds a request's body may take to arrive (longer: 408).
        max_batch: the most texts a scoring round takes (:class:`Batcher`).
        max_wait: seconds a round waits for other requests to join the first.
    """
    try:
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route
    except ImportError:
        raise MissingDependencyError("serving a reward model needs Starlette and uvicorn: "
                                     "pip install 'rlhf_torchrl[serve]'.") from None

    batcher = Batcher(lambda texts: reward_model.score_texts(texts).tolist(), max_batch=max_batch,
                      max_wait=max_wait)
    secret = token.encode("utf-8") if token else None

    tokenizer = reward_model.tokenizer
    add_special_tokens = not reward_model.has_chat_template  # as RewardModel.encode reads them

    def refuse(request, status: int, message: str, **headers) -> JSONResponse:
        client = request.client.host if request.client else "?"
        log.warning("%s %s from %s: %d %s", request.method, request.url.path, client, status, message)
        return JSONResponse({"error": message}, status_code=status, headers=headers or None)

    async def read_body(request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > DRAIN_FACTOR * max_request_bytes:
            raise RequestError(413, f"a body of {declared} bytes: at most {max_request_bytes}")
        body, size = bytearray(), 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= max_request_bytes:
                body += chunk
            elif size > DRAIN_FACTOR * max_request_bytes:
                break
        if size > max_request_bytes:
            raise RequestError(413, f"a body of more than {max_request_bytes} bytes: send fewer "
                                    "responses per request")
        return bytes(body)

    def authorized(request) -> bool:
        if secret is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8"),
                                                                  secret)

    def too_many_characters(texts: list[str]) -> str | None:
        """The first text too long to count (see MAX_CHARS_PER_TOKEN); None where none is."""
        for i, text in enumerate(texts):
            if len(text) > max_text_tokens * MAX_CHARS_PER_TOKEN:
                return f"text {i} has {len(text)} characters, more than {max_text_tokens} tokens hold"
        return None

    def too_many_tokens(texts: list[str]) -> str | None:
        """The first text over ``max_text_tokens``, counted as the reward model reads it."""
        for i, text in enumerate(texts):
            count = len(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
            if count > max_text_tokens:
                return f"text {i} has {count} tokens"
        return None

    async def score(request):
        if not authorized(request):
            # from the headers alone: the body is never read (see SMALL_BODY)
            declared = request.headers.get("content-length", "")
            small = declared.isdigit() and int(declared) <= SMALL_BODY
            return refuse(request, 401, "missing or wrong bearer token",
                          **{"WWW-Authenticate": "Bearer", **({} if small else CLOSE)})
        try:
            try:
                body = await asyncio.wait_for(read_body(request), body_timeout)
            except asyncio.TimeoutError:
                raise RequestError(408, f"the body did not arrive within {body_timeout:g} s") from None
            try:
                parsed = json.loads(body)
            except RecursionError:
                raise RequestError(400, "JSON nested too deeply") from None
            except ValueError as error:
                raise RequestError(400, f"malformed JSON: {error}") from None
            texts = request_texts(parsed, reward_model, max_request_responses)
            over = too_many_characters(texts) or (await batcher.run(too_many_tokens, texts)
                                                  if texts else None)
            if over is not None:
                raise RequestError(400, f"{over}: at most {max_text_tokens} tokens a text "
                                        "(the server's max_text_tokens)")
        except RequestError as error:
            return refuse(request, error.status, error.message,
                          **(CLOSE if error.status == 408 else {}))
        if not texts:
            return JSONResponse({"rewards": [], "scores": []})
        try:
            scores = await batcher.score(texts)
        except Exception as error:  # noqa: BLE001 - logged by the batcher; this caller gets a 500
            return JSONResponse({"error": f"scoring failed: {type(error).__name__}: {error}"},
                                status_code=500)
        return JSONResponse({"rewards": scores, "scores": scores})

    async def health(request):
        if not authorized(request):  # alive or not, and nothing of the load it carries
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", **batcher.stats, "queued": batcher.queued})

    @asynccontextmanager
    async def lifespan(app):
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop()

    app = Starlette(routes=[Route("/score", score, methods=["POST"]),
                            Route("/get_reward", score, methods=["POST"]),
                            Route("/health", health, methods=["GET"])], lifespan=lifespan)
    app.state.batcher = batcher
    return app


def make_server(app, host: str = "127.0.0.1", port: int = 8000):
    """(a uvicorn ``Server`` for ``app``, its listening socket): bound and listening already, so a
    client that connects before the server runs waits in the backlog rather than being refused.

    Args:
        app: the Starlette app (:func:`make_app`).
        host: the address to bind.
        port: the port (0: one the system picks).
    """
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=2048)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise ConfigError(f"host={host} port={port}: cannot listen there ({reason}): give "
                          "a free port (port=0 picks one) and an address of this machine.") from None
    config = uvicorn.Config(app, log_level="info", access_log=False, lifespan="on",
                            timeout_keep_alive=30)
    return uvicorn.Server(config), sock


def serve(reward_model, *, name: str = "reward model", host: str = "127.0.0.1", port: int = 8000,
          token: str | None = None, **settings) -> None:
    """Serve ``reward_model`` at ``host:port`` until interrupted (SIGINT/SIGTERM). Prints
    ``Serving <name> at http://HOST:PORT`` once it takes requests.

    Args:
        reward_model (rlhf_torchrl.rewards.reward_model.RewardModel): the model that scores.
        name: what the start-up line calls it.
        host: the address to bind (``127.0.0.1``: this machine only).
        port: the port (0: one the server picks, printed).
        token: the bearer token every ``POST`` needs (None: none).
        **settings: :func:`make_app`'s other settings.
    """
    if host not in ("127.0.0.1", "localhost", "::1") and token is None:
        log.warning("Serving on %s without a token: anyone who can reach it can use the reward "
                    "model. Set token_env to an environment variable holding a secret.", host)
    server, sock = make_server(make_app(reward_model, token=token, **settings), host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"Serving {name} at http://{shown}:{sock.getsockname()[1]} (POST /score, GET /health"
          f"{'; bearer token required' if token else ''})", flush=True)
    server.run(sockets=[sock])


class ServerThread:
    """A served reward model in a thread of this process (the tests, the load benchmark):
    ``with ServerThread(app) as server: ... server.url``.

    Args:
        app: the Starlette app (:func:`make_app`).
        host: the address to bind.
        port: the port (0: one the server picks).
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.server, self.sock = make_server(app, host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


class ServerProcess:
    """``rlhf-torchrl serve-reward-model`` in a child process (a load benchmark, a test):
    ``with ServerProcess(model, port=0, threads=1) as server: ... server.url``. ``kill()`` sends it
    SIGKILL.

    Args:
        model: the reward model's directory or Hub name.
        log: the file the server's output goes to.
        port: the port (0: one the server picks).
        env: the child's whole environment (None: this process's).
        timeout: seconds to wait for the server to take requests.
        **settings: ``serve_reward_model.yaml``'s settings, as ``key=value`` overrides.
    """

    def __init__(self, model: str, log: str, *, port: int = 0, env: dict | None = None,
                 timeout: float = 180.0, **settings):
        folder = os.path.dirname(os.path.abspath(log))
        overrides = [f"model={model}", f"port={port}", f"hydra.run.dir={folder}",
                     *(f"{k}={v}" for k, v in settings.items())]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rlhf_torchrl.cli", "serve-reward-model", *overrides],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            with open(log) as f:
                lines = [line for line in f if line.startswith("Serving ")]
            if lines:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                with open(log) as f:
                    raise RuntimeError(f"the reward server did not start: {f.read()[-2000:]}")
            time.sleep(0.1)
        self.url = lines[0].split(" at ", 1)[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
