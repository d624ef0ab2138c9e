"""Every fenced bash and python block of the README, BENCHMARKS.md and the documentation site:
run as written (or as its smaller variant) in a scratch directory, or, where it needs what CI
lacks, checked without running (tests/doc_examples.py says how a page marks which)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_examples import ROOT, blocks, check_statically, documents, excerpt_problem

pytestmark = pytest.mark.docs
ALL = [b for path in documents() for b in blocks(path)]
RUN_TIMEOUT_S = 900
# what a block may refer to by a relative path, linked into its scratch directory
SHARED = ["configs", "scripts", "examples", "docs", "mkdocs.yml", "README.md", "BENCHMARKS.md"]


def _id(block) -> str:
    return block.name


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    for name in SHARED:
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _run(cmd: list[str], cwd: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, (f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                                  f"\n--- stderr\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("block", [b for b in ALL if b.how in ("run", "instead")], ids=_id)
def test_block_runs(block, scratch):
    if block.how == "instead":
        assert check_statically(block) == [], "the block itself must stay valid"
        _run(["bash", "-euo", "pipefail", "-c", block.arg], scratch)
    elif block.lang == "bash":
        _run(["bash", "-euo", "pipefail", "-c", block.code], scratch)
    else:
        _run([sys.executable, "-c", block.code], scratch)


@pytest.mark.parametrize("block", [b for b in ALL if b.how == "skip"], ids=_id)
def test_skipped_block_still_valid(block):
    """Checked without running; then reported as skipped with the page's reason."""
    assert check_statically(block) == []
    pytest.skip(block.arg)


@pytest.mark.parametrize("block", [b for b in ALL if b.how == "excerpt"], ids=_id)
def test_excerpt_is_verbatim(block):
    assert excerpt_problem(block) is None
    assert check_statically(block) == []


@pytest.mark.parametrize("block", [b for b in ALL if b.how == "fails"], ids=_id)
def test_block_that_shows_an_error_is_refused(block):
    assert check_statically(block) != [], "the page shows an error this command no longer gives"


def test_every_page_has_its_blocks_collected():
    """A fence the collector misread (an unknown marker, a block without its reason) would drop
    examples silently: count fences another way."""
    fences = sum(sum(1 for ln in p.read_text().splitlines()
                     if ln.startswith(("```bash", "```python"))) for p in documents())
    assert len(ALL) == fences
    assert any(b.path.name == "README.md" and b.how == "run" for b in ALL)
