"""APRIL's resumed answers with and without shared prefixes, side by side:

    rollwise bench resume --config smollm2-long --init FOLDER [--problems 8]
        [--cut 89] [--repeats 3] [--json] [key=value ...]

Each step of APRIL pauses the unfinished answers and resumes them under the new weights as new
requests, prompt and partial answer, prefilled again. This bench samples the partial answers
once (problems x group_size answers to the config's prompts, cut at --cut tokens), then
resumes the unfinished ones to the end on a fresh engine per arm: engine.share_prefix off (each
prefills its prompt and partial answer) against on (the answers after the first of a group
copy its prompt's K/V). The arms run in turn, --repeats times; their answers are compared
token for token (copied K/V differs from a full prefill's by float rounding only).

Top-level keys: resume_speedup (median seconds off over on), resume_prefill_saved (the share
of prefilled tokens the sharing avoided) and same_answers (the share of resumed answers equal
token for token in the two arms).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

from rollwise import models
from rollwise.config import load_config
from rollwise.engine import BuiltinEngine, Request
from rollwise.stages.generate.group import sampling_params
from rollwise.tasks import load_task
from rollwise.tasks.prompts import Prompter


def partial_answers(cfg, model, prompts: list[list[int]], params, cut: int) -> list[Request]:
    """Every unfinished answer after `cut` tokens, as the request that resumes it."""
    engine = BuiltinEngine(model, max_batch=cfg.engine.max_batch, seed=cfg.run.seed,
                           segment=cfg.engine.segment)
    first = dataclasses.replace(params, max_new_tokens=cut)
    requests = [Request(p, dataclasses.replace(first, seed=i * 1000 + j))
                for i, p in enumerate(prompts) for j in range(cfg.generate.group_size)]
    out = []
    for r, c in zip(requests, engine.generate(requests)):
        if c.finish_reason == "length":
            rest = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - cut,
                                       seed=r.params.seed + cut)
            out.append(Request(r.prompt_ids + c.token_ids, rest))
    return out


def resume(cfg, model, requests: list[Request], share: bool) -> dict:
    engine = BuiltinEngine(model, max_batch=cfg.engine.max_batch, seed=cfg.run.seed,
                           segment=cfg.engine.segment, share_prefix=share)
    t0 = time.perf_counter()
    done = engine.generate(requests)
    return {"seconds": time.perf_counter() - t0, "prefill_tokens": engine.prefill_tokens,
            "shared_tokens": engine.prefix_tokens_saved,
            "decoded_tokens": engine.tokens_generated, "tokens": [c.token_ids for c in done]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench resume", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="the run's config (its model, task and sampling)")
    p.add_argument("--init", help="model folder (default: the config's model)")
    p.add_argument("--problems", type=int, default=8, help="prompts, group_size answers each")
    p.add_argument("--cut", type=int, default=89, help="tokens sampled before the pause")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if not 0 < args.cut < cfg.generate.max_new_tokens:
        p.error(f"--cut {args.cut}: give 1 to generate.max_new_tokens - 1 "
                f"({cfg.generate.max_new_tokens - 1})")
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    if args.init or cfg.model.path:
        model, tokenizer = models.load_model(args.init or cfg.model.path, cfg.model.dtype)
    else:  # the config's built model (the tiny default), untrained
        model, tokenizer = models.build(cfg.model, seed=cfg.run.seed)
    model.eval()
    task = load_task(cfg.task)
    prompter = Prompter.for_task(cfg.task, tokenizer, task)
    prompts = [q.prompt_ids for q in prompter.render(task.train[:args.problems])]
    params = sampling_params(cfg.generate, prompter.stop_ids)
    requests = partial_answers(cfg, model, prompts, params, args.cut)
    if not requests:
        p.error(f"every answer ended within --cut {args.cut} tokens: nothing to resume")
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    same = []
    for i in range(args.repeats):
        for arm in runs:
            runs[arm].append(resume(cfg, model, requests, share=arm == "on"))
        pairs = zip(runs["on"][-1].pop("tokens"), runs["off"][-1].pop("tokens"))
        same.append(statistics.mean(a == b for a, b in pairs))
        print(f"repeat {i}: off {runs['off'][-1]['seconds']:.2f}s, on "
              f"{runs['on'][-1]['seconds']:.2f}s", file=sys.stderr)
    med = {a: statistics.median(r["seconds"] for r in rs) for a, rs in runs.items()}
    off, on = runs["off"][0], runs["on"][0]
    out = {"resume_speedup": med["off"] / med["on"],
           "resume_prefill_saved": 1 - on["prefill_tokens"] / off["prefill_tokens"],
           "same_answers": min(same), "resumed": len(requests), "prompts": len(prompts),
           "cut": args.cut,
           "median_seconds": med, "per_round": {a: rs[0] for a, rs in runs.items()},
           "seconds": {a: [r["seconds"] for r in rs] for a, rs in runs.items()}}
    print(json.dumps(out, indent=2) if args.json else
          f"{len(requests)} answers resumed: {med['off']:.2f}s without shared prefixes, "
          f"{med['on']:.2f}s with them ({out['resume_speedup']:.2f}x); prefilled "
          f"{off['prefill_tokens']} -> {on['prefill_tokens']} tokens "
          f"({100 * out['resume_prefill_saved']:.0f} % saved)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
