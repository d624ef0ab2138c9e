"""What of an asynchronous run depends on timing: the same seed run several times, compared.

    python3 scripts/async_repeat.py [--runs 3] [--steps 8] [--root DIR] [key=value ...]

Each run is `rollwise train` on the default config with loop.mode=async loop.max_staleness=1
(and the overrides given) in a fresh process. Against the first run, per later run: the steps
whose metrics differ and by how much (timings left out), and whether the stored rollouts
agree in their tokens, in the weight version that sampled each token, and in its behaviour
log-probability; and whether the final weights are equal. Prints JSON.

In the asynchronous loop a weight push lands between two engine steps whenever the trainer is
done, so which version samples a token, and so its behaviour log-probability, depends on
timing; the tokens themselves are drawn from per-sequence uniform streams and change only
where the new weights move a token's inverse-CDF interval past its uniform.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rollwise.bench.crash import metric_rows, weights
from rollwise.store.rollouts import RolloutStore


def run(root: Path, name: str, steps: int, extra: list[str]) -> Path:
    cmd = [sys.executable, "-m", "rollwise", "train", f"run.root={root}", f"run.name={name}",
           "run.seed=0", "loop.mode=async", "loop.max_staleness=1", f"train.steps={steps}",
           *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    return root / name


def rollouts(run_dir: Path) -> dict[tuple, dict]:
    """Each stored rollout by (step, group, index in its group)."""
    rows = RolloutStore(run_dir / "rollouts").read().to_pylist()
    seen: dict[tuple, int] = {}
    out = {}
    for r in sorted(rows, key=lambda r: (r["step"], r["group_id"], r["uid"])):
        key = (r["step"], r["group_id"])
        seen[key] = seen.get(key, -1) + 1
        out[(*key, seen[key])] = r
    return out


def by_content(rows: dict) -> dict:
    """Rollouts keyed by what was sampled (step, group, prompt, tokens), timing-free."""
    return {(r["step"], r["group_id"], tuple(r["response_ids"])): r for r in rows.values()}


def differences(ref: Path, other: Path) -> dict:
    a, b = metric_rows(ref), metric_rows(other)
    steps = {}
    for x, y in zip(a, b):
        keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        if keys:
            steps[x["step"]] = {k: [x.get(k), y.get(k)] for k in keys}
    ra, rb = by_content(rollouts(ref)), by_content(rollouts(other))
    common = ra.keys() & rb.keys()
    same_versions = sum(ra[k]["versions"] == rb[k]["versions"] for k in common)
    same_logprobs = sum(ra[k]["logprobs"] == rb[k]["logprobs"] for k in common)
    wa, wb = weights(ref), weights(other)
    return {
        "metric_steps_differing": len(steps), "metric_differences": steps,
        "rollouts": len(ra), "same_tokens": len(common),
        "same_tokens_same_versions": same_versions,
        "same_tokens_same_logprobs": same_logprobs,
        "final_weights_equal": wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--root", default="runs/async-repeat")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    root = Path(args.root)
    dirs = [run(root, f"r{i}", args.steps, args.overrides) for i in range(args.runs)]
    print(json.dumps({f"r{i}": differences(dirs[0], d) for i, d in enumerate(dirs[1:], 1)},
                     indent=1, default=str))


if __name__ == "__main__":
    main()
