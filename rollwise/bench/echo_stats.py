"""ECHO's token statistics on a warm start's sampled responses, to set its thresholds for a
model (the released ones are for a 7B model's top-10 statistics).

    rollwise bench echo_stats --model DIR [--config stepped] [--prompts 48]
                              [key=value ...]

Samples one response per held-out prompt at T = 1 and prints the quantiles of H (top-k
entropy renormalised), C (-mean log p over the top 5), C_g (mean C over group_window tokens)
and dH (H minus the mean of the previous delta_window), each as tree_rules.echo_push computes
them, the share of tokens at each entropy level, C_g and dH where H is high, and the
probabilities of the second and third tokens there (how many alternatives are plausible).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from rollwise import models
from rollwise.config import load_config
from rollwise.presets import PRESETS
from rollwise.stages.generate.tree_rules import EchoTrace, echo_push
from rollwise.tasks import load_task
from rollwise.tasks.prompts import Prompter

CONFIG = str(PRESETS / "stepped.yaml")
LEVELS = (0.05, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99)


def quantile(xs: list[float], f: float) -> float:
    return sorted(xs)[int(f * (len(xs) - 1))]


def sample_traces(model, tok, prompter, problems, cfg, max_new: int):
    """(EchoTrace, [p2, p3] per token) of one sampled response per problem."""
    out = []
    for p in problems:
        ids = torch.tensor([prompter.ids(p)])
        with torch.no_grad():
            gen = model.generate(ids, do_sample=True, temperature=1.0, top_k=0,
                                 max_new_tokens=max_new, output_scores=True,
                                 return_dict_in_generate=True, eos_token_id=prompter.stop_ids,
                                 pad_token_id=tok.pad_token_id)
        trace, alts = EchoTrace(), []
        for scores in gen.scores:
            top = torch.log_softmax(scores[0].float(), -1).topk(cfg.top_k).values
            echo_push(trace, top.tolist(), cfg)
            alts.append(top[1:3].exp().tolist())
        out.append((trace, alts))
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench echo_stats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="warm-start model folder")
    p.add_argument("--config", default=CONFIG, help="run config (\"\": the defaults)")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--high", type=float, default=0.3, help="the entropy level called high")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = load_config(args.config or None, args.overrides)  # "": the defaults
    task = load_task(cfg.task)
    model, tok = models.load_model(args.model)
    model.eval()
    prompter = Prompter.for_task(cfg.task, tok, task, model)
    traces = sample_traces(model, tok, prompter, task.eval[:args.prompts], cfg.generate.echo,
                           cfg.generate.max_new_tokens)
    stats = {k: [x for t, _ in traces for x in getattr(t, k)] for k in ("H", "C", "Cg", "dH")}
    print(f"{len(stats['H'])} tokens of {len(traces)} sampled responses")
    print("| statistic | " + " | ".join(f"q{f}" for f in LEVELS) + " |")
    print("|---|" + "---|" * len(LEVELS))
    for k, xs in stats.items():
        print(f"| {k} | " + " | ".join(f"{quantile(xs, f):.3f}" for f in LEVELS) + " |")
    for level in (0.1, 0.2, 0.3, 0.5):
        share = sum(h >= level for h in stats["H"]) / len(stats["H"])
        print(f"share of tokens with H >= {level}: {share:.3f}")
    high = [(t.Cg[i], t.dH[i], a[i]) for t, a in traces for i, h in enumerate(t.H)
            if h >= args.high]
    if high:
        print(f"where H >= {args.high} ({len(high)} tokens): C_g q0.1/0.5/0.9 "
              + "/".join(f"{quantile([x[0] for x in high], f):.2f}" for f in (0.1, 0.5, 0.9))
              + ", dH " + "/".join(f"{quantile([x[1] for x in high], f):.2f}"
                                   for f in (0.1, 0.5, 0.9))
              + f", p2 median {statistics.median(x[2][0] for x in high):.3f}"
              + f", p3 median {statistics.median(x[2][1] for x in high):.4f}"
              + f" (max {max(x[2][1] for x in high):.4f})")
    print(f"C_g low tail q0.001/0.01: {quantile(stats['Cg'], 0.001):.3f} / "
          f"{quantile(stats['Cg'], 0.01):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
