"""Plots on the site's pages, drawn from the recorded logs when the site builds (so a figure
cannot drift from its numbers). A page asks for one with a comment on a line of its own:

    <!-- plot: curves docs/bench-logs/smollm2/seed*-metrics.jsonl eval/pass1 -->
    <!-- plot: bars docs/bench-logs/smollm2/e2e-trl.json medians seconds_to_target -->

curves: KEY against step, one line per metrics.jsonl the glob matches. bars: in a JSON file,
the dict at the dotted PATH, {name: {FIELD: value}}, one bar per name. The figure is embedded
as a PNG; a directive naming no file or key fails the build with what is wrong.
"""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^<!-- plot: (curves|bars) (\S+) (\S+)(?: (\S+))? -->$", re.M)


class PlotError(ValueError):
    """A plot directive that cannot be drawn: the message names the directive and why."""


def _png(fig: Figure, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img alt="{alt}" src="data:image/png;base64,{data}">'


def _figure() -> tuple[Figure, object]:
    fig = Figure(figsize=(7.5, 3.4))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.16, top=0.9)
    return fig, fig.subplots()


def curves(pattern: str, key: str) -> str:
    files = sorted(ROOT.glob(pattern))
    if not files:
        raise PlotError(f"plot curves {pattern}: no file matches")
    fig, ax = _figure()
    for f in files:
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if not points:
            raise PlotError(f"plot curves {pattern}: {f.name} has no {key!r}")
        ax.plot(*zip(*points), marker="o", ms=3, lw=1.5, label=f.stem)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(f"{key} against step ({len(files)} runs)", fontsize=10)
    return _png(fig, f"{key} against step, from {pattern}")


def bars(path: str, dotted: str, field: str) -> str:
    file = ROOT / path
    if not file.is_file():
        raise PlotError(f"plot bars {path}: no such file")
    node = json.loads(file.read_text())
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise PlotError(f"plot bars {path}: no {dotted!r} in it")
        node = node[part]
    try:
        values = {name: float(entry[field]) for name, entry in node.items()}
    except (KeyError, TypeError, ValueError, AttributeError):
        raise PlotError(f"plot bars {path}: {dotted} is not a dict of entries with a numeric "
                        f"{field!r}") from None
    fig, ax = _figure()
    ax.bar(list(values), list(values.values()), color="#1f77b4")
    for i, v in enumerate(values.values()):
        ax.annotate(f"{v:,.3g}", (i, v), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel(field)
    ax.set_ylim(0, max(values.values()) * 1.15 or 1)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(f"{field} ({dotted}, {file.name})", fontsize=10)
    return _png(fig, f"{field} by {dotted} from {path}")


def expand(markdown: str) -> str:
    """The page with each plot directive replaced by its figure."""
    def one(m: re.Match) -> str:
        kind, a, b, c = m.groups()
        if kind == "curves":
            return curves(a, b)
        if c is None:
            raise PlotError(f"plot bars {a} {b}: name the field to plot")
        return bars(a, b, c)
    return DIRECTIVE.sub(one, markdown)
