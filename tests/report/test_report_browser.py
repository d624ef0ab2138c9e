"""report.html in a real browser: headless Chromium renders the page of a short run and the
screenshot must show content (an empty page, screenshotted the same way, must not).

Needs Debian's `chromium` (apt-get install -y chromium); skipped where it is absent.
"""

import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from rollwise.config import load_config
from rollwise.loop.run import train

pytestmark = pytest.mark.browser

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=300",
         "task.eval_size=40", "sft.steps=20", "sft.eval_every=10", "train.steps=3",
         "control.prompts_per_step=6", "generate.group_size=4", "run.eval_every=2",
         "run.log=quiet", "run.tensorboard=false"]
SIZE = (1200, 2000)


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed (apt-get install -y chromium)")


def screenshot(page: Path, out: Path, profile: Path) -> Image.Image:
    profile.mkdir()
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}", f"--screenshot={out}",
           f"--window-size={SIZE[0]},{SIZE[1]}", page.resolve().as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and out.exists(), done.stderr[-2000:]
    return Image.open(out).convert("RGB")


def content_stats(img: Image.Image) -> tuple[int, float]:
    """(distinct colours, share of pixels that are not near-white)."""
    colors = img.getcolors(maxcolors=1 << 24)
    ink = sum(n for n, (r, g, b) in colors if min(r, g, b) < 235)
    return len(colors), ink / (img.size[0] * img.size[1])


def test_report_renders_in_chromium(tmp_path):
    chromium()
    cfg = load_config(None, SMALL + [f"run.root={tmp_path}", "run.name=short"])
    train(cfg)
    page = tmp_path / "short" / "report.html"
    img = screenshot(page, tmp_path / "shot.png", tmp_path / "profile")
    assert img.size == SIZE
    colors, ink = content_stats(img)
    assert colors > 200 and ink > 0.03, (colors, ink)
    # the same check on an empty page says blank: the check can tell the difference
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    b_colors, b_ink = content_stats(screenshot(blank, tmp_path / "blank.png",
                                               tmp_path / "profile2"))
    assert b_colors < 10 and b_ink < 0.001, (b_colors, b_ink)
