"""Step rewards: a reward that gives one value per reasoning step, each put on the step's last
response token.

A reward function returns one list per response, one value per step (``[[0.5, -1.0], [],
[1.0]]``) where it returns step rewards; :class:`StepRewards` places them:

1. :class:`StepSplit` splits each response text into steps: the pieces between ``delimiter``
   (``"\\n"``), or the pieces that begin at each match of ``marker`` (a regular expression such
   as ``Step \\d+:``), stripped of surrounding whitespace; a piece of whitespace alone is no step.
   A reward function receives these steps when it names a ``steps`` parameter.
2. :func:`token_text_ends` maps the sampled token ids to the text: ``ends[t]``, the characters
   of the decoded response complete after token ``t`` (a multi-byte character belongs to the
   token that completes it).
3. Each step's value goes to the first token whose text reaches the step's last character
   (:func:`step_last_tokens`), in a (B, R) tensor that
   :class:`~rlhf_torchrl.objectives.kl_shaping.KLRewardShaper` adds to the per-token reward
   (``"step_reward"``).
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from rlhf_torchrl import keys as K
from rlhf_torchrl.errors import ConfigError

#: the characters a decoder writes for bytes that are not (yet) a whole UTF-8 character
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class StepSplit:
    """How a response text is cut into steps.

    Args:
        delimiter: the text between two steps (``"\\n"``: one step a line); not part of a step.
        marker: a regular expression that begins each step (``r"Step \\d+:"``), in place of the
            delimiter; the match is part of its step, and text before the first match is a step
            of its own (None: split by ``delimiter``).

    Example:
        >>> StepSplit().texts("2 + 3 = 5\\n\\n5 * 2 = 10\\n#### 10")
        ['2 + 3 = 5', '5 * 2 = 10', '#### 10']
    """

    delimiter: str = "\n"
    marker: str | None = None

    def __post_init__(self):
        if self.marker is None and not self.delimiter:
            raise ConfigError("reward.step_delimiter is empty: give the text between two steps "
                              "(\"\\n\": one step a line), or set reward.step_marker.")
        if self.marker is not None:
            try:
                re.compile(self.marker)
            except re.error as e:
                raise ConfigError(f"reward.step_marker={self.marker!r} is not a regular "
                                  f"expression ({e}): e.g. 'Step \\d+:'.") from None
            if re.compile(self.marker).search(""):
                raise ConfigError(f"reward.step_marker={self.marker!r} matches the empty text: "
                                  "it must match what begins a step, e.g. 'Step \\d+:'.")

    def describe(self) -> str:
        """The rule, as a setting (for errors)."""
        if self.marker is not None:
            return f"reward.step_marker={self.marker!r}"
        return f"reward.step_delimiter={self.delimiter!r}"

    def spans(self, text: str) -> list[tuple[int, int]]:
        """``(start, end)`` character offsets of each step of ``text``, in order: the step is
        ``text[start:end]``, its first and last characters not whitespace.

        Args:
            text: a response.
        """
        if self.marker is not None:
            cuts = [m.start() for m in re.finditer(self.marker, text) if m.start() > 0]
            bounds = list(zip([0, *cuts], [*cuts, len(text)]))
        else:
            bounds, start = [], 0
            while True:
                at = text.find(self.delimiter, start)
                if at < 0:
                    bounds.append((start, len(text)))
                    break
                bounds.append((start, at))
                start = at + len(self.delimiter)
        out = []
        for start, end in bounds:
            piece = text[start:end]
            stripped = piece.strip()
            if stripped:
                first = start + (len(piece) - len(piece.lstrip()))
                out.append((first, first + len(stripped)))
        return out

    def texts(self, text: str) -> list[str]:
        """The steps of ``text``, as a step reward function receives them.

        Args:
            text: a response.
        """
        return [text[s:e] for s, e in self.spans(text)]


def unescape(text: str) -> str:
    """``text`` with the escapes a command line cannot type as characters made the characters:
    ``\\n`` a newline, ``\\t`` a tab (``reward.step_delimiter='\\n\\n'``: a blank line).

    Args:
        text: a setting's value as given.
    """
    return text.replace("\\n", "\n").replace("\\t", "\t")


def is_step_output(out, name: str = "reward") -> bool:
    """Whether a reward function's return value gives values per step: a list (or tuple) whose
    every element is a list, tuple or 1-D array/tensor (one per response). A mix of floats and
    lists is an error.

    Args:
        out: what a reward function returned.
        name: the reward's name, for errors.
    """
    if not isinstance(out, (list, tuple)) or not out:
        return False
    nested = [isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) == 1 for v in out]
    if any(nested) and not all(nested):
        row = nested.index(False)
        raise ConfigError(f"Reward {name!r} returned a list per response for some rows and a {type(out[row]).__name__} "
                          f"for row {row}: return one float per response, or one list of floats "
                          "per response (one value per step; [] for a response without steps).")
    return all(nested)


def token_text_ends(tokenizer, ids: Sequence[int], text: str | None = None,
                    window: int = 8) -> list[int]:
    """``ends[t]``: how many characters of ``text`` (the decoded ``ids``, special tokens left out)
    are complete once token ``t`` is read, nondecreasing.

    By definition ``ends[t]`` is the common prefix of ``decode(ids[:t + 1])`` and ``text``: a
    character split over several tokens (a multi-byte UTF-8 character in a byte-level vocabulary)
    counts from the token that completes it, a special token adds nothing. Computed from windows
    of ``window`` tokens: what ``decode(ids[t - window:t + 1])`` adds to
    ``decode(ids[t - window:t])`` (vLLM's incremental detokenisation), checked to rebuild
    ``text`` exactly; else (a decoder whose spaces depend on what follows, bytes that never form a
    character) from every prefix, as defined.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the tokenizer that sampled ``ids``.
        ids: the response's token ids.
        text: ``tokenizer.decode(ids, skip_special_tokens=True)`` (None: decoded here).
        window: the tokens of context each token is decoded with.

    Example:
        >>> token_text_ends(tokenizer, tokenizer("a✓b", add_special_tokens=False).input_ids)
        [1, 1, 2, 3]  # "a", then ✓ (its bytes over two tokens), then "b"
    """
    ids = [int(i) for i in ids]
    if text is None:
        text = tokenizer.decode(ids, skip_special_tokens=True)
    n = len(ids)
    if not n:
        return []
    if _REPLACEMENT not in text:
        starts = [max(0, t - window) for t in range(n)]
        decoded = tokenizer.batch_decode([ids[s:t] for t, s in enumerate(starts)]
                                         + [ids[s:t + 1] for t, s in enumerate(starts)],
                                         skip_special_tokens=True)
        ends, pieces, total = [], [], 0
        for before, after in zip(decoded[:n], decoded[n:]):
            # a window may begin or end inside a character: those bytes decode to U+FFFD, which
            # this text (it has none) never holds
            before, after = before.strip(_REPLACEMENT), after.strip(_REPLACEMENT)
            if not after.startswith(before):
                break
            pieces.append(after[len(before):])
            total += len(after) - len(before)
            ends.append(total)
        else:
            if "".join(pieces) == text:
                return ends
    prefixes = tokenizer.batch_decode([ids[:t + 1] for t in range(n)], skip_special_tokens=True)
    ends, reached = [], 0
    for prefix in prefixes:
        reached = max(reached, len(os.path.commonprefix([prefix, text])))
        ends.append(reached)
    return ends


def step_last_tokens(ends: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """The index of each step's last token: the first ``t`` with ``ends[t] >= end`` (the token
    that completes the step's last character); the last token where none does.

    Args:
        ends: :func:`token_text_ends`' list for the response.
        spans: the steps' ``(start, end)`` character offsets (:meth:`StepSplit.spans`).
    """
    last = len(ends) - 1
    return [min(bisect.bisect_left(ends, end), last) for _, end in spans]


class StepRewards:
    """Puts a reward's values per step on the rollout's tokens: a (B, R) float32 tensor with
    each step's value at its last response token (:func:`step_last_tokens`), 0 elsewhere; values
    of steps that end in the same token add.

    A multi-turn episode's response text is its policy turns, joined by ``"\\n"`` (the
    :class:`~rlhf_torchrl.collectors.MultiTurnCollector`'s ``("text", "response")``): each turn is
    one run of ``("masks", "response")``, decoded on its own.

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer (decodes the
            sampled tokens).
        split: how a response is cut into steps.

    Example:
        >>> steps = StepRewards(tokenizer, StepSplit("\\n"))
        >>> steps.to_tokens("verifier", [[1.0, -1.0]], rollout)  # (1, R): 1 and -1 at two tokens
    """

    def __init__(self, tokenizer, split: StepSplit | None = None):
        self.tokenizer = tokenizer
        self.split = split if split is not None else StepSplit()

    def texts(self, responses: Sequence[str]) -> list[list[str]]:
        """Each response's steps, as a step reward function's ``steps`` argument.

        Args:
            responses: the decoded responses.
        """
        return [self.split.texts(r) for r in responses]

    def to_tokens(self, name: str, values: Sequence[Sequence[float]], td: TensorDictBase,
                  finite: bool = True) -> torch.Tensor:
        """(B, R) float32 on ``td``'s device: ``values[i][k]`` at the last token of step ``k`` of
        response ``i``.

        Args:
            name: the reward's name, for errors.
            values: one list per response, one value per step.
            td: the rollout (response tokens, mask and text).
            finite: refuse NaN or inf (otherwise kept for the divergence guards).
        """
        tokens, mask = td.get(K.RESPONSE_TOKENS), td.get(K.RESPONSE_MASK)
        texts = td.get(K.RESPONSE_TEXT).tolist()
        if len(values) != len(texts):
            raise ConfigError(f"Reward {name!r} returned {len(values)} lists of step values for "
                              f"{len(texts)} responses: it must return one list per response.")
        out = torch.zeros(mask.shape, dtype=torch.float32)
        for row, (row_values, text) in enumerate(zip(values, texts)):
            row_values = _floats(name, row, row_values)
            spans = self.split.spans(text)
            if len(row_values) != len(spans):
                raise ConfigError(
                    f"Reward {name!r} returned {len(row_values)} step value"
                    f"{'s' * (len(row_values) != 1)} for row {row}, which has {len(spans)} step"
                    f"{'s' * (len(spans) != 1)} ({self.split.describe()}): return one value per step, "
                    "as the reward's `steps` argument lists them.")
            if finite and not all(map(_finite, row_values)):
                raise ConfigError(f"Reward {name!r} returned a non-finite step value (NaN or inf) "
                                  f"for row {row}: return finite floats.")
            if not spans:
                continue
            positions = mask[row].nonzero().flatten().tolist()
            ends = self._text_ends(tokens[row], positions, text, name, row)
            for j, value in zip(step_last_tokens(ends, spans), row_values):
                out[row, positions[j]] += value
        return out.to(mask.device)

    def _text_ends(self, tokens: torch.Tensor, positions: list[int], text: str, name: str,
                   row: int) -> list[int]:
        """:func:`token_text_ends` over a row's response tokens, each run of them (a turn)
        decoded on its own and the turns joined by one character (``"\\n"``)."""
        runs: list[list[int]] = []
        for k, p in enumerate(positions):
            if k == 0 or p != positions[k - 1] + 1:
                runs.append([])
            runs[-1].append(int(tokens[p]))
        ends, decoded, offset = [], [], 0
        for run in runs:
            run_text = self.tokenizer.decode(run, skip_special_tokens=True)
            decoded.append(run_text)
            ends.extend(offset + e for e in token_text_ends(self.tokenizer, run, run_text))
            offset += len(run_text) + 1
        if "\n".join(decoded) != text:
            raise ConfigError(
                f"Reward {name!r}: row {row}'s response text is not its response tokens decoded "
                "(skip_special_tokens=True) by the Scorer's tokenizer, so its steps cannot be "
                "placed on tokens: give StepRewards the policy's tokenizer.")
        return ends


def _floats(name: str, row: int, values) -> list[float]:
    try:
        return [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    except (TypeError, ValueError):
        raise ConfigError(f"Reward {name!r} returned step values for row {row} that are not "
                          f"floats ({values!r:.80}): return one float per step.") from None


def _finite(v: float) -> bool:
    return v == v and v not in (float("inf"), float("-inf"))
