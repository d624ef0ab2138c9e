"""A profiling pass on a warm start, and the documented rules that set the methods' thresholds
from it (rollwise bench methods).

The pass samples one response per training prompt from the warm start, as training would
(the config's temperature and length limit, top_k 0), and records per response its length,
whether it ran into the limit, its reward, where the answer marker and the task's answer first
appear, and per token ECHO's statistics (tree_rules.echo_push on the top-`echo.top_k`
log-probabilities) and the five largest probabilities of the unwarped distribution.

The rules read those statistics only: never a bench's outcome. Each keeps the paper's value
where the statistics allow it and says why when they do not (`Choice.rule`):

- LATR: the paper's math thresholds (tau_abs 0.15, tau_rel 0.25) when they make at least one
  branch point per response on average, else tau_abs lowered to the second-best probability's
  quantile that does; the paper's lookahead ages (20, 30, 50) that fall inside the median
  response, else a quarter and a half of it; the similarity threshold is the paper's.
- ECHO (the released thresholds are for a 7B model's top-10 statistics):
  entropy_threshold: the released 3.5 if 1-20 % of tokens reach it, else the entropy's 0.95
  quantile (the 5 % most uncertain tokens); entropy_floor: the released 1.0 if below that,
  else the median entropy; conf_threshold and delta_threshold: the released values if at least
  half the tokens above the entropy threshold pass them, else the median of C_g and dH there;
  max_width: the alternatives (ranks 2-5) whose median probability at those tokens is at least
  0.05, the released 4 at most; each prune rule alone (min_group_conf, tail_conf, delta_rise):
  the released value if it cuts 1-25 % of the responses, else the value that cuts about 5 %.
  C (-mean log p of the top 5) is at least ln 5 = 1.61 by Jensen's inequality, so the released
  conf_threshold 1.2, min_group_conf 0.4 and tail_conf 1.0 can never hold.
- ARRoL: no value in the paper ("T_p tokens or a fraction of the length"): the checkpoint is the
  responses' 0.25 length quantile (at least 8), so three quarters still decode when it scores.
- DUET: the paper's math marker (\\boxed{) if at least 5 % of the responses write it, else
  the task's answer extractor; the horizon is the 0.9 quantile of the marker's position among
  the responses that show it (at least 8). A response that ends before the horizon is never
  aborted, so a marker that only some responses write cuts only the long marker-less tails.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import asdict, dataclass, field

import torch

from rollwise.stages.control.abort_duet import first_prefix
from rollwise.stages.generate.tree_rules import EchoTrace, echo_prune_reason, echo_push

PAPER_MARKER = r"\\boxed\{"
PAPER_LATR = {"tau_abs": 0.15, "tau_rel": 0.25, "ages": [20, 30, 50]}
PAPER_ECHO = {"entropy_threshold": 3.5, "entropy_floor": 1.0, "conf_threshold": 1.2,
              "delta_threshold": 0.2, "max_width": 4, "min_group_conf": 0.4, "tail_conf": 1.0,
              "delta_rise": 0.5}
# each prune rule alone, and the settings that switch the other two off
PRUNE_RULES = {"min_group_conf": "min_conf", "tail_conf": "conf_falling",
               "delta_rise": "entropy_rising"}
PRUNE_OFF = {"min_group_conf": -math.inf, "tail_conf": -math.inf, "delta_rise": math.inf}


@dataclass
class Response:
    length: int  # response tokens, the stop token included
    truncated: bool  # ran into the length limit
    reward: float
    marker_at: int | None  # tokens decoded when PAPER_MARKER first matched
    answer_at: int | None  # tokens decoded when the task's extractor first found an answer
    trace: EchoTrace = field(default_factory=EchoTrace)
    top: list[list[float]] = field(default_factory=list)  # per token, the top-5 probabilities


@dataclass
class Choice:
    knob: str  # the config key
    value: object
    paper: object
    rule: str  # why this value

    def override(self) -> str:
        v = self.value
        return f"{self.knob}={json_value(v)}"


def json_value(v) -> str:
    if isinstance(v, list):
        return "[" + ",".join(str(x) for x in v) + "]"
    if isinstance(v, float):
        return f"{v:.6g}"
    return "null" if v is None else str(v)


def quantile(xs: list[float], f: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(f * (len(s) - 1))))]


# ------------------------------------------------------------------------------ the pass

@torch.no_grad()
def sample_responses(model, tok, prompter, problems, scorer, extract, temperature: float,
                     max_new: int, echo_cfg, batch: int = 16) -> list[Response]:
    """One sampled response per problem, with the statistics the rules read."""
    pad = tok.pad_token_id if tok.pad_token_id is not None else prompter.stop_ids[0]
    marker = re.compile(PAPER_MARKER)
    out = []
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        ids = [prompter.ids(p) for p in chunk]
        width = max(len(x) for x in ids)
        inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        gen = model.generate(inp, attention_mask=mask, do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0, max_new_tokens=max_new, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=list(prompter.stop_ids),
                             pad_token_id=pad)
        new = gen.sequences[:, width:]
        for row, problem in enumerate(chunk):
            toks = new[row].tolist()
            stop = next((j for j, t in enumerate(toks) if t in prompter.stop_ids), None)
            n = len(toks) if stop is None else stop + 1
            resp = toks[:n]
            text = tok.decode(resp, skip_special_tokens=True)
            decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
            r = Response(n, stop is None, scorer(text, problem)[0],
                         first_prefix(resp, lambda x: bool(marker.search(decode(x)))),
                         first_prefix(resp, lambda x: extract(decode(x)) is not None))
            for j in range(n):
                logp = torch.log_softmax(gen.logits[j][row].float(), -1)
                top = logp.topk(max(echo_cfg.top_k, 5)).values
                echo_push(r.trace, top[:echo_cfg.top_k].tolist(), echo_cfg)
                r.top.append(top[:5].exp().tolist())
            out.append(r)
    return out


# ------------------------------------------------------------------------------ the rules

def latr_choices(rs: list[Response]) -> list[Choice]:
    per_response = lambda ta, tr: statistics.mean(  # noqa: E731
        sum(p[1] > ta and p[0] - p[1] < tr for p in r.top) for r in rs)
    ta, tr = PAPER_LATR["tau_abs"], PAPER_LATR["tau_rel"]
    rate = per_response(ta, tr)
    if rate >= 1:
        tau = Choice("generate.latr.tau_abs", ta, ta,
                     f"paper's: {rate:.1f} branch points per response")
    else:
        p2 = sorted((p[1] for r in rs for p in r.top if p[0] - p[1] < tr), reverse=True)
        v = p2[min(len(rs), len(p2)) - 1] if p2 else 0.0  # one per response on average
        tau = Choice("generate.latr.tau_abs", round(max(v - 1e-6, 0.0), 6), ta,
                     f"paper's makes {rate:.2f} branch points per response: lowered to one")
    median = statistics.median(r.length for r in rs)
    ages = [a for a in PAPER_LATR["ages"] if a < median]
    age = Choice("generate.latr.ages", ages, PAPER_LATR["ages"],
                 f"paper's below the median response ({median:.0f} tokens)")
    if not ages:
        age = Choice("generate.latr.ages", sorted({max(1, round(median / 4)),
                                                   max(2, round(median / 2))}),
                     PAPER_LATR["ages"], f"the median response ({median:.0f} tokens) is "
                     "shorter than the paper's ages: a quarter and a half of it")
    return [tau, Choice("generate.latr.tau_rel", tr, tr, "paper's"), age]


def echo_choices(rs: list[Response], echo_cfg) -> list[Choice]:
    traces = [r.trace for r in rs]
    H = [h for t in traces for h in t.H]
    share = sum(h >= PAPER_ECHO["entropy_threshold"] for h in H) / len(H)
    out = []
    if 0.01 <= share <= 0.2:
        thr = PAPER_ECHO["entropy_threshold"]
        out.append(Choice("generate.echo.entropy_threshold", thr, thr,
                          f"released: {share:.1%} of tokens reach it"))
    else:
        thr = quantile(H, 0.95)
        out.append(Choice("generate.echo.entropy_threshold", round(thr, 4),
                          PAPER_ECHO["entropy_threshold"],
                          f"released reached by {share:.2%} of tokens (top-{echo_cfg.top_k} "
                          f"entropy is at most ln {echo_cfg.top_k} = "
                          f"{math.log(echo_cfg.top_k):.2f}): the entropy's 0.95 quantile"))
    floor = PAPER_ECHO["entropy_floor"]
    out.append(Choice("generate.echo.entropy_floor", floor, floor, "released, below the threshold")
               if floor < thr else
               Choice("generate.echo.entropy_floor", round(statistics.median(H), 4), floor,
                      "released is not below the threshold: the median entropy"))
    high = [(t.Cg[i], t.dH[i], r.top[i]) for r, t in zip(rs, traces)
            for i, h in enumerate(t.H) if h >= thr]
    for knob, k, passes in (("conf_threshold", 0, lambda x, v: x <= v),
                            ("delta_threshold", 1, lambda x, v: x >= v)):
        paper = PAPER_ECHO[knob]
        ok = sum(passes(x[k], paper) for x in high) / max(len(high), 1)
        out.append(Choice(f"generate.echo.{knob}", paper, paper,
                          f"released: {ok:.0%} of the uncertain tokens pass it") if ok >= 0.5
                   else Choice(f"generate.echo.{knob}",
                               round(statistics.median(x[k] for x in high), 4) if high else paper,
                               paper, f"released passes {ok:.0%} of the uncertain tokens: "
                               "their median"))
    width = sum(statistics.median(x[2][j] for x in high) >= 0.05 for j in range(1, 5)) \
        if high else 1
    width = max(1, min(width, PAPER_ECHO["max_width"]))
    out.append(Choice("generate.echo.max_width", width, PAPER_ECHO["max_width"],
                      "released" if width == PAPER_ECHO["max_width"] else
                      f"{width} alternative(s) with median probability >= 0.05 where uncertain"))
    out += [prune_choice(knob, traces, echo_cfg) for knob in PRUNE_RULES]
    return out


def prune_share(traces: list[EchoTrace], cfg, knob: str, value: float, run: int = 3) -> float:
    """Share of the responses that rule `knob` alone (at `value`) would cut at some token, as
    tree_rules.echo_prune_reason decides it (given the running minimum of C_g and the last
    run + 1 values of the windows, all it reads)."""
    c = cfg.model_copy(update={**PRUNE_OFF, knob: value})
    cut = 0
    for t in traces:
        low = math.inf
        for n in range(1, len(t.H) + 1):
            low = min(low, t.Cg[n - 1])
            view = EchoTrace(Cg=[low], Ctail=t.Ctail[max(0, n - run - 1):n],
                             dH=t.dH[max(0, n - run - 1):n])
            if echo_prune_reason(view, c, run) == PRUNE_RULES[knob]:
                cut += 1
                break
    return cut / max(len(traces), 1)


def prune_choice(knob: str, traces: list[EchoTrace], echo_cfg) -> Choice:
    paper = PAPER_ECHO[knob]
    share = prune_share(traces, echo_cfg, knob, paper)
    if 0.01 <= share <= 0.25:
        return Choice(f"generate.echo.{knob}", paper, paper,
                      f"released: cuts {share:.0%} of the responses")
    # the candidates: the statistic's quantiles, the one cutting closest to 5 %
    stat = {"min_group_conf": "Cg", "tail_conf": "Ctail", "delta_rise": "dH"}[knob]
    xs = [x for t in traces for x in getattr(t, stat)]
    grid = sorted({quantile(xs, f) for f in (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
                                             0.1, 0.2, 0.5, 0.8, 0.9, 0.95, 0.98, 0.99,
                                             0.995, 0.999)})
    best = min(grid, key=lambda v: abs(prune_share(traces, echo_cfg, knob, v) - 0.05))
    got = prune_share(traces, echo_cfg, knob, best)
    return Choice(f"generate.echo.{knob}", round(best, 4), paper,
                  f"released cuts {share:.0%} of the responses: the value cutting {got:.0%}")


def arrol_choices(rs: list[Response]) -> list[Choice]:
    q = quantile([r.length for r in rs], 0.25)
    return [Choice("control.arrol.checkpoint", max(8, int(q)), None,
                   f"the responses' 0.25 length quantile ({q} tokens), at least 8")]


def duet_choices(rs: list[Response]) -> list[Choice]:
    writes = sum(r.marker_at is not None for r in rs) / max(len(rs), 1)
    at = [r.marker_at for r in rs if r.marker_at is not None]
    if writes >= 0.05:
        marker = Choice("control.duet.marker", f"'{PAPER_MARKER}'", PAPER_MARKER,
                        f"paper's: {writes:.0%} of the responses write it")
    else:
        marker = Choice("control.duet.marker", None, PAPER_MARKER,
                        f"{writes:.0%} of the responses write the paper's marker: the task's "
                        "answer extractor")
        at = [r.answer_at for r in rs if r.answer_at is not None]
    h = max(8, int(quantile(at, 0.9))) if at else 32
    return [marker, Choice("control.duet.horizon", h, None,
                           f"0.9 quantile of the marker's position ({len(at)} of {len(rs)} "
                           "responses show it), at least 8")]


def summary(rs: list[Response]) -> dict:
    lengths = [r.length for r in rs]
    return {"responses": len(rs), "length_median": statistics.median(lengths),
            "length_q25": quantile(lengths, 0.25), "length_q90": quantile(lengths, 0.9),
            "truncated_share": statistics.mean(r.truncated for r in rs),
            "reward_mean": statistics.mean(r.reward for r in rs),
            "marker_share": statistics.mean(r.marker_at is not None for r in rs),
            "answer_share": statistics.mean(r.answer_at is not None for r in rs)}


def choose(rs: list[Response], echo_cfg) -> dict[str, list[Choice]]:
    """The rules' choices per method."""
    return {"latr": latr_choices(rs), "echo": echo_choices(rs, echo_cfg),
            "arrol": arrol_choices(rs), "duet": duet_choices(rs)}


def as_json(choices: dict[str, list[Choice]]) -> dict:
    return {m: [asdict(c) for c in cs] for m, cs in choices.items()}
