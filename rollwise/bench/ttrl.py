"""Test-time RL (TTRL) on the built-in task with the labels hidden: RL on the held-out prompts
themselves with the majority-vote reward (filter.reward=majority), as TTRL trains on the
unlabeled test set, then pass@1 on those prompts against the true answers.

    rollwise bench ttrl [--tiers sub2] [--seeds 0 1 2] [--temperature 0.6] [--group-size 32]
                        [--prompts 32] [--kl 1.0] [--lr 1e-4] [--steps 60] [--init MODEL]
                        [--root DIR] [--json] [-- section.key=value ...]

The recipe (defaults) and why, from docs/filter.md "Test-time RL": the label is the plurality
of --group-size votes at --temperature (TTRL votes 64 at 0.6; 8 votes at T=1 label the
warm start's sub2 prompts right only half the time), and a KL penalty to the warm start
(train.kl_coef=--kl) keeps the policy's shared answer distribution from sliding towards its
own systematic slips, the feedback loop behind the collapsed runs. Put extra
section.key=value overrides after `--` (e.g. `--seeds 0 1 2 -- run.threads=1`).

The held-out prompts of --tiers go to a JSONL file (answers as the model writes them, least
significant digit first) used as both the train and the eval split (task.name=file). The
reward never reads the answers; they serve only the evaluation and the diagnostic
filter/majority_label_acc. For the warm start and after each run it reports greedy pass@1
(the loop's held-out metric), sampled pass@1 (mean over --votes samples at --temperature:
what TTRL reports as pass@1) and maj@votes (the accuracy of the majority answer TTRL trains
towards; a tie counts as wrong).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

from rollwise import models
from rollwise.config import load_config
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.loop.run import train
from rollwise.stages.filter.majority import majority_label
from rollwise.tasks import load_task
from rollwise.tasks.extract import normalize
from rollwise.training.sft import warm_start, warm_start_path


def write_heldout(task, tiers: list[str], path: Path) -> int:
    rows = [{"prompt": p.prompt, "answer": p.solution, "tier": p.tier}
            for p in task.eval if not tiers or p.tier in tiers]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def score_model(model_dir: str, rows: list[dict], votes: int, temperature: float,
                seed: int = 123) -> dict:
    """Greedy pass@1, sampled pass@1 and maj@votes of a model folder on (prompt, answer) rows."""
    model, tok = models.load_model(model_dir)
    engine = BuiltinEngine(model, seed=seed, copy_model=False)

    def sample(temp: float, n: int) -> dict[int, list[str]]:
        params = SamplingParams(temperature=temp, max_new_tokens=8, stop_ids=(tok.eos_token_id,))
        reqs = [Request(tok(r["prompt"])["input_ids"], params, (i, j))
                for i, r in enumerate(rows) for j in range(n)]
        out = collections.defaultdict(list)
        for c in engine.generate(reqs):
            out[c.request_id[0]].append(tok.decode(c.token_ids, skip_special_tokens=True).strip())
        return out

    greedy, samples = sample(0.0, 1), sample(temperature, votes)
    maj = 0
    for i, r in enumerate(rows):
        label, _ = majority_label([normalize(a) for a in samples[i]])  # a tie: no label
        maj += label is not None and label == normalize(r["answer"])
    n = len(rows)
    return {"greedy_pass1": sum(greedy[i][0] == r["answer"] for i, r in enumerate(rows)) / n,
            "sampled_pass1": sum(a == r["answer"] for i, r in enumerate(rows)
                                 for a in samples[i]) / (n * votes),
            "maj_at_votes": maj / n}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="rollwise bench ttrl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiers", nargs="*", default=["sub2"], help="held-out tiers ([]: all)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--group-size", type=int, default=32, help="votes (and samples) per prompt")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step")
    ap.add_argument("--kl", type=float, default=1.0, help="train.kl_coef to the warm start")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--votes", type=int, help="samples for sampled pass@1 and maj@N "
                                              "(default: --group-size)")
    ap.add_argument("--init", help="warm-start model folder (default: the cached warm start)")
    ap.add_argument("--root", default="runs/bench-ttrl")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*",
                    help="extra section.key=value for the RL runs (after --)")
    args = ap.parse_args(argv)
    args.votes = args.votes or args.group_size

    base = load_config(None, [f"run.root={args.root}", "run.log=quiet"])
    task = load_task(base.task)
    init = args.init
    if init is None:
        warm_start(base, task, log=lambda *a: None)
        init = str(warm_start_path(base, task))
    data = Path(args.root) / "ttrl-heldout.jsonl"
    n = write_heldout(task, args.tiers, data)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    start = score_model(init, rows, args.votes, args.temperature)
    runs = []
    for seed in args.seeds:
        cfg = load_config(None, [
            "filter.reward=majority", "task.name=file", f"task.path={data}",
            f"task.eval_path={data}", f"generate.temperature={args.temperature}",
            f"generate.group_size={args.group_size}", f"control.prompts_per_step={args.prompts}",
            f"train.kl_coef={args.kl}",
            f"train.lr={args.lr}", f"train.steps={args.steps}", f"run.init={init}",
            f"run.seed={seed}", f"run.name=ttrl-s{seed}", f"run.root={args.root}",
            "run.log=quiet", *args.overrides])
        summary = train(cfg)
        metrics = [json.loads(x) for x in
                   (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        label_acc = [m["filter/majority_label_acc"] for m in metrics
                     if "filter/majority_label_acc" in m]
        end = score_model(str(Path(summary["run_dir"]) / "model"), rows, args.votes,
                          args.temperature)
        runs.append({"seed": seed, "label_acc_first": label_acc[0],
                     "label_acc_last": label_acc[-1],
                     **{f"end_{k}": v for k, v in end.items()}})
    result = {"prompts": n, "tiers": args.tiers, "temperature": args.temperature,
              "group_size": args.group_size, "prompts_per_step": args.prompts, "kl": args.kl,
              "overrides": args.overrides, "lr": args.lr, "steps": args.steps,
              "votes": args.votes, "init": init,
              "start": start, "runs": runs,
              "median_end": {k: statistics.median(r[f"end_{k}"] for r in runs) for k in start}}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"TTRL on {n} held-out prompts of tiers {args.tiers or 'all'} (labels hidden), "
          f"{args.group_size} votes at T={args.temperature}, {args.prompts} prompts/step, "
          f"kl {args.kl}, lr={args.lr}, {args.steps} steps {' '.join(args.overrides)}")
    print(f"{'':22} {'greedy pass@1':>13} {'sampled pass@1':>14} {'maj@' + str(args.votes):>8} "
          f"{'label acc first->last':>22}")
    print(f"{'warm start':22} {start['greedy_pass1']:>13.3f} {start['sampled_pass1']:>14.3f} "
          f"{start['maj_at_votes']:>8.3f}")
    for r in runs:
        print(f"{'after TTRL, seed ' + str(r['seed']):22} {r['end_greedy_pass1']:>13.3f} "
              f"{r['end_sampled_pass1']:>14.3f} {r['end_maj_at_votes']:>8.3f} "
              f"{r['label_acc_first']:>10.3f} -> {r['label_acc_last']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
