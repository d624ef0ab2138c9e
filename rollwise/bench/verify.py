"""Verifier throughput: samples scored per second by the Filter stage on this CPU.

    rollwise bench verify [--samples 512] [--code-samples 32] [--workers 2] [--reps 3] [--json]

Rows (medians over --reps, each a full `FilterStage.score` call on a fresh batch):
  exact (default run)   the default reward on 512 arith samples, in-process: the per-step
                        overhead the default loop pays
  majority              majority vote over groups of 8, in-process
  math in-process       math-verify on LaTeX/fraction/interval answers, workers=0
  math pool             the same through N worker processes (per-sample timeout)
  code pool             model code against 4 stdin/stdout tests each, every test one sandbox
                        run, through N worker processes
  sandbox run           one trivial sandboxed program, start to cleanup (latency)
Workers are started before timing (their start-up is reported apart).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from rollwise.config import FilterConfig, TaskConfig
from rollwise.stages.filter import build_filter
from rollwise.stages.filter.sandbox import isolation_report, run_python
from rollwise.tasks import Problem, load_task
from rollwise.types import Sample, Status

MATH = [("\\frac{1}{2}", ["0.5", "\\frac{2}{4}", "1/3", "\\dfrac12"]),
        ("[1,2)", ["[1, 2)", "(1,2]", "[1,2]", "[1,2)"]),
        ("10", ["10\\text{ cm}", "10", "11", "1,0"]),
        ("x^2+2x+1", ["(x+1)^2", "x^2+1", "(x+1)(x+1)", "2x"]),
        ("\\sqrt{2}/2", ["\\frac{\\sqrt{2}}{2}", "0.7071067811865476", "\\sqrt2", "1/2"])]
SUM_TESTS = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in
             [(1, 2), (10, -4), (7, 0), (100, 200)]]
CODES = ["print(sum(map(int, input().split())))", "print(eval(input().replace(' ', '+')))",
         "a, b = map(int, input().split())\nprint(a - b)", "while True:\n    pass"]


def _samples(problems, texts, group_size: int):
    return [Sample(prompt_id=p.id, prompt_ids=[1], group_id=f"{i // group_size}",
                   response_ids=[5] * 4, status=Status.COMPLETED)
            for i, (p, _) in enumerate(zip(problems, texts))]


def arith_batch(task, n: int, rng: random.Random):
    problems, texts = [], []
    for i in range(n // 8):
        p = rng.choice(task.train)
        for _ in range(8):
            problems.append(p)
            texts.append(p.solution if rng.random() < 0.5 else str(rng.randint(0, 99)))
    return problems, texts


def math_batch(n: int, rng: random.Random):
    """Half fixed LaTeX forms (units, intervals, polynomials), half fresh random fractions
    written as \\frac, decimals or wrong neighbours, so parse caches do not flatter us."""
    problems, texts = [], []
    for i in range(n):
        if i % 2:
            gold, answers = MATH[i % len(MATH)]
        else:
            p, q = rng.randint(-999, 999), rng.choice([2, 4, 5, 8, 10, 16, 20, 25])
            gold = f"\\frac{{{p}}}{{{q}}}"
            answers = [f"{p / q}", f"\\frac{{{p + 1}}}{{{q}}}", f"{p}/{q}"]
        problems.append(Problem(f"m{i}", "q", gold))
        texts.append(f"so the answer is \\boxed{{{rng.choice(answers)}}}")
    return problems, texts


def code_batch(n: int, rng: random.Random):
    p = Problem("sum", "add", "", data={"tests": SUM_TESTS})
    weights = [0.5, 0.3, 0.15, 0.05]  # mostly right, some wrong, a few endless loops
    return [p] * n, [f"```python\n{rng.choices(CODES, weights)[0]}\n```" for _ in range(n)]


def time_stage(stage, batch_fn, reps: int, group_size: int) -> tuple[float, int, dict]:
    times, metrics = [], {}
    n = 0
    for r in range(reps):
        problems, texts = batch_fn(random.Random(r))
        samples = _samples(problems, texts, group_size)
        t0 = time.perf_counter()
        metrics = stage.score(samples, problems, texts)
        times.append(time.perf_counter() - t0)
        n = len(samples)
    return statistics.median(times), n, metrics


def run(args) -> list[dict]:
    task = load_task(TaskConfig(train_size=2000, eval_size=40))
    rows = []

    def add(name, stage, batch_fn, group_size=8, workers=0):
        t_start = time.perf_counter()
        if stage.pool is not None:
            stage.pool.start()
        startup = time.perf_counter() - t_start
        sec, n, m = time_stage(stage, batch_fn, args.reps, group_size)
        stage.close()
        rows.append({"verifier": name, "workers": workers, "samples": n, "seconds": sec,
                     "samples_per_s": n / sec, "ms_per_sample": 1000 * sec / n,
                     "worker_startup_s": startup, "failed": m.get("filter/failed", 0.0)})

    add("exact (default run)", build_filter(FilterConfig(), task),
        lambda rng: arith_batch(task, args.samples, rng))
    add("majority", build_filter(FilterConfig(reward="majority"), task),
        lambda rng: arith_batch(task, args.samples, rng))
    math_cfg = dict(reward="math", extract=["boxed"])
    add("math in-process", build_filter(FilterConfig(**math_cfg, workers=0), task),
        lambda rng: math_batch(args.math_samples, rng), group_size=4)
    add("math pool", build_filter(FilterConfig(**math_cfg, workers=args.workers), task),
        lambda rng: math_batch(args.math_samples, rng), group_size=4, workers=args.workers)
    code_cfg = FilterConfig(reward="code", workers=args.workers, timeout_s=60,
                            sandbox={"timeout_s": 2.0, "cpu_s": 1})
    add("code pool", build_filter(code_cfg, task),
        lambda rng: code_batch(args.code_samples, rng), group_size=4, workers=args.workers)
    lat = []
    for _ in range(max(args.reps, 5)):
        t0 = time.perf_counter()
        run_python("pass")
        lat.append(time.perf_counter() - t0)
    sec = statistics.median(lat)
    rows.append({"verifier": "sandbox run (latency)", "workers": 0, "samples": 1,
                 "seconds": sec, "samples_per_s": 1 / sec, "ms_per_sample": 1000 * sec,
                 "worker_startup_s": 0.0, "failed": 0.0})
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=512, help="arith samples per batch")
    ap.add_argument("--math-samples", type=int, default=200)
    ap.add_argument("--code-samples", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows, iso = run(args), isolation_report()
    if args.json:
        print(json.dumps({"rows": rows, "sandbox_isolation": iso}, indent=2))
        return 0
    print(f"{'verifier':24} {'workers':>7} {'samples':>7} {'samples/s':>10} {'ms/sample':>10} "
          f"{'startup s':>9} {'failed':>6}")
    for r in rows:
        print(f"{r['verifier']:24} {r['workers']:>7} {r['samples']:>7} "
              f"{r['samples_per_s']:>10.1f} {r['ms_per_sample']:>10.3f} "
              f"{r['worker_startup_s']:>9.2f} {int(r['failed']):>6}")
    print("sandbox isolation here: " + ", ".join(f"{k}={v}" for k, v in iso.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
