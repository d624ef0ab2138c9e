"""The decision rules of the tree generators, as pure functions of token statistics, so each
threshold can be tested on constructed traces (docs/methods.md#echo, #latr).

ECHO reads the engine's top-k log-probabilities at every token:
    H_t   entropy of the top-k distribution renormalised,
    C_t   -mean log p over the top 5 (DeepConf's confidence: larger = more peaked),
    C_g   mean C over the last `group_window` tokens, C_tail over the last `tail_window`,
    dH_t  H_t - mean of the previous `delta_window` entropies.
LATR reads the top-2 probabilities of the unwarped distribution and compares a child's newest
r tokens with its parent's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------- ECHO

@dataclass
class EchoTrace:
    """A sequence's ECHO statistics, one entry per response token."""

    H: list[float] = field(default_factory=list)
    C: list[float] = field(default_factory=list)
    Cg: list[float] = field(default_factory=list)
    Ctail: list[float] = field(default_factory=list)
    dH: list[float] = field(default_factory=list)

    def head(self, n: int) -> "EchoTrace":
        """A copy of the statistics of the first n tokens."""
        return EchoTrace(*(x[:n] for x in (self.H, self.C, self.Cg, self.Ctail, self.dH)))


def topk_entropy(logprobs: list[float]) -> float:
    """Entropy of the top-k distribution renormalised (nats)."""
    m = max(logprobs)
    w = [math.exp(x - m) for x in logprobs]
    z = sum(w)
    return -sum(p / z * math.log(p / z) for p in w if p > 0)


def top5_confidence(logprobs: list[float]) -> float:
    """DeepConf's token confidence: -mean log p of the 5 most likely tokens."""
    top = sorted(logprobs, reverse=True)[:5]
    return -sum(top) / len(top)


def _mean_last(xs: list[float], n: int) -> float:
    tail = xs[-n:]
    return sum(tail) / len(tail)


def echo_push(trace: EchoTrace, top_logprobs: list[float], cfg) -> None:
    """Add one token's statistics (cfg: EchoConfig's windows)."""
    H = topk_entropy(top_logprobs)
    prev = trace.H[-cfg.delta_window:]
    trace.dH.append(H - sum(prev) / len(prev) if prev else 0.0)
    trace.H.append(H)
    trace.C.append(top5_confidence(top_logprobs))
    trace.Cg.append(_mean_last(trace.C, cfg.group_window))
    trace.Ctail.append(_mean_last(trace.C, cfg.tail_window))


def echo_branches_at(trace: EchoTrace, t: int, cfg) -> bool:
    """Branch at token t: t >= min_position, H_t >= entropy_threshold, C_g <= conf_threshold,
    dH_t >= delta_threshold."""
    return (t >= cfg.min_position and trace.H[t] >= cfg.entropy_threshold
            and trace.Cg[t] <= cfg.conf_threshold and trace.dH[t] >= cfg.delta_threshold)


def echo_width(H: float, Cg: float, cfg) -> int:
    """w = clip(round(1 + 2 (H - H0) / (H* - H0) - (C_g - C*) / C*), 1, max_width), with
    H* = entropy_threshold, H0 = entropy_floor (1 in the released code) and
    C* = conf_threshold: more alternatives where the model is unsure and unconfident."""
    H_star, H0, C_star = cfg.entropy_threshold, cfg.entropy_floor, cfg.conf_threshold
    w = round(1 + 2 * (H - H0) / (H_star - H0) - (Cg - C_star) / C_star)
    return max(1, min(cfg.max_width, w))


def echo_prune_reason(trace: EchoTrace, cfg, run: int = 3) -> str | None:
    """Why the sequence is cut at its latest token, or None:
    min_conf: the running minimum of C_g fell below min_group_conf;
    conf_falling: C_tail fell `run` steps in a row and is <= tail_conf;
    entropy_rising: dH rose `run` steps in a row and is > delta_rise."""
    if min(trace.Cg) < cfg.min_group_conf:
        return "min_conf"
    tail, dH = trace.Ctail[-run - 1:], trace.dH[-run - 1:]
    if len(tail) == run + 1 and all(b < a for a, b in zip(tail, tail[1:])) \
            and tail[-1] <= cfg.tail_conf:
        return "conf_falling"
    if len(dH) == run + 1 and all(b > a for a, b in zip(dH, dH[1:])) and dH[-1] > cfg.delta_rise:
        return "entropy_rising"
    return None


def echo_alternatives(top: list[tuple[int, float]], sampled: int, width: int) -> list[int]:
    """The `width` most likely tokens other than the one sampled."""
    ranked = sorted(top, key=lambda x: -x[1])
    return [t for t, _ in ranked if t != sampled][:width]


# ---------------------------------------------------------------------------------- LATR

def latr_branches(p1: float, p2: float, tau_abs: float, tau_rel: float) -> bool:
    """Spawn a branch on the second-best token when it is likely on its own (p2 > tau_abs)
    and close to the best (p1 - p2 < tau_rel)."""
    return p2 > tau_abs and p1 - p2 < tau_rel


def edit_distance(a: list[int], b: list[int]) -> int:
    """Levenshtein distance between two token lists."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def latr_too_similar(child: list[int], parent: list[int], threshold: float) -> bool:
    """Lookahead pruning: the child's newest r tokens against its parent's newest r (the
    same positions): normalised edit distance below `threshold` means the branch rejoined
    its parent's path and adds nothing."""
    n = max(len(child), len(parent), 1)
    return edit_distance(child, parent) / n < threshold


def latr_exit_count(n: int, roots: int, t: int, max_len: int) -> int:
    """Branches at which the tree phase may end at decode step t:
    round(n * roots * (0.98 - 0.05 t / max_len))."""
    return round(n * roots * (0.98 - 0.05 * t / max_len))


def eta_at(schedule: dict[int, float], step: int) -> float:
    """The share of a group drawn from the tree at training step `step`: the value of the
    latest schedule key at or before it (a step function)."""
    keys = sorted(k for k in schedule if k <= step)
    return schedule[keys[-1]] if keys else 1.0
