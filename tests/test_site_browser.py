"""The documentation site in a real browser at 1280 px: no identifier in a table cell breaks
inside a word, wide tables and code blocks scroll, and the benchmark pages show their plots.
Screenshots of the home page, a guide, the config reference and a benchmark page are kept in
the test's folder (docs/bench-logs/site/ holds a set taken so).

Needs Debian's `chromium` and the docs extra (mkdocs); skipped where chromium is absent.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_examples import ROOT

pytestmark = pytest.mark.browser
WIDTH = 1280
PAGES = {"home": "index.html", "guide": "guides/chat-models/index.html",
         "config": "reference/config/index.html", "benchmark": "benchmarks/real-model/index.html"}
# counts, once the page has laid out: table-cell identifiers (code without a space: a value
# with spaces may wrap at them) drawn on more than one line, and
# wide tables or code blocks whose overflow is hidden instead of scrolled
PROBE = r"""<script>window.addEventListener('load', () => {
  const split = [...document.querySelectorAll('td code, th code')]
    .filter(c => !/\s/.test(c.textContent) && c.getClientRects().length > 1)
    .map(c => c.textContent);
  const hidden = [...document.querySelectorAll('.md-typeset__scrollwrap, pre > code')]
    .filter(e => e.scrollWidth > e.clientWidth + 1 &&
                 !['auto', 'scroll'].includes(getComputedStyle(e).overflowX)).length;
  const out = document.createElement('div');
  out.id = 'probe';
  const codes = document.querySelectorAll('td code').length;
  out.textContent = JSON.stringify({split, hidden, codes});
  document.body.appendChild(out);
});</script>"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("chromium is not installed (apt-get install -y chromium)")


def run_chromium(profile: Path, *args: str) -> str:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}", f"--window-size={WIDTH},2000",
           "--virtual-time-budget=5000", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    chromium()
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", list(PAGES))
def test_pages_are_readable_at_1280_px(site, name, tmp_path):
    import json
    page = site / PAGES[name]
    probed = page.with_name("probed.html")
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    dom = run_chromium(tmp_path / "profile", "--dump-dom", probed.as_uri())
    found = json.loads(re.search(r'<div id="probe">(.*?)</div>', dom).group(1)
                       .replace("&quot;", '"').replace("&amp;", "&"))
    assert found["split"] == [], f"{name}: identifiers split across lines: {found['split'][:5]}"
    assert found["hidden"] == 0, f"{name}: {found['hidden']} wide blocks that do not scroll"
    if name == "config":
        assert found["codes"] > 200  # the check saw the reference's keys
    shot = tmp_path / f"{name}.png"
    run_chromium(tmp_path / "profile2", f"--screenshot={shot}", page.as_uri())
    assert shot.stat().st_size > 20_000


def test_benchmark_pages_show_plots_drawn_from_the_logs(site):
    page = (site / PAGES["benchmark"]).read_text()
    assert len(re.findall(r'<img alt="[^"]*" src="data:image/png;base64,', page)) >= 2
