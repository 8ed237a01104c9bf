"""The generated reference pages checked in under ``docs/_generated/`` (the configuration
reference, the keys, the exports) are what the code gives now: a setting, preset, key or export
changed without writing them again fails here, with the command that does.

The pages are made in a fresh process: the registries' entries are among a setting's allowed
values, and tests register plugins of their own in this one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from doc_snippets import ROOT

SOURCE = ROOT / "docs" / "_ext" / "generated_pages.py"
MAKE = f"""
import importlib.util, json
spec = importlib.util.spec_from_file_location("generated_pages", {str(SOURCE)!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pages = {{}}
for name, make in module.PAGES.items():
    warnings = []
    pages[name] = [make(warnings.append), warnings]
print(json.dumps({{"out": module.OUT, "pages": pages}}))
"""


@pytest.fixture(scope="module")
def generated():
    proc = subprocess.run([sys.executable, "-c", MAKE], capture_output=True, text=True, timeout=300,
                          check=True, cwd=ROOT)
    return json.loads(proc.stdout.strip().splitlines()[-1])


PAGES = ["config_ppo.md", "config_tasks.md", "config_reward_model.md",
         "config_serve_reward_model.md", "keys.md", "exports.md"]


@pytest.mark.parametrize("name", PAGES)
def test_the_checked_in_page_is_the_codes(name, generated):
    assert sorted(generated["pages"]) == sorted(PAGES)
    text, warnings = generated["pages"][name]
    path = ROOT / "docs" / generated["out"] / name
    assert path.exists(), f"docs/_generated/{name} is missing: run python docs/_ext/generated_pages.py"
    assert path.read_text(encoding="utf-8") == text, (
        f"docs/_generated/{name} differs from the code's: run python docs/_ext/generated_pages.py "
        "and commit the page")
    assert not warnings, warnings


def test_every_api_page_says_where_its_text_is_in_the_repository():
    """The API pages are directives; read as Markdown they must say where the text is."""
    pages = [p for p in (ROOT / "docs" / "api").glob("*.md") if "automodule::" in p.read_text()]
    assert pages
    for page in pages:
        assert "python -m pydoc" in page.read_text(), f"{page.name} does not say where its text is"
