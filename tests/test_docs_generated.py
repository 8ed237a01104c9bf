"""The generated reference pages checked in under ``docs/_generated/`` (the configuration
reference, the keys, the exports) are what the code gives now: a setting, preset, key or export
changed without writing them again fails here, with the command that does."""

from __future__ import annotations

import importlib.util

import pytest
from doc_snippets import ROOT

SOURCE = ROOT / "docs" / "_ext" / "generated_pages.py"


def _generator():
    spec = importlib.util.spec_from_file_location("generated_pages", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _generator()


@pytest.mark.parametrize("name", sorted(GENERATOR.PAGES))
def test_the_checked_in_page_is_the_codes(name):
    warnings = []
    text = GENERATOR.PAGES[name](warnings.append)
    path = ROOT / "docs" / GENERATOR.OUT / name
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
