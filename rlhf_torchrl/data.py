"""Prompt sets: a Hugging Face dataset, a local JSON-lines file, or the bundled review sentences.

All loaders return ``list[str]`` of user messages. :func:`check_prompts` validates them against
the tokenizer (chat template applied, as the generation env does) before any work starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: Built-in offline prompt set: the 200 movie-review sentences gensim ships (Pang & Lee polarity).
POLARITY = "polarity"


def polarity_sentences() -> list[tuple[str, str]]:
    """``(label, sentence)`` pairs from gensim's ``pang_lee_polarity.cor`` (labels ``pos``/``neg``)."""
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("The 'polarity' prompt set needs gensim: `pip install gensim`.")
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
) -> list[str]:
    """Load prompts.

    Args:
        source: ``"polarity"`` (bundled review sentences), a path to a ``.jsonl`` file (one JSON
            object per line with a ``column`` field), or a Hugging Face dataset: a hub name or a
            local directory (``datasets.load_dataset(source, split=split)``).
        split: dataset split (HF datasets only).
        column: the field holding the prompt text.
        template: a format string applied to each prompt, e.g.
            ``"Continue this review: {prompt}"``.
        limit: keep the first ``limit`` prompts.
        max_words: keep only the first ``max_words`` words of each prompt (before templating),
            e.g. to turn review sentences into review openings to continue.
    """
    if "{prompt}" not in template:
        raise ValueError(f"data.template must contain '{{prompt}}', got {template!r}.")
    if source == POLARITY:
        raw = [text for _, text in polarity_sentences()]
    elif os.path.isfile(source) or source.endswith((".jsonl", ".json")):
        raw = _read_jsonl(source, column)
    else:
        raw = _read_hf_dataset(source, split, column)
    if max_words is not None:
        raw = [" ".join(p.split()[:max_words]) for p in raw]
    prompts = [template.format(prompt=p) for p in raw[:limit]]
    if not prompts:
        raise ValueError(f"The prompt set {source!r} is empty: point data.source at prompts.")
    return prompts


def _read_jsonl(path: str, column: str) -> list[str]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"Prompt file {path!r} does not exist.")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from e
            if not isinstance(row, dict) or column not in row:
                raise ValueError(
                    f"{path}:{lineno}: expected an object with a {column!r} field "
                    f"(set data.column to the field holding the prompt)."
                )
            prompts.append(_as_text(row[column], f"{path}:{lineno}"))
    return prompts


def _read_hf_dataset(name: str, split: str, column: str) -> list[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"Loading the dataset {name!r} needs the `datasets` package: "
            "`pip install 'rlhf_torchrl[datasets]'` (or pass a local .jsonl file)."
        ) from e
    ds = datasets.load_dataset(name, split=split)
    if column not in ds.column_names:
        raise ValueError(
            f"Dataset {name!r} has no column {column!r}; its columns are {ds.column_names}. "
            "Set data.column."
        )
    return [_as_text(x, f"{name}[{i}]") for i, x in enumerate(ds[column])]


def _as_text(value, where: str) -> str:
    # chat-format rows ([{"role": "user", "content": ...}, ...]): take the last user message
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1].get("content")
    if not isinstance(value, str):
        raise ValueError(f"{where}: the prompt is a {type(value).__name__}, expected text.")
    return value


def templated_length(tokenizer, prompt: str, system_prompt: str | None = None) -> int:
    """Number of tokens of ``prompt`` once the chat template is applied (generation prompt on)."""
    messages = [{"role": "user", "content": prompt}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def check_prompts(
    prompts: list[str],
    tokenizer,
    *,
    max_prompt_length: int,
    truncate: bool = False,
    system_prompt: str | None = None,
) -> tuple[list[str], int]:
    """Check every prompt fits ``max_prompt_length`` tokens (template included).

    With ``truncate``, over-long prompts lose tokens from the left (the end of a prompt is what
    the response follows); returns the prompts and how many were truncated. Otherwise raises,
    naming the first offending prompt.
    """
    if not prompts:
        raise ValueError("The prompt set is empty: point data.source at prompts.")
    out, n_truncated = [], 0
    for i, prompt in enumerate(prompts):
        length = templated_length(tokenizer, prompt, system_prompt)
        if length <= max_prompt_length:
            out.append(prompt)
            continue
        if not truncate:
            raise ValueError(
                f"Prompt {i} is {length} tokens with the chat template, over "
                f"data.max_prompt_length={max_prompt_length}: {prompt[:80]!r}... Raise "
                "data.max_prompt_length, or set data.truncate_prompts=true to cut prompts from "
                "the left."
            )
        overhead = length - len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        keep = max_prompt_length - overhead
        if keep <= 0:
            raise ValueError(
                f"The chat template alone is {overhead} tokens, over "
                f"data.max_prompt_length={max_prompt_length}: raise it."
            )
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"][-keep:]
        prompt = tokenizer.decode(ids)
        # re-tokenising decoded text can differ by a token or two: trim until it fits
        while templated_length(tokenizer, prompt, system_prompt) > max_prompt_length and ids:
            ids = ids[1:]
            prompt = tokenizer.decode(ids)
        out.append(prompt)
        n_truncated += 1
    return out, n_truncated
