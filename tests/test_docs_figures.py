"""The figures the documentation quotes from the presets and the defaults equal the presets'.

Three forms are checked, on every page and the README:

- a setting followed, in the same sentence, by the value a preset gives it, written as
  ``\\`eval.every\\` ... (the sentiment task: 8)`` (or ``preset``);
- a marker before a paragraph or a table that quotes values in prose,
  ``<!-- docs-test: preset sentiment eval.every=8 eval.num_prompts=32 -->`` (``preset default``
  for the task-neutral defaults): each value is the preset's, and the text up to the next blank
  line says it;
- a marker before a table of settings, ``<!-- docs-test: preset-table sentiment column=3 -->``:
  in each row whose first column names as many settings as the given column holds values (split
  at ", "), each value that is a literal (a number, true/false, none, a code span) is the
  preset's.
"""

from __future__ import annotations

import functools
import re

import pytest
from doc_snippets import ROOT
from omegaconf import OmegaConf

from rlhf_torchrl.config import compose

PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TASKS = sorted(p.stem for p in (ROOT / "rlhf_torchrl" / "config" / "task").glob("*.yaml"))
#: "`key`" or "`key=...`", words without a parenthesis or a sentence end, "(the T task: V)"
INLINE = re.compile(r"`(?P<key>[a-z_]+(?:\.[a-z_]+)+)(?:=[^`]*)?`[^()`.]{0,80}?"
                    r"\((?:the )?(?P<task>[a-z_0-9]+) (?:task|preset)(?:'s)?: (?P<value>[^),;]+)")
TABLE = re.compile(r"<!--\s*docs-test:\s*preset-table\s+(?P<task>\S+)\s+column=(?P<column>\d+)\s*-->")
MARKER = re.compile(r"<!--\s*docs-test:\s*preset\s+(?P<task>\S+)\s+(?P<claims>.*?)\s*-->")


@functools.cache
def preset(task: str):
    return compose(["output_dir=/tmp/unused"] + ([] if task == "default" else [f"task={task}"]))


def preset_value(task: str, key: str) -> str:
    value = OmegaConf.select(preset(task), key, throw_on_missing=True)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def same(quoted: str, actual: str) -> bool:
    try:
        return float(quoted) == float(actual)
    except ValueError:
        return quoted.strip("` ") == actual


def inline_claims():
    for page in PAGES:
        for match in INLINE.finditer(page.read_text()):
            if match["task"] in TASKS or match["task"] == "default":
                yield pytest.param(page.name, match["task"], match["key"], match["value"].strip(),
                                   id=f"{page.name}:{match['key']}:{match['task']}")


def marker_claims():
    for page in PAGES:
        text = page.read_text()
        for match in MARKER.finditer(text):
            block = text[match.end():].lstrip("\n").split("\n\n", 1)[0]
            for claim in match["claims"].split():
                key, value = claim.split("=", 1)
                yield pytest.param(page.name, match["task"], key, value, block,
                                   id=f"{page.name}:{key}:{match['task']}")


def _literal(cell: str) -> str | None:
    """A table cell's value when it is a literal: its first word, before a remark."""
    word = re.split(r" \(|: | ", cell.strip(), maxsplit=1)[0]
    if word.startswith("`") and word.endswith("`") and len(word) > 2:
        return word[1:-1]
    if word in ("true", "false"):
        return word
    if word == "none":
        return "null"
    try:
        float(word)
    except ValueError:
        return None
    return word


def table_claims():
    for page in PAGES:
        text = page.read_text()
        for match in TABLE.finditer(text):
            table = text[match.end():].lstrip("\n").split("\n\n", 1)[0]
            column = int(match["column"]) - 1
            for row in table.splitlines()[2:]:
                cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]
                keys = re.findall(r"`([a-z_]+(?:\.[a-z_]+)*)`", cells[0])
                values = cells[column].split(", ") if column < len(cells) else []
                if not keys or len(keys) != len(values):
                    continue
                for key, cell in zip(keys, values):
                    value = _literal(cell)
                    if value is not None:
                        yield pytest.param(page.name, match["task"], key, value,
                                           id=f"{page.name}:table:{key}")


def test_the_checks_find_claims():
    """The forms above occur (the test would pass on nothing if the patterns stopped matching)."""
    assert len(list(inline_claims())) >= 2 and len(list(marker_claims())) >= 2
    assert len(list(table_claims())) >= 30


@pytest.mark.parametrize(("page", "task", "key", "value"), list(inline_claims()))
def test_a_setting_quoted_with_its_preset_value_has_it(page, task, key, value):
    actual = preset_value(task, key)
    assert same(value, actual), (f"{page} says `{key}` is {value} in the {task} preset; it is "
                                 f"{actual} (rlhf_torchrl/config/task/{task}.yaml, ppo.yaml)")


@pytest.mark.parametrize(("page", "task", "key", "value"), list(table_claims()))
def test_a_settings_table_gives_the_presets_values(page, task, key, value):
    actual = preset_value(task, key)
    assert same(value, actual), (f"{page}'s table says `{key}` is {value} in the {task} preset; "
                                 f"it is {actual}")


@pytest.mark.parametrize(("page", "task", "key", "value", "block"), list(marker_claims()))
def test_a_marked_figure_is_the_presets_and_the_text_says_it(page, task, key, value, block):
    assert task in TASKS or task == "default", f"{page}: no preset {task!r} ({TASKS})"
    actual = preset_value(task, key)
    assert same(value, actual), (f"{page}'s marker says {key}={value} in the {task} preset; it "
                                 f"is {actual}")
    assert re.search(rf"(?<![\w.]){re.escape(value)}(?![\w]|\.\d)", block), (
        f"{page}: the text after the marker for {key} does not say {value}:\n{block}")


def test_a_wrong_figure_is_caught():
    """The check itself: a sentence quoting a figure the preset does not have fails."""
    (match,) = INLINE.finditer("With `eval.every=N` (the sentiment task: 5) the recipe")
    assert match["key"] == "eval.every" and match["task"] == "sentiment"
    assert not same(match["value"], preset_value("sentiment", "eval.every"))
    assert same("8", preset_value("sentiment", "eval.every"))



def test_every_install_command_an_error_gives_is_in_the_docs():
    """A missing extra's error gives ``pip install 'rlhf_torchrl[<extra>]'``: the docs say the
    same command where they name the extra."""
    package = ROOT / "rlhf_torchrl"
    commands = {m for path in package.rglob("*.py")
                for m in re.findall(r"pip install '(rlhf_torchrl\[\w+\])'", path.read_text())}
    assert {"rlhf_torchrl[datasets]", "rlhf_torchrl[serve]"} <= commands
    docs = "".join(page.read_text() for page in PAGES)
    missing = sorted(c for c in commands if f"pip install '{c}'" not in docs)
    assert not missing, f"the errors say pip install {missing}; the docs do not"
