"""Compare two runs: every non-timing metric of every step, and the final weights bit for bit."""
import json, sys
from pathlib import Path
from safetensors.torch import load_file
import torch
a, b = Path(sys.argv[1]), Path(sys.argv[2])
TIMING = ("perf/", "wall_seconds", "sync/seconds", "sync/encode_seconds", "sync/apply_seconds",
          "sync/verify_seconds", "phase/")
def rows(p):
    return [json.loads(l) for l in (p / "metrics.jsonl").read_text().splitlines()]
ra, rb = rows(a), rows(b)
assert len(ra) == len(rb), (len(ra), len(rb))
diff = 0
for x, y in zip(ra, rb):
    kx = {k for k in x if not any(t in k for t in TIMING)}
    ky = {k for k in y if not any(t in k for t in TIMING)}
    if kx != ky:
        print("step", x.get("step"), "keys differ:", sorted(kx ^ ky)); diff += 1
    for k in kx & ky:
        if x[k] != y[k]:
            print("step", x.get("step"), k, x[k], y[k]); diff += 1
wa, wb = load_file(a / "model/model.safetensors"), load_file(b / "model/model.safetensors")
same = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
print(f"{len(ra)} metric rows compared, {diff} differences; final weights bit-identical: {same}")
