"""Pages generated from the code at build time, so they cannot drift from it.

Writes, into ``docs/_generated/`` (included by ``configuration.md``, ``concepts.md`` and
``api/index.md``):

- ``config_ppo.md``: every setting of ``rlhf_torchrl/config/ppo.yaml``, in its order, with its type
  (the structured schema, ``config/schema.py``), its task-neutral default, its allowed values or
  range (``validation.CHOICES``, ``validation.RANGES``), the task presets that set it, and its one-line
  comment (``config.setting_docs``);
- ``config_tasks.md``: each task preset, its header and the settings it overrides;
- ``config_reward_model.md``, ``config_serve_reward_model.md``: every setting of
  ``reward_model.yaml`` and of ``serve_reward_model.yaml``;
- ``keys.md``: every constant of ``rlhf_torchrl/keys.py`` with the key and its comment;
- ``exports.md``: the names ``rlhf_torchrl`` exports, where each is documented, its summary.

A setting without a comment, a schema field missing from ``ppo.yaml`` (or the reverse) and a key
constant without a comment are reported as Sphinx warnings, which ``-W`` turns into errors.

The pages are checked in, so that the configuration reference reads in the repository's browser
too; ``tests/test_docs_generated.py`` fails when one differs from what the code gives now, and
``python docs/_ext/generated_pages.py`` writes them again (the Sphinx build does too).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import re
import types
import typing

import yaml
from omegaconf import OmegaConf

OUT = "_generated"


# --- Markdown helpers --------------------------------------------------------------------------

_SPECIAL = "\\*_[]<>|#{}$!"


def _escape_text(text: str) -> str:
    return "".join("\\" + c if c in _SPECIAL else c for c in text)


def md(text: str) -> str:
    """Text for a Markdown table cell: backtick spans stay code, everything else is literal."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: all literal
        return _escape_text(text)
    out = []
    for i, part in enumerate(parts):
        out.append("`" + part.replace("|", "\\|") + "`" if i % 2 else _escape_text(part))
    return "".join(out)


def code(value: str) -> str:
    """A value as inline code in a table cell (OmegaConf's ``???``, a value that must be given,
    says so)."""
    if value == "???":
        return "`???` (required)"
    value = value.replace("|", "\\|").replace("\n", "\\n")
    fence = "``" if "`" in value else "`"
    pad = " " if value.startswith("`") or value.endswith("`") else ""
    return f"{fence}{pad}{value}{pad}{fence}"


def yaml_value(value) -> str:
    """A config value as YAML writes it in flow style (``null``, ``true``, ``[a, b]``)."""
    if isinstance(value, str) and "\n" in value:
        return json.dumps(value)  # a double-quoted YAML scalar, newlines as \\n
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9,
                          allow_unicode=True).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def type_name(tp) -> str:
    """A schema annotation as a reader writes it: ``int``, ``float | null``, ``list[str]``."""
    if tp is type(None):
        return "null"
    if tp is typing.Any:
        return "any"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(type_name(a) for a in typing.get_args(tp))
        return f"{origin.__name__}[{args}]"
    return getattr(tp, "__name__", str(tp))


def flatten(node, prefix: str = "") -> dict:
    """Dotted keys of a nested dict, in file order; dicts that are values stay whole (a section's
    groups, ``reward.judge``, are opened: the schema's nested dataclasses)."""
    out = {}
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and (not prefix and key not in ("defaults",)
                                        or dotted in _schema_groups()):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _yaml_comment_sections(path: str) -> dict[str, str]:
    """The comment after each top-level section header (``checkpoint:  # ...``)."""
    sections = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line[:1] in (" ", "#", "-", "\n") or ":" not in line:
                continue
            key, rest = line.split(":", 1)
            value, _, comment = rest.partition("#")
            if not value.strip():
                sections[key.strip()] = comment.strip()
    return sections


def _header_comment(path: str) -> list[str]:
    """The comment lines a YAML file opens with (``# @package`` left out)."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.startswith("#"):
                break
            if not line.startswith("# @package"):
                lines.append(line[1:].strip())
    return lines


# --- the PPO configuration ---------------------------------------------------------------------


def _documented(docs: dict[str, str], key: str, source: str, warn) -> str:
    """``key``'s comment as Markdown; a warning (an error under -W) where ``source`` has none."""
    if docs.get(key):
        return md(docs[key])
    warn(f"config reference: setting {key!r} has no comment in {source}")
    return "**(undocumented)**"


@functools.lru_cache(maxsize=1)
def _schema_groups() -> frozenset[str]:
    """The dotted names of the groups within sections (the schema's dataclasses below the top)."""
    from rlhf_torchrl.config.schema import PPOConfig

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                if prefix:
                    yield f"{prefix}{f.name}"
                yield from walk(tp, f"{prefix}{f.name}.")

    return frozenset(walk(PPOConfig, ""))


def _schema_types() -> dict[str, object]:
    from rlhf_torchrl.config.schema import PPOConfig

    out = {}

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = tp

    walk(PPOConfig, "")
    return out


def _allowed(key: str) -> str:
    from rlhf_torchrl.config.validation import CHOICES, RANGES, _describe

    if key in CHOICES:
        return ", ".join(code(yaml_value(v)) for v in CHOICES[key])
    if key in RANGES:
        return md(_describe(*RANGES[key]))
    return ""


def _tasks() -> dict[str, dict]:
    from rlhf_torchrl.config import CONFIG_DIR, tasks, yaml_comments

    out = {}
    for name in tasks():
        path = os.path.join(CONFIG_DIR, "task", f"{name}.yaml")
        out[name] = {"path": path,
                     "settings": flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}),
                     "header": _header_comment(path), "comments": yaml_comments(path)}
    return out


def ppo_reference(warn) -> str:
    from rlhf_torchrl.config import CONFIG_DIR, setting_docs

    path = os.path.join(CONFIG_DIR, "ppo.yaml")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    settings = {k: v for k, v in flatten(raw).items() if k != "defaults" and not k.startswith("hydra.")}
    docs, types_, sections = setting_docs("ppo"), _schema_types(), _yaml_comment_sections(path)
    tasks = _tasks()
    for key in types_.keys() - settings.keys():
        warn(f"config reference: schema field {key!r} has no default in ppo.yaml")
    for key in settings.keys() - types_.keys():
        warn(f"config reference: ppo.yaml setting {key!r} is not in the schema (config/schema.py)")

    lines = ["<!-- generated by docs/_ext/generated_pages.py from rlhf_torchrl/config: do not edit -->", ""]
    groups: dict[str, list[str]] = {}
    for key in settings:
        groups.setdefault(key.split(".")[0] if "." in key else "", []).append(key)
    header = ["| setting | type, default | what it does |", "|---|---|---|"]
    for group, keys in groups.items():
        title = "Top-level settings" if group == "" else f"`{group}`"
        lines += [f"### {title}", ""]
        if group and sections.get(group):
            lines += [md(sections[group]), ""]
        lines += header
        for key in keys:
            doc = _documented(docs, key, "ppo.yaml", warn)
            setters = ", ".join(f"`{t}`" for t, spec in tasks.items() if key in spec["settings"])
            extra = "".join(f" *{label}:* {value}." for label, value in
                            (("Allowed", _allowed(key)), ("Set by task", setters)) if value)
            lines.append(f"| `{key}` | {md(type_name(types_.get(key, type(None))))}, "
                         f"{code(yaml_value(settings[key]))} | {doc}{'.' if extra and not doc.endswith('.') else ''}{extra} |")
        lines.append("")
    return "\n".join(lines)


def tasks_reference(warn) -> str:
    from rlhf_torchrl.config import CONFIG_DIR

    raw = OmegaConf.to_container(OmegaConf.load(os.path.join(CONFIG_DIR, "ppo.yaml")), resolve=False)
    defaults = flatten(raw)
    lines = ["<!-- generated by docs/_ext/generated_pages.py from rlhf_torchrl/config/task: do not edit -->", ""]
    for name, spec in _tasks().items():
        lines += [f"### `task={name}`", ""]
        if spec["header"]:
            lines += [md(" ".join(line.strip() for line in spec["header"])), ""]  # wraps
        settings = spec["settings"]
        if not settings:
            lines += ["Overrides nothing: `ppo.yaml`'s task-neutral settings apply.", ""]
            continue
        lines += ["| setting | this task | task-neutral default | note |", "|---|---|---|---|"]
        for key, value in settings.items():
            if key not in defaults:
                warn(f"config reference: task {name!r} sets {key!r}, which ppo.yaml does not have")
            lines.append(f"| `{key}` | {code(yaml_value(value))} | "
                         f"{code(yaml_value(defaults.get(key)))} | {md(spec['comments'].get(key, ''))} |")
        lines.append("")
    return "\n".join(lines)


def reward_model_reference(warn, name: str = "reward_model") -> str:
    """Every setting of ``<name>.yaml`` (reward-model training, or the reward-model server)."""
    from rlhf_torchrl.config import CONFIG_DIR, setting_docs

    path = os.path.join(CONFIG_DIR, f"{name}.yaml")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    settings = {k: v for k, v in flatten(raw).items() if k != "defaults" and not k.startswith("hydra.")}
    docs = setting_docs(name)
    lines = ["<!-- generated by docs/_ext/generated_pages.py from rlhf_torchrl/config: do not edit -->", "",
             "| setting | default | what it does |", "|---|---|---|"]
    for key, value in settings.items():
        doc = _documented(docs, key, f"{name}.yaml", warn)
        lines.append(f"| `{key}` | {code(yaml_value(value))} | {doc} |")
    return "\n".join(lines) + "\n"


# --- the rollout keys --------------------------------------------------------------------------


def _key_text(value) -> str:
    """A key as the code writes it: ``("tokens", "prompt")``, ``"score"``."""
    if isinstance(value, tuple):
        return "(" + ", ".join(_key_text(v) for v in value) + ")"
    return json.dumps(value)


def keys_reference(warn) -> str:
    """Every key constant of keys.py with the comment above it (a comment covers the constants that
    follow it up to a blank line)."""
    import rlhf_torchrl.keys as keys

    with open(keys.__file__, encoding="utf-8") as f:
        source = f.read()
    lines_of = source.splitlines()
    tree = ast.parse(source)
    rows = []
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        # walk up over assignments without a blank line between them, then collect the comment
        i = node.lineno - 2
        while i >= 0 and lines_of[i].strip() and not lines_of[i].lstrip().startswith("#"):
            i -= 1
        comment = []
        while i >= 0 and lines_of[i].lstrip().startswith("#"):
            comment.insert(0, lines_of[i].lstrip()[1:].strip())
            i -= 1
        if not comment:
            warn(f"keys reference: keys.{name} has no comment above it in keys.py")
        value = getattr(keys, name)
        rows.append(f"| `{name}` | {code(_key_text(value))} | {md(' '.join(comment)) or '**(undocumented)**'} |")
    return "\n".join(["<!-- generated by docs/_ext/generated_pages.py from rlhf_torchrl/keys.py: do not edit -->",
                      "", "| constant (`rlhf_torchrl.keys`) | key | shape, dtype and meaning |",
                      "|---|---|---|", *rows, ""])


# --- the top-level exports --------------------------------------------------------------------


def exports_reference(warn) -> str:
    """``rlhf_torchrl.__all__``: each name, where it is documented and its docstring's first line."""
    import inspect

    import rlhf_torchrl

    rows = []
    for name in rlhf_torchrl.__all__:
        obj = getattr(rlhf_torchrl, name)
        if inspect.ismodule(obj):
            where = f"{{py:mod}}`{obj.__name__}`"
        else:
            where = f"{{py:obj}}`{obj.__module__}.{obj.__qualname__}`"
        doc = (inspect.getdoc(obj) or "").strip().split("\n\n")[0].replace("\n", " ")
        if not doc:
            warn(f"API reference: rlhf_torchrl.{name} has no docstring")
        doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", doc.replace("``", "`"))  # reST roles as code
        rows.append(f"| `{name}` | {where} | {md(doc)} |")
    return "\n".join(["<!-- generated by docs/_ext/generated_pages.py from rlhf_torchrl.__all__: do not edit -->",
                      "", "| name | documented in | summary |", "|---|---|---|", *rows, ""])


# --- Sphinx ------------------------------------------------------------------------------------

PAGES = {
    "config_ppo.md": ppo_reference,
    "config_tasks.md": tasks_reference,
    "config_reward_model.md": reward_model_reference,
    "config_serve_reward_model.md": lambda warn: reward_model_reference(warn, "serve_reward_model"),
    "keys.md": keys_reference,
    "exports.md": exports_reference,
}


def write_pages(app) -> None:
    from sphinx.util import logging

    logger = logging.getLogger(__name__)

    def warn(message, name):
        logger.warning(message, location=os.path.join(OUT, name))

    write(os.path.join(app.srcdir, OUT), warn)


def write(out: str, warn) -> None:
    """Writes each page that differs from the code's into ``out``."""
    os.makedirs(out, exist_ok=True)
    for name, make in PAGES.items():
        text = make(functools.partial(warn, name=name))
        path = os.path.join(out, name)
        old = open(path, encoding="utf-8").read() if os.path.exists(path) else None
        if text != old:  # unchanged files keep their mtime: no needless rebuild of the pages
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)


def setup(app):
    app.connect("builder-inited", write_pages)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":  # python docs/_ext/generated_pages.py: the checked-in pages, again
    import sys

    write(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), OUT),
          lambda message, name: print(f"{OUT}/{name}: {message}", file=sys.stderr))
