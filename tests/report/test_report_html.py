"""report.html: written at the end of a short run, self-contained, with numbers that agree
with metrics.jsonl and the rollout store; token categories, missing data and several runs."""

import base64
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from rollwise.cli import main
from rollwise.config import load_config
from rollwise.loop.run import train
from rollwise.report.data import load_run, read_lengths
from rollwise.report.report import SECTIONS, write_report
from rollwise.store.rollouts import RolloutStore

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=300",
         "task.eval_size=40", "sft.steps=20", "sft.eval_every=10", "train.steps=3",
         "control.prompts_per_step=6", "generate.group_size=4", "run.eval_every=2",
         "run.log=quiet", "run.tensorboard=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    cfg = load_config(None, SMALL + [f"run.root={root}", "run.name=short"])
    train(cfg)
    return Path(root) / "short"


def images(page: str) -> list[Image.Image]:
    blobs = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    return [Image.open(io.BytesIO(base64.b64decode(b))) for b in blobs]


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in open(run / "metrics.jsonl")]


@pytest.mark.integration
def test_run_ends_with_a_self_contained_report(run_dir):
    page = (run_dir / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # nothing fetched: no scripts, stylesheets, or remote URLs
    assert "<script" not in page and "<link" not in page
    assert not re.search(r'(src|href)="(?!data:)', page)
    assert "http://" not in page and "https://" not in page
    for title, _, _ in SECTIONS:
        assert title.replace("'", "&#x27;") in page
    imgs = images(page)
    assert len(imgs) == len(SECTIONS)
    for img in imgs:  # decodable, non-trivial pictures
        assert img.size[0] > 300 and img.size[1] > 200
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 20)) > 20
    assert "prompts_per_step: 6" in page  # the config is shown


@pytest.mark.integration
def test_summary_numbers_agree_with_metrics(run_dir):
    page = (run_dir / "report.html").read_text()
    rows = metrics(run_dir)
    evals = [r["eval/pass1"] for r in rows if "eval/pass1" in r]
    last_eval = [r["step"] for r in rows if "eval/pass1" in r][-1]
    generated = sum(r.get("tokens/generated", 0) for r in rows)
    expected = {"training steps": "3", "held-out pass@1 at start": f"{evals[0]:.3f}",
                "held-out pass@1 at the last evaluation": f"{evals[-1]:.3f} (step {last_eval})",
                "best held-out pass@1": f"{max(evals):.3f}",
                "tokens generated": f"{generated:,.0f}"}
    for label, value in expected.items():
        assert re.search(rf"<td>{label}</td><td>{re.escape(value)}</td>", page), label


@pytest.mark.integration
def test_token_categories_account_for_every_generated_token(run_dir):
    run = load_run(run_dir)
    cats = run.token_categories()
    assert "unaccounted" not in cats
    rows = [r for r in metrics(run_dir) if r["step"] >= 1]
    for i, r in enumerate(rows):  # trained + filtered + trainer drops == generated
        assert sum(v[i] for v in cats.values()) == pytest.approx(r["tokens/generated"])
    store = RolloutStore(run_dir / "rollouts").samples()
    assert sum(s.num_tokens for s in store) == sum(r["tokens/generated"] for r in rows)


@pytest.mark.integration
def test_lengths_from_the_store_match_the_samples(run_dir):
    store = RolloutStore(run_dir / "rollouts").samples()
    expected: dict[int, list[int]] = {}
    for s in store:
        expected.setdefault(s.step, []).append(len(s.response_ids))
    got = read_lengths(run_dir / "rollouts")
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in expected.items()}


def write_run(d: Path, rows: list[dict], config: str | None = "train:\n  lr: 0.001\n") -> Path:
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (d / "config.yaml").write_text(config)
    return d


def synthetic_rows(paused: bool = True) -> list[dict]:
    rows = [{"step": 0, "eval/pass1": 0.2, "wall_seconds": 1.0}]
    for s in range(1, 5):
        r = {"step": s, "reward/mean": 0.1 * s, "tokens/generated": 1000,
             "tokens/trained": 600, "tokens/filtered": 300, "groups/mixed_share": 0.5,
             "perf/step_seconds": 2.0, "perf/gen_tokens_per_s": 800.0,
             "perf/phase/generate_seconds": 1.2, "perf/phase/train_seconds": 0.8,
             "wall_seconds": 1.0 + 2 * s}
        if paused:
            r.update({"tokens/paused": 60, "tokens/pruned": 40, "tokens/aborted": 0})
        rows.append(r)
    rows[-1]["eval/pass1"] = 0.4
    return rows


def test_controller_categories_show_with_shares_and_zero_ones_hide(tmp_path):
    d = write_run(tmp_path / "a", synthetic_rows())
    cats = load_run(d).token_categories()
    assert {k: sum(v) for k, v in cats.items()} == {"trained": 2400, "filtered": 1200,
                                                    "paused": 240, "pruned": 160}
    page = write_report([d]).read_text()
    assert "<td>paused</td><td>240 (6.0%)</td>" in page
    assert "<td>trained</td><td>2,400 (60.0%)</td>" in page
    assert "<td>aborted</td>" not in page  # always zero: not a category worth a row


def test_missing_pieces_degrade_gracefully(tmp_path):
    rows = [{"step": 1, "reward/mean": 0.5, "tokens/generated": 100}]
    d = write_run(tmp_path / "bare", rows, config=None)
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "rew')  # a crash mid-write
    run = load_run(d)
    assert [r["step"] for r in run.rows] == [1]
    assert run.token_categories() == {"unaccounted": [100.0]}  # nothing explains the tokens
    page = write_report([d]).read_text()
    assert "(no config.yaml in the run directory)" in page
    assert "<td>held-out pass@1 at the last evaluation</td><td>–</td>" in page
    assert len(images(page)) == len(SECTIONS)


def test_not_a_run_directory(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_report([tmp_path])
    assert main(["report", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_several_runs_overlay_with_a_config_diff(tmp_path, capsys):
    a = write_run(tmp_path / "x" / "seed0", synthetic_rows(), "train:\n  lr: 0.001\n  steps: 4\n")
    b = write_run(tmp_path / "y" / "seed0", synthetic_rows(paused=False),
                  "train:\n  lr: 0.002\n  steps: 4\n")
    assert main(["report", str(a), str(b)]) == 0
    out = tmp_path / "report-compare.html"
    assert f"wrote {out}" in capsys.readouterr().out
    page = out.read_text()
    assert "x/seed0" in page and "y/seed0" in page  # clashing names get their parent
    diff = page.split("Settings that differ")[1].split("</table>")[0]
    assert "train.lr" in diff and "train.steps" not in diff
    assert "<td>paused</td><td>240 (6.0%)</td><td>0 (0.0%)</td>" in page


def test_carried_tokens_are_a_level_not_a_fate(tmp_path):
    """APRIL's tokens held over at a step's end meet their fate in a later step: the
    categories still sum to the scored tokens, and the table shows what is left in flight."""
    rows = [{"step": 0}]
    for s, held in enumerate([500, 300, 200], start=1):
        rows.append({"step": s, "tokens/generated": 1000, "tokens/trained": 700,
                     "tokens/filtered/equal_reward": 300, "tokens/paused_carried": held})
    d = write_run(tmp_path / "april", rows)
    run = load_run(d)
    assert {k: sum(v) for k, v in run.token_categories().items()} == {
        "trained": 2100, "filtered: equal_reward": 900}
    assert run.held_over() == [500, 300, 200]
    page = write_report([d]).read_text()
    assert "<td>held over after the last step (paused, not yet scored)</td><td>200</td>" in page
    assert "unaccounted" not in page
    assert load_run(write_run(tmp_path / "sync", synthetic_rows())).held_over() == []


@pytest.mark.integration
def test_the_report_shows_the_last_steps_best_and_worst_samples(run_dir):
    """Against the rollout store read directly: the last step's highest and lowest rewards,
    best first, with their responses; the resolved config folded away."""
    page = (run_dir / "report.html").read_text()
    stored = RolloutStore(run_dir / "rollouts").read().to_pylist()
    last = max(r["step"] for r in stored)
    rewards = sorted((r["reward"] for r in stored if r["step"] == last), reverse=True)
    section = page.split("Sample responses, last step</h2>", 1)[1].split("<h2>", 1)[0]
    assert f"step {last}: the best- and worst-scored samples" in section
    shown = [float(x) for x in re.findall(r"<tr><td>([-0-9.]+)</td>", section)]
    assert shown == [round(r, 3) for r in rewards[:3] + rewards[-3:]]
    assert re.search(r"<details><summary>the resolved config \(\d+ lines\)</summary>", page)


def test_axes_stay_readable_for_one_point_and_short_runs():
    """One evaluation at pass@1 0: a visible range, not +-0.04; three steps: whole-number
    ticks; the legend sits in headroom above the data."""
    from rollwise.report import plots
    fig, (ax,) = plots.figure(1, 1)
    ax.plot([0], [0.0], marker="o", label="run")
    plots.tidy(ax)
    lo, hi = ax.get_ylim()
    assert lo == 0.0 and hi >= 0.1
    assert ax.get_xlim() == (-1, 1)
    fig, (ax,) = plots.figure(1, 1)
    ax.plot([1, 2, 3], [0.2, 0.5, 0.4], label="run")
    plots.tidy(ax)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert ax.get_ylim()[1] > 0.5 * 1.2  # headroom above the highest point for the legend


def test_a_stopped_run_says_how_many_steps_and_where_its_last_evaluation_was(tmp_path):
    rows = [{"step": 0, "eval/pass1": 0.25, "wall_seconds": 1.0},
            {"step": 1, "reward/mean": 0.5, "tokens/generated": 100, "wall_seconds": 2.0},
            {"step": 2, "reward/mean": 0.5, "tokens/generated": 100, "wall_seconds": 3.0}]
    d = write_run(tmp_path / "stopped", rows, config="train:\n  steps: 40\n")
    page = write_report([d]).read_text()
    assert "<td>training steps</td><td>2 of 40</td>" in page
    assert "<td>held-out pass@1 at the last evaluation</td><td>0.250 (step 0)</td>" in page


@pytest.mark.integration
def test_every_phase_books_its_peak_memory_and_the_report_shows_it(run_dir):
    """Step 0 carries loading, the warm start and the first evaluation; each training step
    its generation, scoring, update and sync; no phase above the process's peak."""
    rows = metrics(run_dir)
    phases = lambda row: {k.removeprefix("memory/phase/").removesuffix("_peak_gib")  # noqa: E731
                          for k in row if k.startswith("memory/phase/")}
    assert {"load", "warm_start", "eval"} <= phases(rows[0])
    for row in rows[1:]:
        assert {"generate", "score", "train", "sync"} <= phases(row)
        assert ("eval" in phases(row)) == ("eval/pass1" in row)
    for row in rows:
        peaks = [v for k, v in row.items() if k.startswith("memory/phase/")]
        assert 0 < max(peaks) <= row["memory/peak_gib"]
    page = (run_dir / "report.html").read_text()
    whole = max(r["memory/peak_gib"] for r in rows)
    assert "Peak resident memory (GiB)" in page
    assert re.search(rf"<td>whole process</td><td>{whole:.2f}</td>", page)
    assert re.search(rf"<td>peak resident memory \(GiB\)</td><td>{whole:.2f}</td>", page)
