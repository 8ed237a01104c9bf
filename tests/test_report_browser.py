"""The run report of a finished tiny run, opened in a real headless Chromium: every plot decodes,
the verdict and the sample tables are there, the console stays clean; a screenshot is kept. The
report of several runs overlaid, too.

With ``RLHF_TORCHRL_ARTIFACTS=<dir>`` set (``.ci/browser``), ``report.html`` and its screenshot
``report.png`` are copied there: pytest deletes a passed test's run directory.
"""

import os
import shutil
import struct

import pytest
from browser import Chromium, find_chromium
from test_recipe import _cfg, ppo

from rlhf_torchrl.record.compare import COMPARED
from rlhf_torchrl.record.report import PLOTS
from rlhf_torchrl.record.report_command import main as report_command

pytestmark = pytest.mark.skipif(
    find_chromium() is None,
    reason="needs Chromium: apt-get install chromium (Debian), or run .ci/browser as root")

#: what the page shows, read in the browser once the images have decoded (or failed to)
READ_PAGE = """(async () => {
  const images = [...document.images];
  const decoded = await Promise.all(images.map(i => i.decode().then(() => true, () => false)));
  const rows = id => document.querySelectorAll(`table#${id} tr:has(td)`).length;
  return {
    images: images.map((i, k) => ({title: i.title, width: i.naturalWidth,
                                   height: i.naturalHeight, decoded: decoded[k]})),
    verdict: [...document.querySelectorAll("#verdict li")].map(li => li.innerText),
    rows: {samples_before: rows("samples_before"), samples_after: rows("samples_after"),
           held_out_samples: rows("held_out_samples")},
  };
})()"""


def report_problems(page, report: dict) -> list[str]:
    """What is wrong with the report as the browser shows it (nothing, when it renders)."""
    shown = page.evaluate(READ_PAGE)
    problems = [f"console: {e}" for e in page.errors]
    titles = [title for _, title, _, _ in PLOTS]
    if [i["title"] for i in shown["images"]] != titles:
        problems.append(f"plots {[i['title'] for i in shown['images']]}, expected {titles}")
    problems += [f"plot {i['title']!r} does not decode" for i in shown["images"]
                 if not (i["decoded"] and i["width"] > 0 and i["height"] > 0)]
    if not shown["verdict"] or not shown["verdict"][0].startswith("Verdict: "):
        problems.append(f"verdict {shown['verdict']}")
    for key, count in shown["rows"].items():
        if count != len(report[key]):
            problems.append(f"table {key}: {count} rows, report.json has {len(report[key])}")
    return problems


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_llama_dir):
    """A finished tiny run with every plot (groups, KL in the loss, tool episodes, evaluation)."""
    run_dir = tmp_path_factory.mktemp("browser_run")
    report = ppo.train(_cfg(run_dir, tiny_llama_dir, "ppo.num_iterations=3", "eval.every=2",
                            "generation.samples_per_prompt=2", "advantage.estimator=rloo",
                            "advantage.filter_groups=true", "ppo.kl_loss_coef=0.01",
                            "env.max_turns=2", "env.tools=[calculator]",
                            "data.chat_template=null"))
    return run_dir, report


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", header[16:24])  # IHDR: width, height


def test_report_renders_in_chromium(finished_run):
    run_dir, report = finished_run
    with Chromium() as browser:
        page = browser.open((run_dir / "report.html").as_uri())
        problems = report_problems(page, report)
        page.screenshot(str(run_dir / "report.png"))
    if artifacts := os.environ.get("RLHF_TORCHRL_ARTIFACTS"):
        os.makedirs(artifacts, exist_ok=True)
        for name in ("report.html", "report.png"):
            shutil.copy(run_dir / name, artifacts)
    assert not problems, "\n".join(problems)
    width, height = _png_size(run_dir / "report.png")
    assert width == 1400 and height > 2000  # the whole page, not the 1400 x 900 window


def test_the_check_fails_on_a_broken_report(finished_run, tmp_path):
    # each defect, planted in a copy of the real page, is named by the check
    run_dir, report = finished_run
    page = (run_dir / "report.html").read_text()
    defects = {
        # the first plot's PNG signature (base64 "iVBORw0K") overwritten
        "corrupt plot": (page.replace("base64,iVBORw0K", "base64,AAAAAAAA", 1),
                         [f"plot {PLOTS[0][1]!r} does not decode"]),
        "script error": (page.replace("</body>", "<script>null.x</script></body>"),
                         ["console: uncaught: TypeError: Cannot read properties of null"]),
        "console error": (page.replace("</body>", "<script>console.error('x')</script></body>"),
                          ["console: console.error: x"]),
        "no verdict": (page.replace("id='verdict'", ""), ["verdict []"]),
        "no table": (page.replace("<table id='samples_after'>", "<table>"),
                     [f"table samples_after: 0 rows, report.json has "
                      f"{len(report['samples_after'])}"]),
    }
    with Chromium() as browser:
        for name, (broken, expected) in defects.items():
            path = tmp_path / f"{name.replace(' ', '_')}.html"
            path.write_text(broken)
            problems = report_problems(browser.open(path.as_uri()), report)
            assert len(problems) == len(expected), (name, problems)
            assert all(p.startswith(e) for p, e in zip(problems, expected)), (name, problems)


def test_report_of_several_runs_renders_in_chromium(finished_run, tmp_path):
    # the finished run twice (its metrics and report.json), as two seeds would be
    run_dir, _ = finished_run
    runs = []
    for seed in ("seed0", "seed1"):
        (tmp_path / seed).mkdir()
        for name in ("metrics.jsonl", "report.json"):
            shutil.copy(run_dir / name, tmp_path / seed)
        runs.append(str(tmp_path / seed))
    report_command([*runs, "--out", str(tmp_path / "both")])
    with Chromium() as browser:
        page = browser.open((tmp_path / "both" / "report.html").as_uri())
        shown = page.evaluate("""(async () => {
          const images = [...document.images];
          const decoded = await Promise.all(images.map(i => i.decode().then(() => true, () => false)));
          return {titles: images.map(i => i.title), decoded: decoded,
                  runs: document.querySelectorAll("table#runs tr").length,
                  verdicts: document.querySelectorAll("ul.verdict").length};
        })()""")
        errors = page.errors
    assert not errors, errors
    assert shown["titles"] == [title for _, title, _, _ in COMPARED] and all(shown["decoded"])
    assert shown["runs"] == 4 and shown["verdicts"] == 2  # a header, two runs, their mean [range]
