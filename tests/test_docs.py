"""The code in README.md and docs/*.md runs, so the documentation cannot rot.

Every ```python block of a page is run; a block fenced ```python no-run is not (it needs
a GPU or several hosts, or is a sketch). A page's runnable blocks run in order, in one
fresh `python` process on the TensorFlow backend, from the repository root, sharing one
namespace (a page's blocks may build on each other). Each block is compiled under the
page's path and its own line numbers, so a failure's traceback points into the Markdown.
The blocks state what they show with plain `assert`s.

The other tests here are cheap: fences are spelled as the runner expects, relative links
resolve, the docs index lists every page, and the README keeps the fresh-machine commands.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RUN, NO_RUN = "python", "python no-run"
TIMEOUT_S = 300  # per page; the pages take 5-40 s each on a 2-core CPU

# The two commands that set keras_mp up on a fresh machine (.ci/run runs the second).
SETUP_COMMANDS = (
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[tensorflow]" && '
    "keras-mp compare",
    "python3 -m venv .venv && . .venv/bin/activate && bash scripts/test.sh",
)

_FENCE = re.compile(r"^(```+)([^\n`]*)\n(.*?)^\1[ \t]*$", re.M | re.S)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def fenced_blocks(path: Path) -> list:
    """`(info, code, first_code_line)` for every fenced block of a Markdown page."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for m in _FENCE.finditer(text):
        first_line = text.count("\n", 0, m.start(3)) + 1
        blocks.append((m.group(2).strip(), m.group(3), first_line))
    return blocks


def runnable_blocks(path: Path) -> list:
    return [(code, line) for info, code, line in fenced_blocks(path) if info == RUN]


# Runs one page: each block compiled with the page's name and its line numbers.
_RUNNER = r"""
import json, sys, time
page, blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for code, line in blocks:
    start = time.perf_counter()
    exec(compile("\n" * (line - 1) + code, page, "exec"), namespace)
    print(f"=== block at {page}:{line} ran in {time.perf_counter() - start:.1f} s", flush=True)
"""

_WITH_CODE = [p for p in PAGES if runnable_blocks(p)]


@pytest.mark.tf_only
@pytest.mark.parametrize("page", _WITH_CODE, ids=[_rel(p) for p in _WITH_CODE])
def test_page_code_runs(page):
    env = dict(
        os.environ,
        KERAS_BACKEND="tensorflow",
        TF_CPP_MIN_LOG_LEVEL="3",
        MPLBACKEND="Agg",
        PYTHONWARNINGS="ignore",
        # `keras-mp` as the README's set-up installs it, next to this interpreter
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    )
    payload = json.dumps([_rel(page), runnable_blocks(page)])
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _RUNNER],
            input=payload,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{_rel(page)}: its code ran past {TIMEOUT_S} s\n{e.stdout or ''}")
    took = time.perf_counter() - start
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"{_rel(page)}: a block failed ({took:.0f} s)\n{tail}"
    print(f"{_rel(page)}: {len(runnable_blocks(page))} block(s) in {took:.1f} s")


def test_python_fences_are_run_or_marked_no_run():
    """A misspelt fence (```py, ```python norun) would silently skip its code."""
    for page in PAGES:
        for info, _code, line in fenced_blocks(page):
            if info.split(" ")[0].lower() in ("py", "python", "python3", "pycon"):
                assert info in (RUN, NO_RUN), f"{_rel(page)}:{line}: fence {info!r}"


def test_relative_links_resolve():
    link = re.compile(r"\]\(([^)\s]+)\)")
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in link.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{_rel(page)}: broken link {target!r}"


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"


def test_readme_keeps_the_fresh_machine_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for command in SETUP_COMMANDS:
        assert f"\n    {command}\n" in readme, command
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
