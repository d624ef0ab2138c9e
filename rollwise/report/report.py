"""`rollwise report RUN [RUN ...]`: one self-contained HTML page (plots embedded as PNG, no
script, no network) with reward and held-out pass@1 against step, tokens and wall time; where
the tokens went; response lengths over time; informative groups; engine throughput and phase
timings; and the config. Several runs are overlaid. The loop writes <run>/report.html at the
end of every run.

    write_report(["runs/default"])                     # -> runs/default/report.html
    write_report(["runs/a", "runs/b"], "cmp.html")      # overlaid
"""

from __future__ import annotations

import base64
import html
import io
import os
import time
from pathlib import Path

import yaml

from rollwise.report import plots
from rollwise.report.data import RunData, load_runs, read_samples

CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif;
       margin: 24px auto; max-width: 1320px; color: #222; background: #fff; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px;
     border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #666; font-size: 13px; } p.note { color: #555; font-size: 13px; max-width: 900px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 4px 8px; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
table.samples td { text-align: left; vertical-align: top; max-width: 560px; }
table.samples pre { white-space: pre-wrap; word-break: break-word; margin: 0; padding: 4px; }
img { max-width: 100%; } pre { background: #f7f7f7; padding: 10px; font-size: 12px;
     overflow-x: auto; } details { margin: 6px 0; }
"""


def figure_html(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def table_html(head: list[str], rows: list[list]) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in head) + "</tr>"]
    for r in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r) + "</tr>")
    return "\n".join(out) + "</table>"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v) if v is not None else "–"


def _last(run: RunData, key: str):
    vals = run.series(key)[1]
    return vals[-1] if vals else None


def _mean(xs: list[float]):
    return sum(xs) / len(xs) if xs else None


def _since_start(run: RunData):
    """Wall seconds from the step-0 row (warm start and loading excluded) to the end."""
    wall = run.series("wall_seconds")[1]
    return wall[-1] - wall[0] if wall else None


def _pass1(run: RunData, which: str):
    vals = run.series("eval/pass1")[1]
    if not vals:
        return None
    return {"start": vals[0], "end": vals[-1], "best": max(vals)}[which]


def _last_eval(run: RunData) -> str | None:
    """The last held-out pass@1 with the step it was measured at: a stopped run's last
    evaluation may be long before its last step."""
    steps, vals = run.series("eval/pass1")
    return f"{vals[-1]:.3f} (step {int(steps[-1])})" if vals else None


def _steps_done(run: RunData) -> str:
    done = len(run.training_steps())
    try:
        total = (yaml.safe_load(run.config_text) or {}).get("train", {}).get("steps")
    except (yaml.YAMLError, AttributeError):
        total = None
    return f"{done} of {total}" if total and total != done else str(done)


SUMMARY = [  # label, value of a run, format
    ("training steps", _steps_done, "{}"),
    ("held-out pass@1 at start", lambda r: _pass1(r, "start"), "{:.3f}"),
    ("held-out pass@1 at the last evaluation", _last_eval, "{}"),
    ("best held-out pass@1", lambda r: _pass1(r, "best"), "{:.3f}"),
    ("mean reward, last step", lambda r: _last(r, "reward/mean"), "{:.3f}"),
    ("wall time, whole run (s)", lambda r: _last(r, "wall_seconds"), "{:,.1f}"),
    ("peak resident memory (GiB)", lambda r: _max(r, "memory/peak_gib"), "{:.2f}"),
    ("wall time since step 0 (s)", lambda r: _since_start(r), "{:,.1f}"),
    ("tokens generated", lambda r: sum(r.series("tokens/generated")[1]), "{:,.0f}"),
    ("tokens trained on", lambda r: sum(r.token_categories().get("trained", [])), "{:,.0f}"),
    ("mean seconds per step", lambda r: _mean(r.series("perf/step_seconds")[1]), "{:.2f}"),
    ("mean generated tokens / s", lambda r: _mean(r.series("perf/gen_tokens_per_s")[1]),
     "{:,.0f}"),
]


def summary_rows(runs: list[RunData]) -> tuple[list[str], list[list]]:
    rows = []
    for label, value, fmt in SUMMARY:
        vals = [value(r) for r in runs]
        rows.append([label, *["–" if v is None else fmt.format(v) for v in vals]])
    return ["", *[r.name for r in runs]], rows


def token_rows(runs: list[RunData]) -> tuple[list[str], list[list]]:
    """Totals per category and their share of the generated tokens, runs side by side."""
    per_run = [{k: sum(v) for k, v in r.token_categories().items()} for r in runs]
    generated = [sum(float(x.get("tokens/generated", 0) or 0) for x in r.rows
                     if x.get("step", 0) >= 1) for r in runs]
    cats = list(dict.fromkeys(c for m in per_run for c in m))
    rows = [["generated", *[f"{g:,.0f}" for g in generated]]]
    for c in cats:
        rows.append([c, *[f"{m.get(c, 0):,.0f} ({m.get(c, 0) / g:.1%})" if g else
                          f"{m.get(c, 0):,.0f}" for m, g in zip(per_run, generated)]])
    if any(r.held_over() for r in runs):  # in flight when the run stopped: no fate yet
        rows.append(["held over after the last step (paused, not yet scored)",
                     *[f"{(r.held_over() or [0])[-1]:,.0f}" for r in runs]])
    return ["category", *[r.name for r in runs]], rows


def _max(run: RunData, key: str):
    vals = run.series(key)[1]
    return max(vals) if vals else None


def memory_rows(runs: list[RunData]) -> tuple[list[str], list[list]] | None:
    """Each phase's peak resident memory over the run (GiB), and the process's."""
    keys = list(dict.fromkeys(k for r in runs for row in r.rows for k in row
                              if k.startswith("memory/phase/")))
    if not keys:
        return None
    rows = []
    for key in keys + ["memory/peak_gib"]:
        name = key.removeprefix("memory/phase/").removesuffix("_peak_gib")
        label = "whole process" if key == "memory/peak_gib" else name.replace("_", " ")
        rows.append([label, *["–" if (v := _max(r, key)) is None else f"{v:.2f}"
                              for r in runs]])
    return ["phase", *[r.name for r in runs]], rows


def _flatten(d, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_html(runs: list[RunData]) -> str:
    if len(runs) == 1:
        text = runs[0].config_text or "(no config.yaml in the run directory)"
        return (f"<details><summary>the resolved config ({text.count(chr(10))} lines)"
                f"</summary><pre>{html.escape(text)}</pre></details>")
    flat = [_flatten(yaml.safe_load(r.config_text) if r.config_text else {}) for r in runs]
    keys = sorted({k for f in flat for k in f})
    differ = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1]
    parts = ["<p class='note'>Settings that differ between the runs:</p>",
             table_html(["key", *[r.name for r in runs]],
                        [[k, *[repr(f.get(k)) for f in flat]] for k in differ])
             if differ else "<p class='note'>The configs are identical.</p>"]
    for r in runs:
        parts.append(f"<details><summary>{html.escape(r.name)}: full config</summary>"
                     f"<pre>{html.escape(r.config_text)}</pre></details>")
    return "\n".join(parts)


SECTIONS = [
    ("Learning: reward and held-out pass@1", plots.learning_curves,
     "Top: mean reward of the training samples. Bottom: greedy pass@1 on the held-out set "
     "(dashed: per tier). Left to right against step, generated tokens and wall time."),
    ("Where the tokens went", plots.token_flow,
     "Generated tokens per step by fate: trained on, filtered (groups with equal rewards carry "
     "no GRPO signal), dropped by the trainer, and pruned / aborted where the run's "
     "controllers report them. Under APRIL a line shows the tokens paused and held over "
     "at the end of each step: they are counted under their fate in the step that scores "
     "them."),
    ("Response length over time", plots.lengths,
     "Median response length per step and the 10-90 % band, from the rollout store."),
    ("Informative groups", plots.groups,
     "Share of groups whose rewards are not all equal (only these give a non-zero GRPO "
     "advantage), and the share of samples cut at max_new_tokens."),
    ("Engine throughput and phase timings", plots.engine,
     "Generated tokens per second of generation time, seconds per step, and the mean seconds "
     "per step in each phase of the loop."),
]


def samples_html(runs: list[RunData]) -> str:
    """Each run's best- and worst-scored samples of its last stored step."""
    parts = []
    for r in runs:
        step, rows = read_samples(r.dir / "rollouts")
        if not rows:
            parts.append(f"<p class='note'>{html.escape(r.name)}: no rollout store to read "
                         f"samples from.</p>")
            continue
        parts.append(f"<p class='note'>{html.escape(r.name)}, step {step}: the best- and "
                     f"worst-scored samples, best first.</p>")
        parts.append("<table class='samples'><tr><th>reward</th><th>status</th><th>prompt</th>"
                     "<th>response</th></tr>" + "".join(
                         f"<tr><td>{x['reward']:.3f}</td><td>{html.escape(str(x['status']))}"
                         f"</td><td><pre>{html.escape(x['prompt_text'])}</pre></td>"
                         f"<td><pre>{html.escape(x['response_text'])}</pre></td></tr>"
                         for x in rows) + "</table>")
    return "\n".join(parts)


def render(runs: list[RunData], extra: list[str] = ()) -> str:
    """The page; `extra`: HTML sections appended before the config (a bench's own plots)."""
    names = ", ".join(r.name for r in runs)
    body = [f"<h1>rollwise report: {html.escape(names)}</h1>",
            f"<div class='sub'>written {time.strftime('%Y-%m-%d %H:%M:%S')} from "
            + ", ".join(html.escape(str(r.dir)) for r in runs) + "</div>",
            "<h2>Summary</h2>", table_html(*summary_rows(runs))]
    memory = memory_rows(runs)
    if memory:
        body += ["<h2>Peak resident memory (GiB)</h2>",
                 "<p class='note'>The largest resident memory of the process in each phase, "
                 "as the kernel counts it (a phase that set the process's peak reads the "
                 "kernel's high-water mark; the others, RSS sampled every 10 ms).</p>",
                 table_html(*memory)]
    for title, plot, note in SECTIONS:
        body += [f"<h2>{html.escape(title)}</h2>", f"<p class='note'>{html.escape(note)}</p>",
                 figure_html(plot(runs), title)]
        if plot is plots.token_flow:
            body.append(table_html(*token_rows(runs)))
    body += ["<h2>Sample responses, last step</h2>", samples_html(runs)]
    body += [*extra, "<h2>Config</h2>", config_html(runs)]
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>rollwise report: {html.escape(names)}</title><style>{CSS}</style></head>"
            "<body>\n" + "\n".join(body) + "\n</body></html>\n")


def default_out(paths: list[Path]) -> Path:
    """<run>/report.html for one run; <common parent>/report-compare.html for several."""
    if len(paths) == 1:
        return paths[0] / "report.html"
    common = Path(os.path.commonpath([str(p.resolve()) for p in paths]))
    return common / "report-compare.html"


def write_report(run_dirs: list[str | Path], out: str | Path | None = None,
                 extra: list[str] = ()) -> Path:
    if not run_dirs:
        raise ValueError("write_report needs at least one run directory")
    paths = [Path(p) for p in run_dirs]
    out = Path(out) if out else default_out(paths)
    page = render(load_runs(paths), extra)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out
