"""What a remote service cannot do to a run (rlhf_torchrl.http_client, through the remote rewards
and the remote sandbox executor), against real HTTP servers on localhost that misbehave on
purpose: trickle an answer a byte at a time (headers or body), or redirect to another origin."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from tensordict import TensorDict

from rlhf_torchrl import keys as K
from rlhf_torchrl.envs.sandbox import SandboxSpec
from rlhf_torchrl.envs.tools import ToolCall, load_tools, run_tool
from rlhf_torchrl.rewards.remote import RemoteReward
from rlhf_torchrl.rewards.scoring import RewardError

TRICKLE_SECONDS = 0.2  # between two bytes
TRICKLE_BYTES = 30  # 6 s in all: each test's limit is 1 s


class Trickles(BaseHTTPRequestHandler):
    """Answers a byte every :data:`TRICKLE_SECONDS`: its headers (``server.part == "headers"``)
    or, after whole headers, its body. Stops when the client hangs up."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        try:
            if self.server.part == "headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                drip = b"X-Slow: " + b"a" * TRICKLE_BYTES
            else:
                self.send_response(200)
                self.send_header("Content-Length", str(TRICKLE_BYTES + 10))
                self.end_headers()
                drip = b"{" * TRICKLE_BYTES
            for byte in drip:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(TRICKLE_SECONDS)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up: as it should
            pass
        self.close_connection = True

    def log_message(self, *args):
        pass


class Redirects(BaseHTTPRequestHandler):
    """A ``302`` to ``server.location``."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(302)
        self.send_header("Location", self.server.location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class Elsewhere(BaseHTTPRequestHandler):
    """Another origin: keeps each request's method and Authorization header, and answers as a
    scoring endpoint and a sandbox service both would."""

    def answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.requests.append((self.command, self.headers.get("Authorization")))
        body = json.dumps({"rewards": [9.0] * self.server.n, "status": "Success", "run_result": {
            "status": "Finished", "return_code": 0, "stdout": "elsewhere", "stderr": ""}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = answer  # noqa: N815 - http.server's names

    def log_message(self, *args):
        pass


def serve(handler, **attributes):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    for name, value in attributes.items():
        setattr(server, name, value)
    threading.Thread(target=server.serve_forever, name="service", daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server


@pytest.fixture
def servers():
    started = []
    yield lambda handler, **attributes: started.append(serve(handler, **attributes)) or started[-1]
    for server in started:
        server.shutdown()
        server.server_close()


def _rollout(n: int) -> TensorDict:
    td = TensorDict({K.HAS_STOP: torch.ones(n, dtype=torch.bool)}, batch_size=[n])
    td.set(K.PROMPT_TEXT, [f"question {i}" for i in range(n)])
    td.set(K.RESPONSE_TEXT, [f"answer {i}" for i in range(n)])
    return td


def _texts(td):
    return td.get(K.PROMPT_TEXT).tolist(), td.get(K.RESPONSE_TEXT).tolist()


def client_threads() -> set[threading.Thread]:
    """This process's threads, less the test servers' own."""
    return {t for t in threading.enumerate()
            if t.name != "service" and "process_request" not in t.name}


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_trickling_reward_service_is_cut_off_at_the_timeout(servers, part):
    """Headers, or a body, a byte every 0.2 s: with remote_timeout=1 and no retries the reward
    fails after about a second (a socket timeout bounds each read, never their sum), one line."""
    server = servers(Trickles, part=part)
    reward = RemoteReward(f"{server.url}/score", timeout=1.0, retries=0)
    td = _rollout(2)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"did not answer after 1 attempt .*no answer within 1 s"):
        reward(*_texts(td), td)
    # bounded, not a measured speed: before, it ran as long as the service trickled (past 90 s)
    assert time.monotonic() - start < 10


def test_a_reward_service_cannot_redirect_the_token_elsewhere(servers, monkeypatch):
    """A 302 to another port: not followed, the token and the rollout stay with the configured
    URL, and the run stops with one line naming where it was sent."""
    elsewhere = servers(Elsewhere, requests=[], n=3)
    redirect = servers(Redirects, location=f"{elsewhere.url}/score")
    monkeypatch.setenv("RM_TEST_TOKEN", "s3cret")
    reward = RemoteReward(f"{redirect.url}/score", token_env="RM_TEST_TOKEN", retries=2,
                          backoff=0.01)
    td = _rollout(3)
    with pytest.raises(RewardError) as refused:
        reward(*_texts(td), td)
    assert elsewhere.requests == []
    message = str(refused.value)
    assert f"HTTP 302 Found to {elsewhere.url}/score: not followed" in message, message
    assert "reward.remote_url" in message and "\n" not in message


def test_a_trickling_sandbox_service_leaves_no_thread_behind(servers):
    """The python tool on a service that trickles its answer: the call ends at the run's limit
    with a message saying so, and no thread of it is left reading."""
    server = servers(Trickles, part="body")
    tools = load_tools(["python"], python_sandbox=SandboxSpec(kind="remote",
                                                              url=f"{server.url}/run_code"))
    before = client_threads()
    start = time.monotonic()
    result = run_tool(tools, ToolCall("python", "print(1)"), timeout=1.0)
    assert time.monotonic() - start < 10  # bounded (a hang was the failure), not a speed
    assert not result.ok and "no answer within" in result.content, result.content
    for _ in range(50):  # a thread's last step after its result: well under 0.5 s
        if client_threads() <= before:
            break
        time.sleep(0.01)
    assert client_threads() <= before, client_threads() - before


def test_a_sandbox_service_cannot_redirect_the_code_elsewhere(servers):
    elsewhere = servers(Elsewhere, requests=[], n=0)
    redirect = servers(Redirects, location=f"{elsewhere.url}/run_code")
    tools = load_tools(["python"], python_sandbox=SandboxSpec(kind="remote",
                                                              url=f"{redirect.url}/run_code"))
    result = run_tool(tools, ToolCall("python", "print(1)"), timeout=5.0)
    assert elsewhere.requests == []
    assert not result.ok and f"HTTP 302 Found to {elsewhere.url}/run_code: not followed" in \
        result.content, result.content
