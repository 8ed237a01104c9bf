"""The code blocks of the documentation (``docs/**/*.md`` and ``README.md``), as the tests in
``tests/test_docs.py`` run them.

Every ``bash`` and ``python`` block is taken. An HTML comment among those just above a block's
fence (invisible on the rendered page) says how it is tested::

    <!-- docs-test: run [KEY=VALUE ...] [replace=OLD->NEW ...] [continue] [save=FILE] [setup] -->
    <!-- docs-test: check [KEY=VALUE ...] -->
    <!-- docs-test: skip REASON -->

- ``run``: the block is run. A ``python`` block runs in a fresh namespace (``continue``: in the
  namespace the page's previous ``python`` block left), each ``replace=OLD->NEW`` applied to its
  text first (a tiny model for a real one, one iteration for three). In a ``bash`` block each
  command runs in a subprocess, from a folder that holds the files the docs name, with tiny
  settings for what the command leaves unset (and the marker's ``KEY=VALUE`` after those).
  ``save=FILE``: the block is a file the other blocks use (``my_rewards.py``), written into the
  docs folder; ``setup``: the block is run in the docs folder when it is made (it writes the
  files others read, e.g. a prompt file).
- ``check``: each command of a ``bash`` block is composed and put through every check a run makes
  before it loads weights (the settings, the models' configs, the reward functions and tools, the
  prompt file), with tiny models in place of hub models; nothing is trained.
- ``skip``: not run, for the reason given (a GPU, several machines, the network, hours).

Without a marker, a ``python`` block is ``run`` and a ``bash`` block ``check`` (a block of
commands that ``check`` cannot take, e.g. ``pip install``, must say ``run`` or ``skip``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w{}-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ ]*$",
                   re.M | re.S)
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<spec>.*?)\s*-->")
MODES = ("run", "check", "skip")


@dataclass
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    text: str
    mode: str
    reason: str = ""
    overrides: list[str] = field(default_factory=list)
    replace: list[tuple[str, str]] = field(default_factory=list)
    cont: bool = False
    save: str | None = None  # the file the block is (written into the docs folder)
    setup: bool = False  # run while the docs folder is made: it writes files others read

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def doc_files() -> list[Path]:
    return sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("docs/api/*.md"), ROOT / "README.md"])


def blocks(path: Path) -> list[Block]:
    """The ``bash`` and ``python`` blocks of one Markdown file, with their markers."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        lang = m.group("lang")
        if lang not in ("bash", "python"):
            continue
        line = text.count("\n", 0, m.start()) + 1
        marker = None
        for before in reversed(text[:m.start()].rstrip("\n").split("\n")[-3:]):
            if not before.strip().startswith("<!--"):
                break  # the HTML comments right above the fence (another may share them)
            marker = marker or MARKER.search(before)
        block = Block(str(path.relative_to(ROOT)), line, lang, _dedent(m.group("body"), m.group("indent")),
                      "run" if lang == "python" else "check")
        if marker:
            spec = marker.group("spec")
            mode, _, rest = spec.partition(" ")
            if mode not in MODES:
                raise ValueError(f"{block.id}: docs-test marker {spec!r}: the mode is one of {MODES}")
            block.mode = mode
            if mode == "skip":
                block.reason = rest.strip()
                if not block.reason:
                    raise ValueError(f"{block.id}: docs-test: skip needs a reason")
            else:
                for token in shlex.split(rest):
                    if token == "continue":
                        block.cont = True
                    elif token == "setup":
                        block.setup = True
                    elif token.startswith("save="):
                        block.save = token[len("save="):]
                    elif token.startswith("replace="):
                        old, sep, new = token[len("replace="):].partition("->")
                        if not sep:
                            raise ValueError(f"{block.id}: replace=OLD->NEW, got {token!r}")
                        block.replace.append((old, new))
                    else:
                        block.overrides.append(token)
        out.append(block)
    return out


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def _dedent(body: str, indent: str) -> str:
    return "\n".join(line[len(indent):] if line.startswith(indent) else line
                     for line in body.splitlines())


ANSI_C = re.compile(r"\$'((?:[^'\\]|\\.)*)'")


def commands(text: str) -> list[list[str]]:
    """The commands of a ``bash`` block, each as its words: continuation lines joined, comments
    dropped, ``a && b`` split in two, ``$'...'`` decoded as bash does."""
    text = text.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = ANSI_C.sub(lambda m: shlex.quote(m.group(1).encode().decode("unicode_escape")), line)
        words = shlex.split(line, comments=True)
        while words:
            if "&&" in words:
                i = words.index("&&")
                out.append(words[:i])
                words = words[i + 1:]
            else:
                out.append(words)
                words = []
    return [c for c in out if c]


#: the commands a check or a run takes: (words that start it, the command of rlhf-torchrl)
ENTRY_POINTS = {
    ("rlhf-torchrl", "ppo"): "ppo",
    ("python", "recipes/ppo.py"): "ppo",
    ("rlhf-torchrl", "evaluate"): "evaluate",
    ("python", "recipes/evaluate_policy.py"): "evaluate",
    ("rlhf-torchrl", "reward-model"): "reward-model",
    ("python", "recipes/reward_model.py"): "reward-model",
    ("rlhf-torchrl", "report"): "report",
}


def entry_point(words: list[str]) -> tuple[str | None, list[str], dict[str, str]]:
    """(the rlhf-torchrl command, its arguments, the environment variables set before it) of a
    command's words; None for any other program."""
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words[0].partition("=")
        env[key] = value
        words = words[1:]
    for start, name in ENTRY_POINTS.items():
        if tuple(words[:2]) == start:
            return name, words[2:], env
    return None, words, env
