"""Prompt sets: a Hugging Face dataset, a local JSON-lines file, or the bundled review sentences.

Every loader returns a list of :class:`Prompt`: the conversation the policy answers (system and
earlier turns kept, ending with the last user turn) and the row's other columns, which travel with
the prompt into the rollout so that reward functions can ask for them by name (a GSM8K ``answer``,
a MATH ``solution``). :func:`check_prompts` validates them against the tokenizer (chat template
applied, as the generation env renders them) before any work starts.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import ConfigError, MissingDependencyError, MissingFileError

#: Built-in offline prompt set: the 200 movie-review sentences gensim ships (Pang & Lee polarity).
POLARITY = "polarity"
#: Prefix of a reasoning-gym task source: ``"reasoning_gym:basic_arithmetic"``.
REASONING_GYM = "reasoning_gym:"
#: Field that holds the content of a conversation's trailing assistant turn(s) (its reference answer).
REFERENCE_ANSWER = "reference_answer"
_ROLES = ("system", "user", "assistant", "tool")
_HH_HUMAN, _HH_ASSISTANT = "\n\nHuman:", "\n\nAssistant:"


@dataclass(frozen=True)
class Prompt:
    """One prompt: the conversation the policy answers and the dataset fields that travel with it.

    ``messages`` are ``{"role", "content"}`` dicts ending with a user turn (a system message, if
    any, first); the policy's chat template renders them. ``fields`` are the row's other columns
    (plus ``reference_answer`` when the conversation ended with an assistant turn).

    Example:
        >>> Prompt([{"role": "user", "content": "2 + 2?"}], {"answer": "4"}).text
        '2 + 2?'
    """

    messages: list[dict]
    fields: dict = field(default_factory=dict)
    #: ``data.template`` and the column text it was filled with: truncation cuts that text and
    #: fills the template again, so the instructions around it stay whole.
    template: str | None = None
    source_text: str | None = None

    @property
    def text(self) -> str:
        """The last user message (what a person would call "the prompt")."""
        return self.messages[-1]["content"]

    def with_text(self, text: str) -> Prompt:
        """The same prompt with the last user message replaced by ``text`` (as written: no
        template fills it any more)."""
        return replace(self, messages=[*self.messages[:-1], {"role": "user", "content": text}],
                       template=None, source_text=None)

    def with_source_text(self, text: str) -> Prompt:
        """The same prompt with ``text`` in place of the column text its template was filled with
        (the last user message itself when there is no template)."""
        if self.template is None:
            return self.with_text(text)
        filled = fill_template(self.template, text, self.fields)
        return replace(self, messages=[*self.messages[:-1], {"role": "user", "content": filled}],
                       source_text=text)

    @property
    def cuttable_text(self) -> str:
        """The text truncation may shorten: the column text inside the template, if any."""
        return self.text if self.source_text is None else self.source_text


def template_columns(template: str) -> list[str]:
    """The columns a ``data.template`` fills in (``{prompt}`` and any column of the row; of
    ``{metadata[difficulty]}`` or ``{meta.source}``, the column ``metadata`` or ``meta``)."""
    return [re.split(r"[.\[]", name, maxsplit=1)[0]
            for _, name, _, _ in string.Formatter().parse(template) if name]


def fill_template(template: str, text: str, columns: dict) -> str:
    """``template`` with ``{prompt}`` replaced by ``text`` and ``{name}`` by the row's column
    (``{name[key]}``: an entry of a dict column)."""
    try:
        return template.format_map({**{k: "" if v is None else v for k, v in columns.items()},
                                    "prompt": text})
    except (KeyError, IndexError, AttributeError, TypeError) as e:
        raise ConfigError(f"data.template {template!r} cannot be filled from this row's fields "
                         f"{sorted(columns)}: {type(e).__name__} {e}.") from None


def to_prompt(item, system_prompt: str | None = None, where: str = "prompt") -> Prompt:
    """A :class:`Prompt` from a string, a list of messages, or a Prompt.

    A plain string is one user message, except an Anthropic HH transcript
    (``"\\n\\nHuman: ... \\n\\nAssistant: ..."``), which is split into turns. A conversation keeps
    every turn up to its last user turn; the content of trailing assistant turns becomes the
    ``reference_answer`` field. ``system_prompt`` is put first unless the conversation has its own.
    """
    if isinstance(item, Prompt):
        prompt = item
    else:
        messages, reference = _conversation(item, where)
        prompt = Prompt(messages, {REFERENCE_ANSWER: reference} if reference else {})
    if system_prompt and prompt.messages[0]["role"] != "system":
        prompt = replace(prompt, messages=[{"role": "system", "content": system_prompt},
                                           *prompt.messages])
    return prompt


def _conversation(value, where: str) -> tuple[list[dict], str | None]:
    """``(messages up to the last user turn, reference answer or None)`` of one prompt value."""
    if isinstance(value, str):
        if value.lstrip(" ").startswith(_HH_HUMAN):
            value = _parse_hh(value)
        else:
            return [{"role": "user", "content": value}], None
    if not isinstance(value, (list, tuple)) or not value:
        raise ConfigError(
            f"{where}: the prompt is a {type(value).__name__}, expected text or a list of chat "
            "messages ({'role': ..., 'content': ...})."
        )
    for message in value:
        if not (isinstance(message, dict) and message.get("role") in _ROLES
                and isinstance(message.get("content"), str)):
            raise ConfigError(
                f"{where}: {message!r} is not a chat message: expected {{'role': one of "
                f"{_ROLES}, 'content': text}}."
            )
    users = [i for i, m in enumerate(value) if m["role"] == "user"]
    if not users:
        raise ConfigError(f"{where}: the conversation has no user turn to answer.")
    last = users[-1]
    trailing = [m["content"] for m in value[last + 1 :] if m["role"] == "assistant"]
    messages = [{"role": m["role"], "content": m["content"]} for m in value[: last + 1]]
    return messages, "\n".join(trailing) or None


def _parse_hh(text: str) -> list[dict]:
    """Split an Anthropic HH transcript into user/assistant messages (an empty last turn is dropped)."""
    messages = []
    rest = text.lstrip(" ")
    while rest:
        role = "user" if rest.startswith(_HH_HUMAN) else "assistant"
        rest = rest[len(_HH_HUMAN if role == "user" else _HH_ASSISTANT):]
        ends = [i for i in (rest.find(_HH_HUMAN), rest.find(_HH_ASSISTANT)) if i >= 0]
        end = min(ends) if ends else len(rest)
        content, rest = rest[:end].strip(), rest[end:]
        if content or rest:
            messages.append({"role": role, "content": content})
    return messages


def polarity_sentences() -> list[tuple[str, str]]:
    """``(label, sentence)`` pairs from gensim's ``pang_lee_polarity.cor`` (labels ``pos``/``neg``)."""
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("The 'polarity' prompt set needs gensim: `pip install gensim`.")
    path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / "pang_lee_polarity.cor"
    pairs = []
    for line in path.read_text(encoding="latin-1").splitlines():
        label, _, text = line.strip().partition(" ")
        if text:
            pairs.append((label.removeprefix("__label__"), text.strip()))
    return pairs


def load_prompts(
    source: str,
    *,
    split: str = "train",
    column: str = "prompt",
    template: str = "{prompt}",
    limit: int | None = None,
    max_words: int | None = None,
    system_prompt: str | None = None,
    config: str | None = None,
    generator_args: dict | None = None,
    seed: int = 0,
) -> list[Prompt]:
    """Load prompts.

    Args:
        source: ``"polarity"`` (bundled review sentences), a path to a ``.jsonl`` file (one JSON
            object per line with a ``column`` field), ``"reasoning_gym:<name>"`` (a procedural
            task of the reasoning-gym package: ``question``, ``answer`` and ``metadata`` columns,
            checked by :func:`~rlhf_torchrl.reward_functions.reasoning_gym_score`), or a Hugging
            Face dataset: a hub name or a local directory (``datasets.load_dataset``).
        split: dataset split (HF datasets only).
        column: the field holding the prompt: text, an HH transcript, or a list of chat messages.
            Every other field of the row travels with the prompt (:attr:`Prompt.fields`).
        template: a format string applied to the last user message: ``{prompt}`` is that message,
            ``{name}`` the row's column ``name``, e.g.
            ``"TITLE: {title}\\n\\nPOST: {prompt}\\n\\nTL;DR:"`` with ``column="post"``.
        limit: keep the first ``limit`` prompts (reasoning-gym: generate that many, default 1000).
        max_words: keep only the first ``max_words`` words of the last user message (before
            templating), e.g. to turn review sentences into review openings to continue.
        system_prompt: a system message for conversations that have none (``None``: the chat
            template's default, if any).
        config: the HF dataset's configuration name (``"main"`` for ``openai/gsm8k``).
        generator_args: reasoning-gym: the task's settings (``{"max_terms": 2}``).
        seed: reasoning-gym: the seed its rows are generated from.
    """
    if "{prompt}" not in template:
        raise ConfigError(f"data.template must contain '{{prompt}}', got {template!r}.")
    if source == POLARITY:
        rows = [({column: text}, f"polarity[{i}]") for i, (_, text) in enumerate(polarity_sentences())]
    elif source.startswith(REASONING_GYM):
        rows = _reasoning_gym_rows(source[len(REASONING_GYM):], limit or 1000, seed,
                                   generator_args or {})
    elif os.path.isfile(source) or source.endswith((".jsonl", ".json")):
        rows = _read_jsonl(source, column)
    else:
        rows = _read_hf_dataset(source, split, column, config)
    if rows and column not in rows[0][0]:
        raise ConfigError(f"{rows[0][1]} has no field {column!r}; its fields are "
                         f"{sorted(rows[0][0])}. Set data.column.")
    wanted = [name for name in template_columns(template) if name != "prompt"]
    prompts = []
    for row, where in rows[:limit]:
        missing = [name for name in wanted if name not in row or name == column]
        if missing:
            raise ConfigError(
                f"{where}: data.template names {{{missing[0]}}}, which is not one of the row's "
                f"other fields {sorted(k for k in row if k != column)}. Name a column of the data "
                "(the prompt column itself is {prompt})."
            )
        prompt = to_prompt(row[column], system_prompt, where)
        text = prompt.text
        if max_words is not None:
            text = " ".join(text.split()[:max_words])
        columns = {k: v for k, v in row.items() if k != column}
        fields = {**prompt.fields, **columns}
        filled = prompt.with_text(fill_template(template, text, columns))
        prompts.append(Prompt(filled.messages, fields, template, text))
    if not prompts:
        raise ConfigError(f"The prompt set {source!r} is empty: point data.source at prompts.")
    return prompts


def _reasoning_gym_rows(name: str, size: int, seed: int, settings: dict) -> list[tuple[dict, str]]:
    """``size`` rows of the reasoning-gym task ``name`` (``question``, ``answer``, ``metadata``)."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise MissingDependencyError(f"data.source={REASONING_GYM}{name} needs reasoning-gym: "
                          "`pip install 'rlhf_torchrl[tasks]'`.") from e
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ConfigError(f"reasoning-gym has no task {name!r}; it has {', '.join(sorted(DATASETS))}.")
    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **settings)
    except (TypeError, AssertionError, ValueError) as e:
        raise ConfigError(f"reasoning-gym task {name!r} refused data.generator_args={settings}: "
                         f"{e}") from e
    return [(dict(entry), f"{REASONING_GYM}{name}[{i}]") for i, entry in enumerate(dataset)]


def _read_jsonl(path: str, column: str) -> list[tuple[dict, str]]:
    if not os.path.exists(path):
        raise MissingFileError(f"Prompt file {path!r} does not exist.")
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at "
                                  f"column {e.start + 1}): save the file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from e
            if not isinstance(row, dict) or column not in row:
                raise ConfigError(
                    f"{path}:{lineno}: expected an object with a {column!r} field "
                    f"(set data.column to the field holding the prompt)."
                )
            rows.append((row, f"{path}:{lineno}"))
    return rows


def _read_hf_dataset(name: str, split: str, column: str,
                     config: str | None = None) -> list[tuple[dict, str]]:
    try:
        import datasets
    except ImportError as e:
        raise MissingDependencyError(
            f"Loading the dataset {name!r} needs the `datasets` package: "
            "`pip install 'rlhf_torchrl[datasets]'` (or pass a local .jsonl file)."
        ) from e
    ds = datasets.load_dataset(name, config, split=split)
    if column not in ds.column_names:
        raise ConfigError(
            f"Dataset {name!r} has no column {column!r}; its columns are {ds.column_names}. "
            "Set data.column."
        )
    return [(row, f"{name}[{i}]") for i, row in enumerate(ds)]


def render_prompt(tokenizer, prompt: Prompt | str) -> str:
    """The prompt as the policy reads it: its chat template applied, generation prompt on."""
    return tokenizer.apply_chat_template(to_prompt(prompt).messages, add_generation_prompt=True,
                                         tokenize=False)


def prompt_token_ids(tokenizer, prompt: Prompt | str) -> list[int]:
    """Token ids of the rendered prompt. The template writes every special token it wants (a BOS
    included), so nothing is added on top: the ids the generation env feeds the policy."""
    return tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]


def templated_length(tokenizer, prompt: Prompt | str, system_prompt: str | None = None) -> int:
    """Number of tokens of ``prompt`` once the chat template is applied (generation prompt on)."""
    return len(prompt_token_ids(tokenizer, to_prompt(prompt, system_prompt)))


def _has_earlier_turns(prompt: Prompt) -> bool:
    return sum(m["role"] != "system" for m in prompt.messages) > 1


def _drop_oldest_turn(prompt: Prompt) -> Prompt:
    """The conversation without its oldest exchange: the first non-system message and what
    follows it up to the next user turn (the system message and the last user turn stay)."""
    messages = prompt.messages
    first = next(i for i, m in enumerate(messages) if m["role"] != "system")
    rest = next((j for j in range(first + 1, len(messages)) if messages[j]["role"] == "user"),
                len(messages) - 1)
    return replace(prompt, messages=[*messages[:first], *messages[rest:]])


def check_prompts(
    prompts: Sequence[Prompt | str],
    tokenizer,
    *,
    max_prompt_length: int,
    truncate: bool = False,
    system_prompt: str | None = None,
    truncate_side: str = "left",
    truncate_at: str | None = None,
) -> tuple[list[Prompt], int]:
    """Check every prompt fits ``max_prompt_length`` tokens (template included).

    With ``truncate``, an over-long prompt is cut to fit: a dialogue first loses its oldest
    exchanges (the turn the policy answers stays whole); then the text the ``data.template`` was
    filled with (the last user message without a template) loses its start
    (``truncate_side="left"``: its end, which the response follows, stays) or its end
    (``"right"``: cut back to the last ``truncate_at``, e.g. a newline, when there is one, as
    the N+ TL;DR queries are); the template's own words always stay. Returns the prompts and how
    many were cut. Otherwise raises, naming the first offending prompt.
    """
    if not prompts:
        raise ConfigError("The prompt set is empty: point data.source at prompts.")
    if truncate_side not in ("left", "right"):
        raise ConfigError(f"data.truncate_side={truncate_side!r}: left or right.")
    out, n_truncated = [], 0
    for i, item in enumerate(prompts):
        prompt = to_prompt(item, system_prompt)
        length = templated_length(tokenizer, prompt)
        if length <= max_prompt_length:
            out.append(prompt)
            continue
        if not truncate:
            raise ConfigError(
                f"Prompt {i} is {length} tokens with the chat template, over "
                f"data.max_prompt_length={max_prompt_length}: {prompt.text[:80]!r}... Raise "
                "data.max_prompt_length, or set data.truncate_prompts=true to cut prompts."
            )
        out.append(_fit(prompt, tokenizer, max_prompt_length, i, truncate_side, truncate_at))
        n_truncated += 1
    return out, n_truncated


def _fit(prompt: Prompt, tokenizer, max_length: int, i: int, side: str, at: str | None) -> Prompt:
    """``prompt`` cut to ``max_length`` tokens (see :func:`check_prompts`)."""
    length = templated_length(tokenizer, prompt)
    while length > max_length and _has_earlier_turns(prompt):
        prompt = _drop_oldest_turn(prompt)
        length = templated_length(tokenizer, prompt)
    if length <= max_length:
        return prompt
    ids = tokenizer(prompt.cuttable_text, add_special_tokens=False)["input_ids"]
    keep = max_length - (length - len(ids))
    if keep <= 0:
        raise ConfigError(
            f"Prompt {i}: the chat template and data.template alone are {length - len(ids)} "
            f"tokens, over data.max_prompt_length={max_length}: raise it."
        )

    def cut(n: int) -> Prompt:
        kept = ids[-n:] if side == "left" else ids[:n]
        text = tokenizer.decode(kept) if n else ""
        if side == "right" and at and at in text:
            text = text[: text.rindex(at)]
        return prompt.with_source_text(text)

    # re-tokenising decoded text can differ by a token or two: keep less until it fits
    while keep > 0 and templated_length(tokenizer, cut(keep)) > max_length:
        keep -= 1
    if keep == 0 and templated_length(tokenizer, cut(0)) > max_length:
        raise ConfigError(f"Prompt {i} does not fit data.max_prompt_length={max_length} even with "
                         "its text cut away: raise it.")
    return cut(keep)
