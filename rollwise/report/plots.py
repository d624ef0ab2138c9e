"""The report's figures (matplotlib, Agg canvas, no pyplot state). Each function takes the
runs and returns a Figure; several runs are overlaid, one colour per run."""

from __future__ import annotations

import statistics

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from rollwise.report.data import RunData

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
          "#17becf", "#7f7f7f", "#bcbd22"]
CATEGORY_COLORS = {"trained": "#2ca02c", "filtered": "#bbbbbb", "paused": "#1f77b4",
                   "pruned": "#ff7f0e", "aborted": "#d62728", "unaccounted": "#444444",
                   "dropped by trainer": "#8c564b"}
GREYS = ["#bbbbbb", "#999999", "#d5d5d5", "#777777"]
PHASE_ORDER = ["generate", "score", "filter", "control", "replay", "train", "sync", "eval"]


def figure(rows: int, cols: int, height: float = 3.2) -> tuple[Figure, list]:
    """A grid of axes with fixed margins in inches (a layout engine would draw twice)."""
    w, h = 4.2 * cols, height * rows
    fig = Figure(figsize=(w, h))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.75 / w, right=1 - 0.15 / w, bottom=0.55 / h, top=1 - 0.3 / h,
                        wspace=0.3, hspace=0.45)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [a for row in axes for a in row]


def tidy(ax, steps: bool = True, legend: bool = True) -> None:
    """Axes a reader can trust at any run length: whole-number step ticks, a flat or single
    point given a visible range (not +-0.04 around it), and the legend above the lines in
    headroom of its own instead of over them."""
    xs = [x for line in ax.get_lines() for x in line.get_xdata()]
    if steps:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
    elif xs and max(xs) >= 10_000:  # token counts: 150k, not 150000 run into its neighbour
        ax.xaxis.set_major_formatter(FuncFormatter(
            lambda v, _: f"{v / 1e6:g}M" if abs(v) >= 1e6 else f"{v / 1e3:g}k"))
    ys = [y for line in ax.get_lines() for y in line.get_ydata() if y == y]
    if xs and max(xs) == min(xs):
        ax.set_xlim(min(xs) - 1, max(xs) + 1)
    lo, hi = ax.get_ylim()
    if ys and max(ys) - min(ys) < 1e-9:
        v = ys[0]
        lo, hi = (max(0.0, v - 0.1) if v >= 0 else v - 0.1), v + 0.1
    if legend and ax.get_legend_handles_labels()[0]:
        hi = hi + 0.3 * (hi - lo)  # the legend's own band above the data
        ax.legend(fontsize=7, ncol=3, loc="upper center", frameon=False)
    ax.set_ylim(lo, hi)


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666")
    ax.set_xticks([])
    ax.set_yticks([])


def _color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def _x_values(run: RunData, steps: list[float], axis: str) -> list[float]:
    """Map steps onto the x axis: step, cumulative generated tokens, or wall seconds."""
    if axis == "step":
        return steps
    if axis == "tokens":
        cum = run.cumulative("tokens/generated")
        return [cum.get(int(s), 0.0) for s in steps]
    wall = dict(zip(*run.series("wall_seconds")))
    origin = min(wall.values(), default=0.0)  # step 0: after warm start and model loading
    return [wall.get(s, float("nan")) - origin for s in steps]


AXIS_LABEL = {"step": "step", "tokens": "generated tokens",
              "wall": "wall time since step 0 (s)"}


def learning_curves(runs: list[RunData]) -> Figure:
    """Reward (top) and held-out pass@1 (bottom) against step, tokens and wall time."""
    fig, axes = figure(2, 3)
    for row, (key, label) in enumerate([("reward/mean", "mean reward (train samples)"),
                                         ("eval/pass1", "held-out pass@1 (greedy)")]):
        for col, axis in enumerate(["step", "tokens", "wall"]):
            ax = axes[row * 3 + col]
            drawn = False
            for i, run in enumerate(runs):
                steps, ys = run.series(key)
                if not steps or (axis == "tokens" and "tokens/generated" not in run.keys()):
                    continue
                ax.plot(_x_values(run, steps, axis), ys, color=_color(i), marker="o" if
                        key == "eval/pass1" else None, ms=3, lw=1.5, label=run.name)
                drawn = True
                if key == "eval/pass1" and len(runs) == 1:
                    _tiers(ax, run, axis)
            if not drawn:
                _empty(ax, f"no {key} in the metrics")
                continue
            ax.set_xlabel(AXIS_LABEL[axis])
            ax.set_ylabel(label if col == 0 else "")
            ax.grid(alpha=0.3)
            tidy(ax, steps=axis == "step",
                 legend=col == 0 and (len(runs) > 1 or key == "eval/pass1"))
    return fig


def _tiers(ax, run: RunData, axis: str) -> None:
    tiers = sorted(k for k in run.keys() if k.startswith("eval/pass1/"))
    for j, key in enumerate(tiers):
        steps, ys = run.series(key)
        ax.plot(_x_values(run, steps, axis), ys, lw=0.9, ls="--", color=COLORS[(j + 2) % 10],
                label=key.removeprefix("eval/pass1/"))


def token_flow(runs: list[RunData]) -> Figure:
    """Where the generated tokens went, per step: stacked bars, one panel per run."""
    cols = min(len(runs), 3)
    fig, axes = figure((len(runs) + cols - 1) // cols, cols)
    for ax, run in zip(axes, runs):
        cats, steps = run.token_categories(), run.training_steps()
        if not cats or not steps:
            _empty(ax, "no token counts in the metrics")
            continue
        bottom, n_filtered = [0.0] * len(steps), 0
        for j, (label, values) in enumerate(cats.items()):
            kind = label.split(":")[0].split("_")[0]  # 'filtered: equal_reward' -> filtered
            color = CATEGORY_COLORS.get(kind, COLORS[(j + 3) % 10])
            if kind == "filtered":  # one grey per filter reason
                color, n_filtered = GREYS[n_filtered % len(GREYS)], n_filtered + 1
            ax.bar(steps, values, bottom=bottom, width=1.0, color=color, label=label, lw=0)
            bottom = [b + v for b, v in zip(bottom, values)]
        held = run.held_over()
        if held:  # a level beside the bars: what waits in flight for a later step's fate
            ax.step(steps, held, where="mid", color=CATEGORY_COLORS["paused"], lw=1.2,
                    label="held over to the next step (paused)")
        ax.set_title(run.name, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=8))
        ax.set_xlabel("step")
        ax.set_ylabel("tokens")
        ax.set_ylim(0, max(bottom + held) * 1.3 or 1)  # headroom for the legend
        ax.legend(fontsize=7, ncol=3, loc="upper center")
    for ax in axes[len(runs):]:
        ax.set_visible(False)
    return fig


def _quantile(values: list[int], q: float) -> float:
    s = sorted(values)
    return s[min(int(q * len(s)), len(s) - 1)]


def lengths(runs: list[RunData]) -> Figure:
    """Response length over time: median and the 10-90 % band per step (the mean where
    there is no store), and the length histogram at a few steps."""
    fig, axes = figure(1, 2, height=3.4)
    ax, drawn = axes[0], False
    for i, run in enumerate(runs):
        if run.lengths:
            steps = sorted(run.lengths)
            med = [statistics.median(run.lengths[s]) for s in steps]
            lo = [_quantile(run.lengths[s], 0.1) for s in steps]
            hi = [_quantile(run.lengths[s], 0.9) for s in steps]
            ax.fill_between(steps, lo, hi, color=_color(i), alpha=0.2, lw=0)
            ax.plot(steps, med, color=_color(i), lw=1.5, label=f"{run.name} median, 10-90 %")
            drawn = True
        else:
            steps, ys = run.series("response/length_mean")
            if steps:
                ax.plot(steps, ys, color=_color(i), lw=1.5, label=f"{run.name} mean")
                drawn = True
    if not drawn:
        _empty(ax, "no response lengths recorded")
    else:
        ax.set_xlabel("step")
        ax.set_ylabel("response tokens")
        ax.grid(alpha=0.3)
        tidy(ax)
    _length_histograms(axes[1], runs)
    return fig


def _length_histograms(ax, runs: list[RunData]) -> None:
    """One run: its first, middle and last step; several: each run's last step."""
    picks = []  # (label, lengths, colour)
    if len(runs) == 1 and runs[0].lengths:
        steps = sorted(runs[0].lengths)
        chosen = list(dict.fromkeys([steps[0], steps[len(steps) // 2], steps[-1]]))
        picks = [(f"step {s}", runs[0].lengths[s], COLORS[j]) for j, s in enumerate(chosen)]
    else:
        picks = [(f"{r.name}, step {max(r.lengths)}", r.lengths[max(r.lengths)], _color(i))
                 for i, r in enumerate(runs) if r.lengths]
    if not picks:
        _empty(ax, "no rollout store to draw histograms from")
        return
    top = max(max(v) for _, v, _ in picks)
    for label, values, color in picks:
        ax.hist(values, bins=range(0, top + 2), histtype="step", lw=1.5, color=color,
                label=label, density=True)
    ax.set_xlabel("response tokens")
    ax.set_ylabel("share of samples")
    ax.legend(fontsize=7)


def groups(runs: list[RunData]) -> Figure:
    """Share of groups with mixed rewards (the informative ones) and of truncated samples."""
    fig, axes = figure(1, 2)
    for ax, key, label in [(axes[0], "groups/mixed_share", "groups with mixed rewards"),
                           (axes[1], "samples/truncated_share", "truncated samples")]:
        drawn = False
        for i, run in enumerate(runs):
            steps, ys = run.series(key)
            if not steps and key == "samples/truncated_share":
                steps, ys = _truncated_share(run)
            if steps:
                ax.plot(steps, ys, color=_color(i), lw=1.5, label=run.name)
                drawn = True
        if not drawn:
            _empty(ax, f"no {key} in the metrics")
            continue
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("step")
        ax.set_ylabel(f"share of {label}")
        ax.grid(alpha=0.3)
        tidy(ax)
    return fig


def _truncated_share(run: RunData) -> tuple[list[float], list[float]]:
    """samples/truncated over samples/total, per step, where both are present."""
    steps, out = [], []
    for r in run.rows:
        if r.get("samples/truncated") is not None and r.get("samples/total"):
            steps.append(float(r["step"]))
            out.append(float(r["samples/truncated"]) / float(r["samples/total"]))
    return steps, out


def phase_means(run: RunData) -> dict[str, float]:
    """Mean seconds per training step in each phase (perf/phase/*, else gen/train)."""
    rows = [r for r in run.rows if r.get("step", 0) >= 1]
    keys = sorted({k for r in rows for k in r if k.startswith("perf/phase/")})
    if not keys:
        keys = [k for k in ("perf/gen_seconds", "perf/train_seconds") if any(k in r for r in rows)]
    names = {k: k.removeprefix("perf/phase/").removeprefix("perf/").removesuffix("_seconds")
             for k in keys}
    names = {k: {"gen": "generate"}.get(v, v) for k, v in names.items()}
    means = {names[k]: sum(float(r.get(k, 0) or 0) for r in rows) / max(len(rows), 1)
             for k in keys}
    order = {p: i for i, p in enumerate(PHASE_ORDER)}
    return dict(sorted(means.items(), key=lambda kv: order.get(kv[0], len(order))))


def engine(runs: list[RunData]) -> Figure:
    """Engine throughput and step time against step; mean phase seconds per run."""
    fig, axes = figure(1, 3)
    for ax, key, label in [(axes[0], "perf/gen_tokens_per_s", "generated tokens / s"),
                           (axes[1], "perf/step_seconds", "seconds per step")]:
        drawn = False
        for i, run in enumerate(runs):
            steps, ys = run.series(key)
            if steps:
                ax.plot(steps, ys, color=_color(i), lw=1.2, label=run.name)
                drawn = True
        if not drawn:
            _empty(ax, f"no {key} in the metrics")
            continue
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        tidy(ax)
    _phase_bars(axes[2], runs)
    return fig


def _phase_bars(ax, runs: list[RunData]) -> None:
    per_run = [phase_means(r) for r in runs]
    phases = list(dict.fromkeys(p for m in per_run for p in m))
    if not phases:
        _empty(ax, "no phase timings in the metrics")
        return
    width = 0.8 / len(runs)
    for i, (run, means) in enumerate(zip(runs, per_run)):
        xs = [j + i * width for j in range(len(phases))]
        ax.bar(xs, [means.get(p, 0.0) for p in phases], width=width, color=_color(i),
               label=run.name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(phases))], phases, rotation=30,
                  fontsize=8)
    ax.set_ylabel("mean seconds per step")
    ax.legend(fontsize=7)
