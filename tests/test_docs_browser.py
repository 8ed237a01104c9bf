"""The built documentation site opened in a real headless Chromium, as the run report is
(tests/test_report_browser.py): on the pages with pictures every image decodes (the iteration
diagram, the report's and the benchmarks' plots), the sidebar shows the version and links the
repository, and the console stays clean.

The site must be built first (``bash .ci/docs``; ``.ci/browser`` builds it when it is missing);
without it, or without Chromium, the tests skip. With ``RLHF_TORCHRL_ARTIFACTS=<dir>`` the
concepts page's screenshot ``docs_concepts.png`` is kept there.
"""

import os
import runpy
from pathlib import Path

import pytest
from browser import Chromium, find_chromium

import rlhf_torchrl

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "_build" / "html"

pytestmark = [
    pytest.mark.skipif(find_chromium() is None,
                       reason="needs Chromium: apt-get install chromium (Debian), or run "
                              ".ci/browser as root"),
    pytest.mark.skipif(not (SITE / "concepts.html").is_file(),
                       reason="the site is not built: bash .ci/docs"),
]

#: page -> the pictures it must show (each named by the end of its file name)
PICTURES = {
    "concepts.html": ["iteration.svg"],
    "index.html": ["iteration.svg"],
    "evaluation.html": ["score.png", "kl.png", "eval_score.png", "time.png"],
    "benchmarks.html": ["compare.png", "collectors.png"],
}

#: what the page shows, read once its images have decoded (or failed to)
READ_PAGE = """(async () => {
  const images = [...document.querySelectorAll("article img")];
  const decoded = await Promise.all(images.map(i => i.decode().then(() => true, () => false)));
  const links = [...document.querySelectorAll(".sidebar-links a")];
  return {
    images: images.map((i, k) => ({src: i.getAttribute("src"), width: i.naturalWidth,
                                   shown: i.getBoundingClientRect().width,
                                   decoded: decoded[k]})),
    sidebar: document.querySelector(".sidebar-links")?.innerText ?? "",
    links: links.map(a => ({text: a.innerText.trim(), href: a.getAttribute("href")})),
  };
})()"""


def repository() -> str:
    """The repository address the site was built with (docs/conf.py, its environment override)."""
    return runpy.run_path(str(ROOT / "docs" / "conf.py"))["REPOSITORY"]


def page_problems(page, pictures: list[str]) -> list[str]:
    """What is wrong with a page of the site as the browser shows it (nothing, when it renders)."""
    shown = page.evaluate(READ_PAGE)
    problems = [f"console: {e}" for e in page.errors]
    for name in pictures:
        found = [i for i in shown["images"] if i["src"].endswith("/" + name)]
        if not found:
            problems.append(f"no picture {name}")
    problems += [f"picture {i['src']} does not load" for i in shown["images"]
                 if not (i["decoded"] and i["width"] > 0 and i["shown"] > 0)]
    version = f"version {rlhf_torchrl.__version__}"
    if version not in shown["sidebar"]:
        problems.append(f"the sidebar lacks {version!r}: {shown['sidebar']!r}")
    if {"text": "source repository", "href": repository()} not in shown["links"]:
        problems.append(f"the sidebar lacks the repository link {repository()}: {shown['links']}")
    return problems


def test_pages_with_pictures_render_in_chromium():
    with Chromium() as browser:
        problems = []
        for name, pictures in PICTURES.items():
            page = browser.open((SITE / name).as_uri())
            problems += [f"{name}: {p}" for p in page_problems(page, pictures)]
            if name == "concepts.html" and (artifacts := os.environ.get("RLHF_TORCHRL_ARTIFACTS")):
                os.makedirs(artifacts, exist_ok=True)
                page.screenshot(os.path.join(artifacts, "docs_concepts.png"))
    assert not problems, "\n".join(problems)


def test_the_check_fails_on_a_broken_page(tmp_path):
    # each defect, planted in a copy of the built concepts page (its links still resolve into the
    # site through <base>), is named by the check
    page = (SITE / "concepts.html").read_text()
    page = page.replace("<head>", f"<head><base href='{SITE.as_uri()}/'>", 1)
    defects = {
        "missing diagram": (page.replace("_images/iteration.svg", "_images/nothing.svg"),
                            ["console: ", "no picture iteration.svg",
                             "picture _images/nothing.svg does not load"]),
        "no version": (page.replace(f"version {rlhf_torchrl.__version__}", "version ?"),
                       ["the sidebar lacks 'version "]),
        "no repository": (page.replace(f'href="{repository()}"', 'href="#"'),
                          ["the sidebar lacks the repository link"]),
        "console error": (page.replace("</body>", "<script>console.error('x')</script></body>"),
                          ["console: console.error: x"]),
    }
    assert all(broken != page for broken, _ in defects.values())  # each defect was planted
    with Chromium() as browser:
        for name, (broken, expected) in defects.items():
            path = tmp_path / f"{name.replace(' ', '_')}.html"
            path.write_text(broken)
            problems = page_problems(browser.open(path.as_uri()), ["iteration.svg"])
            assert len(problems) == len(expected), (name, problems)
            assert all(p.startswith(e) for p, e in zip(sorted(problems), sorted(expected))), \
                (name, problems)
