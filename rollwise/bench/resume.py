"""APRIL's resumed answers prefilled again (with and without shared prefixes) and kept, side
by side:

    rollwise bench resume --config smollm2-long --init FOLDER [--problems 8]
        [--cut 89] [--repeats 3] [--json] [key=value ...]

Each step of APRIL pauses the unfinished answers and resumes them under the new weights as new
requests, prompt and partial answer, prefilled again. This bench samples the partial answers
once (problems x group_size answers to the config's prompts, cut at --cut tokens), then
resumes the unfinished ones to the end on a fresh engine per arm: engine.share_prefix off (each
prefills its prompt and partial answer) against on (the answers after the first of a group
copy its prompt's K/V). The arms run in turn, --repeats times; their answers are compared
token for token (copied K/V differs from a full prefill's by float rounding only).

The keep arm (loop.carried_kv=keep) samples the same partial answers on one engine (the same
seeds, an event at exactly --cut tokens), pauses the unfinished ones with their K/V, writes
the weights in place as a sync does (a new version), and times their resume to the end: no
prefill. Its answers after the cut draw the uniforms the other arms' resumed requests draw,
so the arms decode the same answers but where K/V computed in another pass rounds otherwise
(same_answers_kept).

Top-level keys: resume_speedup (median seconds off over on), resume_prefill_saved (the share
of prefilled tokens the sharing avoided), same_answers (the share of resumed answers equal
token for token in the two arms), keep_speedup (median seconds off over keep),
keep_prefill_tokens and same_answers_kept (the share of kept answers equal to the off arm's).
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
from rollwise.engine.sampling import SeedStream
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
    """One arm's round: the partial answers resumed as new requests, prefilled again."""
    engine = BuiltinEngine(model, max_batch=cfg.engine.max_batch, seed=cfg.run.seed,
                           segment=cfg.engine.segment, share_prefix=share)
    t0 = time.perf_counter()
    done = engine.generate(requests)
    # the decode graph's compile (or load from torch's cache) is the engine's start, not the
    # round's: the keep arm's engine did it before its round
    seconds = time.perf_counter() - t0 - engine.graph_compile_seconds
    return {"seconds": seconds, "prefill_tokens": engine.prefill_tokens,
            "shared_tokens": engine.prefix_tokens_saved,
            "decoded_tokens": engine.tokens_generated, "tokens": [c.token_ids for c in done]}


def kept_resume(cfg, model, prompts: list[list[int]], params, cut: int) -> dict:
    """The keep arm: sample to `cut` tokens, pause the unfinished with their K/V, write the
    weights in place (a sync), then time their resume to the end."""
    engine = BuiltinEngine(model, max_batch=cfg.engine.max_batch, seed=cfg.run.seed,
                           segment=cfg.engine.segment)
    first = dataclasses.replace(params, event_every=cut)
    for i, p in enumerate(prompts):
        for j in range(cfg.generate.group_size):
            engine.add(Request(p, dataclasses.replace(first, seed=i * 1000 + j)))
    paused = []
    while engine.has_unfinished():
        for ev in engine.step():
            if not ev.finished:  # its first event: `cut` tokens
                paused.append(engine.pause(ev.seq_id, keep=True).seq_id)
                # from here the uniforms and events of the other arms' resumed requests, so
                seq = engine.scheduler.get(ev.seq_id)  # the arms sample the same answers
                seq.rng = SeedStream(seq.params.seed + cut)
                seq.params = dataclasses.replace(seq.params, event_every=0)
    engine.load_weights(model.state_dict(), version=1)  # in place, as a sync writes them
    seeds = {i: engine.scheduler.get(i).params.seed + cut for i in paused}
    prefilled, decoded = engine.prefill_tokens, engine.tokens_generated
    answers: dict[int, list[int]] = {i: [] for i in paused}
    t0 = time.perf_counter()
    for seq_id in paused:
        engine.resume(seq_id)
    while engine.has_unfinished():
        for ev in engine.step():
            answers[ev.seq_id] += ev.token_ids
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "resumed": len(paused),
            "prefill_tokens": engine.prefill_tokens - prefilled,
            "decoded_tokens": engine.tokens_generated - decoded,
            "by_seed": {seeds[i]: a for i, a in answers.items()}}


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
    runs: dict[str, list[dict]] = {"off": [], "on": [], "keep": []}
    same, same_kept = [], []
    for i in range(args.repeats):
        for arm in runs:
            runs[arm].append(kept_resume(cfg, model, prompts, params, args.cut) if arm == "keep"
                             else resume(cfg, model, requests, share=arm == "on"))
        off_tokens = runs["off"][-1].pop("tokens")
        pairs = zip(runs["on"][-1].pop("tokens"), off_tokens)
        same.append(statistics.mean(a == b for a, b in pairs))
        kept = runs["keep"][-1].pop("by_seed")
        same_kept.append(statistics.mean(kept.get(r.params.seed) == t
                                         for r, t in zip(requests, off_tokens)))
        print(f"repeat {i}: " + ", ".join(f"{a} {runs[a][-1]['seconds']:.2f}s" for a in runs),
              file=sys.stderr)
    if runs["keep"][0]["resumed"] != len(requests):  # the same partial answers, or a bug
        raise RuntimeError(f"the keep arm paused {runs['keep'][0]['resumed']} answers at "
                           f"{args.cut} tokens, the others resume {len(requests)}")
    med = {a: statistics.median(r["seconds"] for r in rs) for a, rs in runs.items()}
    off, on = runs["off"][0], runs["on"][0]
    out = {"resume_speedup": med["off"] / med["on"],
           "resume_prefill_saved": 1 - on["prefill_tokens"] / off["prefill_tokens"],
           "same_answers": min(same), "resumed": len(requests), "prompts": len(prompts),
           "keep_speedup": med["off"] / med["keep"], "same_answers_kept": min(same_kept),
           "keep_prefill_tokens": runs["keep"][0]["prefill_tokens"],
           "cut": args.cut,
           "median_seconds": med, "per_round": {a: rs[0] for a, rs in runs.items()},
           "seconds": {a: [r["seconds"] for r in rs] for a, rs in runs.items()}}
    print(json.dumps(out, indent=2) if args.json else
          f"{len(requests)} answers resumed: {med['off']:.2f}s without shared prefixes, "
          f"{med['on']:.2f}s with them ({out['resume_speedup']:.2f}x); prefilled "
          f"{off['prefill_tokens']} -> {on['prefill_tokens']} tokens "
          f"({100 * out['resume_prefill_saved']:.0f} % saved); kept K/V {med['keep']:.2f}s "
          f"({out['keep_speedup']:.2f}x), prefilled {out['keep_prefill_tokens']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
