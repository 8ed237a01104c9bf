"""Prompts: the conversation the policy answers and the dataset fields that travel with it.

:func:`~rlhf_torchrl.data.prompt_sets.load_prompts` reads a source in whichever form it is stored
(:mod:`rlhf_torchrl.data.readers`:
JSON lines, JSON, Parquet, CSV/TSV, a saved or a hub dataset, the bundled review sentences,
reasoning-gym tasks) into a :class:`~rlhf_torchrl.data.prompt_sets.PromptSet` of :class:`Prompt` s:
the conversation (system and earlier turns kept, ending with the last user turn) and the row's
other columns, which travel with the prompt into the rollout so that reward functions can ask for
them by name (a GSM8K ``answer``, a MATH ``solution``). :class:`LengthCheck` holds each prompt to
the token budget (chat template applied, as the generation env renders it), cutting it to fit
with ``data.truncate_prompts``.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rlhf_torchrl.data.readers import POLARITY, REASONING_GYM, polarity_sentences  # noqa: F401 (this module's names too)
from rlhf_torchrl.errors import ConfigError

#: Field that holds the content of a conversation's trailing assistant turn(s) (its reference answer).
REFERENCE_ANSWER = "reference_answer"
_ROLES = ("system", "user", "assistant", "tool")
_HH_HUMAN, _HH_ASSISTANT = "\n\nHuman:", "\n\nAssistant:"


@dataclass(frozen=True)
class Prompt:
    """One prompt: the conversation the policy answers and the dataset fields that travel with it.

    Args:
        messages: ``{"role", "content"}`` dicts ending with a user turn (a system message, if any,
            first); the policy's chat template renders them.
        fields: the row's other columns (plus ``reference_answer`` when the conversation ended
            with an assistant turn).
        template: the ``data.template`` the last user message was filled from (None: none).
        source_text: the column text the template was filled with (None: no template).

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
        template fills it any more).

        Args:
            text: the new last user message.
        """
        return replace(self, messages=[*self.messages[:-1], {"role": "user", "content": text}],
                       template=None, source_text=None)

    def with_source_text(self, text: str) -> Prompt:
        """The same prompt with ``text`` in place of the column text its template was filled with
        (the last user message itself when there is no template).

        Args:
            text: the new column text.
        """
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
    ``{metadata[difficulty]}`` or ``{meta.source}``, the column ``metadata`` or ``meta``).

    Args:
        template: a ``data.template`` format string.
    """
    return [re.split(r"[.\[]", name, maxsplit=1)[0]
            for _, name, _, _ in string.Formatter().parse(template) if name]


def fill_template(template: str, text: str, columns: dict) -> str:
    """``template`` with ``{prompt}`` replaced by ``text`` and ``{name}`` by the row's column
    (``{name[key]}``: an entry of a dict column).

    Args:
        template: a format string, e.g. ``"TITLE: {title}\\n\\nPOST: {prompt}"``.
        text: what ``{prompt}`` becomes.
        columns: the row's columns.
    """
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
    ``reference_answer`` field.

    Args:
        item (str | list | Prompt): a string, a list of ``{"role", "content"}`` dicts, or a Prompt.
        system_prompt: put first unless the conversation has its own (None: none).
        where: names the item in errors (e.g. ``"prompts.jsonl:12"``).
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


def render_prompt(tokenizer, prompt: Prompt | str) -> str:
    """The prompt as the policy reads it: its chat template applied, generation prompt on.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        prompt: a :class:`Prompt` or a plain user message.
    """
    return render_conversations(tokenizer, [to_prompt(prompt).messages])[0]


def render_conversations(tokenizer, conversations: Sequence[list[dict]]) -> list[str]:
    """Each conversation as the policy reads it (:func:`render_prompt`), in one call.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        conversations: lists of ``{"role", "content"}`` messages.
    """
    return tokenizer.apply_chat_template(list(conversations), add_generation_prompt=True,
                                         tokenize=False)


def prompt_token_ids(tokenizer, prompt: Prompt | str) -> list[int]:
    """Token ids of the rendered prompt. The template writes every special token it wants (a BOS
    included), so nothing is added on top: the ids the generation env feeds the policy.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        prompt: a :class:`Prompt` or a plain user message.
    """
    return tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False)["input_ids"]


def templated_length(tokenizer, prompt: Prompt | str, system_prompt: str | None = None) -> int:
    """Number of tokens of ``prompt`` once the chat template is applied (generation prompt on).

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        prompt: a :class:`Prompt` or a plain user message.
        system_prompt: put first unless the conversation has its own (None: none).
    """
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


@dataclass(frozen=True)
class LengthCheck:
    """Holds a prompt to ``max_prompt_length`` tokens, chat template included.

    With ``truncate``, an over-long prompt is cut to fit: a dialogue first loses its oldest
    exchanges (the turn the policy answers stays whole); then the text the ``data.template`` was
    filled with (the last user message without a template) loses its start (``side="left"``: its
    end, which the response follows, stays) or its end (``"right"``: cut back to the last ``at``,
    e.g. a newline, when there is one, as the N+ TL;DR queries are); the template's own words
    always stay. Without it, an over-long prompt is an error naming it.

    ``length_check(prompt, name)`` returns ``(prompt, tokens, cut)``: the prompt (cut, or as it
    was), its length and whether it was cut; ``name`` names it in errors (``"Prompt 3"``).

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer (its chat
            template counts).
        max_prompt_length: the budget, in tokens.
        truncate: cut an over-long prompt to fit (False: refuse it).
        side: ``left`` or ``right``: which end of the filled-in text is cut.
        at: with ``side="right"``, cut back to the last occurrence of this text (None: anywhere).

    Example:
        >>> check = LengthCheck(tokenizer, max_prompt_length=64, truncate=True)
        >>> prompt, tokens, cut = check(Prompt([{"role": "user", "content": "hi"}]), "Prompt 0")
    """

    tokenizer: Any
    max_prompt_length: int
    truncate: bool = False
    side: str = "left"
    at: str | None = None

    def __post_init__(self):
        if self.side not in ("left", "right"):
            raise ConfigError(f"data.truncate_side={self.side!r}: left or right.")

    def __call__(self, prompt: Prompt, name: str) -> tuple[Prompt, int, bool]:
        length = templated_length(self.tokenizer, prompt)
        if length <= self.max_prompt_length:
            return prompt, length, False
        if not self.truncate:
            raise ConfigError(
                f"{name} is {length} tokens with the chat template, over "
                f"data.max_prompt_length={self.max_prompt_length}: {prompt.text[:80]!r}... Raise "
                "data.max_prompt_length, or set data.truncate_prompts=true to cut prompts."
            )
        prompt = _fit(prompt, self.tokenizer, self.max_prompt_length, name, self.side, self.at)
        return prompt, templated_length(self.tokenizer, prompt), True


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
    """Every prompt of a list held to ``max_prompt_length`` tokens (:class:`LengthCheck`):
    returns the prompts (over-long ones cut, with ``truncate``) and how many were cut; otherwise
    raises, naming the first offending prompt.

    Args:
        prompts: :class:`Prompt` rows or plain user messages.
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        max_prompt_length: the budget, in tokens, chat template included.
        truncate: cut over-long prompts to fit (False: raise).
        system_prompt: put first in conversations that have no system message (None: none).
        truncate_side: ``left`` or ``right`` (:class:`LengthCheck`'s ``side``).
        truncate_at: :class:`LengthCheck`'s ``at``.
    """
    if not prompts:
        raise ConfigError("The prompt set is empty: point data.source at prompts.")
    check = LengthCheck(tokenizer, max_prompt_length, truncate, truncate_side, truncate_at)
    out, n_truncated = [], 0
    for i, item in enumerate(prompts):
        prompt, _, cut = check(to_prompt(item, system_prompt), f"Prompt {i}")
        out.append(prompt)
        n_truncated += cut
    return out, n_truncated


def _fit(prompt: Prompt, tokenizer, max_length: int, name: str, side: str, at: str | None) -> Prompt:
    """``prompt`` cut to ``max_length`` tokens (see :class:`LengthCheck`)."""
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
            f"{name}: the chat template and data.template alone are {length - len(ids)} "
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
        raise ConfigError(f"{name} does not fit data.max_prompt_length={max_length} even with "
                         "its text cut away: raise it.")
    return cut(keep)
