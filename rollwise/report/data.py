"""A run directory read back for the report: metrics.jsonl rows, config, summary, and the
response lengths per step from the rollout store."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Token categories: where each generated token ended up. `tokens/<destination>` keys of the
# loop's ledger (trained, filtered/<reason>, paused_carried, pruned, aborted, ...) plus the
# trainer's own drops; these tokens/ keys count tokens but are not destinations.
TOKEN_KEY = "tokens/"
TRAINER_DROP_KEY = "train/dropped_tokens/"
# totals and prompt-side counts: what the engine prefilled or a fork spared prefilling is no
# fate of a generated token
NOT_CATEGORIES = {"tokens/generated", "tokens/decoded", "tokens/batch", "tokens/stale",
                  "tokens/prefilled", "tokens/prefix_saved"}
# Levels, not fates: APRIL's tokens held in flight at the end of a step. They meet their fate
# (trained or filtered) in the step that scores their group, so summing them as a category
# would count them again in every step they stay carried.
HELD_KEY = "tokens/paused_carried"


@dataclass
class RunData:
    name: str
    dir: Path
    rows: list[dict]
    config_text: str = ""
    summary: dict = field(default_factory=dict)
    lengths: dict[int, list[int]] = field(default_factory=dict)  # step -> response lengths

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """(x, y) over the rows that have both keys."""
        xs, ys = [], []
        for r in self.rows:
            if _num(r.get(key)) and _num(r.get(x)):
                xs.append(float(r[x]))
                ys.append(float(r[key]))
        return xs, ys

    def cumulative(self, key: str) -> dict[int, float]:
        """step -> running sum of `key` up to and including that step."""
        total, out = 0.0, {}
        for r in self.rows:
            total += float(r.get(key, 0) or 0)
            if _num(r.get("step")):
                out[int(r["step"])] = total
        return out

    def keys(self) -> set[str]:
        return {k for r in self.rows for k in r}

    def token_categories(self) -> dict[str, list[float]]:
        """Category label -> tokens per training step (rows with step >= 1), for every
        category that is present and not always zero; 'unaccounted' holds what the
        categories do not explain of tokens/generated, when that is positive."""
        steps = [r for r in self.rows if r.get("step", 0) >= 1]
        keys = self.keys()
        cats: dict[str, str] = {}
        if "tokens/trained" in keys:
            cats["trained"] = "tokens/trained"
        elif "train/tokens" in keys:
            cats["trained"] = "train/tokens"
        for k in sorted(keys):
            if k.startswith(TOKEN_KEY) and k not in NOT_CATEGORIES | {HELD_KEY, "tokens/trained"}:
                cats[k.removeprefix(TOKEN_KEY).replace("/", ": ", 1)] = k
            elif k.startswith(TRAINER_DROP_KEY):
                cats["dropped by trainer: " + k.removeprefix(TRAINER_DROP_KEY)] = k
        out = {label: [float(r.get(k, 0) or 0) for r in steps] for label, k in cats.items()}
        out = {label: v for label, v in out.items() if any(v)}
        generated = [float(r.get("tokens/generated", 0) or 0) for r in steps]
        rest = [g - sum(v[i] for v in out.values()) for i, g in enumerate(generated)]
        if any(x > 0.5 for x in rest):
            out["unaccounted"] = [max(x, 0.0) for x in rest]
        return out

    def held_over(self) -> list[float]:
        """Tokens paused and carried into the next step, at the end of each training step;
        empty when the run carries none."""
        held = [float(r.get(HELD_KEY, 0) or 0) for r in self.rows if r.get("step", 0) >= 1]
        return held if any(held) else []

    def training_steps(self) -> list[int]:
        return [int(r["step"]) for r in self.rows if r.get("step", 0) >= 1]


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def read_metrics(path: Path) -> list[dict]:
    """Rows of metrics.jsonl; a torn last line (a crash mid-write) is skipped."""
    rows = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return rows


def read_lengths(store_dir: Path, max_steps: int = 200) -> dict[int, list[int]]:
    """step -> response lengths from the rollout store (at most max_steps steps, evenly
    spaced); empty when there is no store or it cannot be read."""
    files = sorted(store_dir.glob("step-*.parquet"))
    if not files:
        return {}
    if len(files) > max_steps:
        files = [files[round(i * (len(files) - 1) / (max_steps - 1))] for i in range(max_steps)]
    try:
        # pyarrow: only when a run's rollouts are read
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
        out: dict[int, list[int]] = {}
        for f in files:
            t = pq.read_table(f, columns=["step", "response_ids"])
            lens = pc.list_value_length(t["response_ids"]).to_pylist()
            for step, n in zip(t["step"].to_pylist(), lens):
                out.setdefault(int(step), []).append(int(n or 0))
        return out
    except Exception:  # a store in another format: the report falls back to the mean length
        return {}


SAMPLE_CHARS = 600  # of a prompt or a response shown in the report


def read_samples(store_dir: Path, n: int = 3) -> tuple[int | None, list[dict]]:
    """The last stored step and its n best- and n worst-scored samples (prompt, response,
    reward, status), best first; (None, []) without a readable store."""
    files = sorted(store_dir.glob("step-*.parquet"))
    if not files:
        return None, []
    try:
        import pyarrow.parquet as pq  # only when a run's rollouts are read
        t = pq.read_table(files[-1], columns=["step", "status", "reward", "prompt_text",
                                              "response_text"])
        rows = [r for r in t.to_pylist() if r["reward"] is not None]
    except Exception:  # a store in another format: the report shows no samples
        return None, []
    if not rows:
        return None, []
    rows.sort(key=lambda r: -r["reward"])
    picked = rows if len(rows) <= 2 * n else rows[:n] + rows[-n:]
    for r in picked:
        for k in ("prompt_text", "response_text"):
            text = r[k] or ""
            r[k] = text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS] + " [...]"
    return int(picked[0]["step"]), picked


def load_run(path: str | Path) -> RunData:
    d = Path(path)
    metrics = d / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"{d} has no metrics.jsonl: pass a rollwise run directory "
                                "such as runs/default")
    summary = {}
    if (d / "summary.json").exists():
        try:
            summary = json.loads((d / "summary.json").read_text())
        except json.JSONDecodeError:
            summary = {}
    config = (d / "config.yaml").read_text() if (d / "config.yaml").exists() else ""
    return RunData(d.name, d, read_metrics(metrics), config, summary,
                   read_lengths(d / "rollouts"))


def load_runs(paths: list[str | Path]) -> list[RunData]:
    """The runs, named by their directory; clashing names get their parent prefixed."""
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:
            r.name = f"{r.dir.resolve().parent.name}/{r.dir.name}"
    return runs
