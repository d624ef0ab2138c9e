"""Compare two runs: every non-timing metric of every step, and the final weights bit for bit.

    python3 scripts/compare_runs.py RUN_A RUN_B     # e.g. runs/default of two checkouts
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TIMING = ("perf/", "wall_seconds", "sync/seconds", "sync/encode_seconds", "sync/apply_seconds",
          "sync/verify_seconds", "phase/", "memory/")


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def keys(row: dict) -> set[str]:
    return {k for k in row if not any(t in k for t in TIMING)}


def main(a: Path, b: Path) -> int:
    ra, rb = rows(a), rows(b)
    if len(ra) != len(rb):
        print(f"{len(ra)} rows against {len(rb)}")
        return 1
    diff = 0
    for x, y in zip(ra, rb):
        if keys(x) != keys(y):
            print("step", x.get("step"), "keys differ:", sorted(keys(x) ^ keys(y)))
            diff += 1
        for k in sorted(keys(x) & keys(y)):
            if x[k] != y[k]:
                print("step", x.get("step"), k, x[k], y[k])
                diff += 1
    wa, wb = (load_file(r / "model" / "model.safetensors") for r in (a, b))
    same = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    print(f"{len(ra)} metric rows compared, {diff} differences; final weights bit-identical: "
          f"{same}")
    return int(diff > 0 or not same)


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
