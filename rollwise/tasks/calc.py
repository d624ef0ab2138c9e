"""The built-in multi-turn arithmetic task for agent episodes (task.name=calc,
configs/calc.yaml: generate.strategy=episode with the `tools` environment and a calculator).

Tiers: small (sums of numbers below 20: 400 facts the tiny model learns by heart), mul2 (a
2-digit number times a 1-digit one), mul3 (3-digit by 3-digit: a million products, which
the model can only get right through the calculator) and chain (a*b*c: two 2-digit numbers
and a 1-digit one, two hops of one call each, configs/chain.yaml). Answers are numbers written most
significant digit first, as the calculator returns them; the tools environment scores the
last number of the model's final turn.

Worked solutions are the teacher's actions (`worked_actions`), replayed through the
environment for the warm start (rollwise.agents.transcripts): a direct answer for a small sum,
`calculator(a*b)` and then the result for the products, `calculator(a*b)`, then
`calculator(<its result>*c)` and the result for a chain. The noisy teacher (sft.noise of its
solutions) answers a product directly with a near miss and no call, so the warm start calls
the calculator only part of the time and RL has the tool use to learn. On a chain it makes the
first call and then answers with a near miss: its decision sits at the turn prefix after the
first call, not at the prompt (the multi-hop shape TRACE allocates to, docs/methods.md#trace).
"""

from __future__ import annotations

import random

from rollwise.config import TaskConfig
from rollwise.tasks.arith import noisy_answer
from rollwise.tasks.base import Task, draw_unique
from rollwise.types import Problem


def _small(r: random.Random): return r.randint(0, 19), "+", r.randint(0, 19)
def _mul2(r: random.Random): return r.randint(10, 99), "*", r.randint(2, 9)
def _mul3(r: random.Random): return r.randint(100, 999), "*", r.randint(100, 999)
def _chain(r: random.Random): return r.randint(10, 99), "*", r.randint(10, 99), "*", r.randint(2, 9)
def _chain3(r: random.Random):
    return r.randint(10, 99), "*", r.randint(2, 9), "*", r.randint(2, 9), "*", r.randint(2, 9)


TIERS = {"small": _small, "mul2": _mul2, "mul3": _mul3, "chain": _chain, "chain3": _chain3}
TOOL_TIERS = {"mul2", "mul3", "chain", "chain3"}  # the teacher calls the calculator for these
DEFAULT_TIERS = {"small": 0.3, "mul2": 0.3, "mul3": 0.4}
_OPS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}


def hops(terms: list) -> list[tuple[int, str, int]]:
    """The binary operations of terms (a, op, b, op, c, ...), left to right: each one's left
    operand is the result so far."""
    out, value = [], terms[0]
    for op, b in zip(terms[1::2], terms[2::2]):
        out.append((value, op, b))
        value = _OPS[op](value, b)
    return out


def stop_after(n_calls: int, rng: random.Random) -> int:
    """How many calls the noisy teacher makes of n_calls before it answers: none for one hop,
    else uniformly 1 to n_calls - 1 (no draw for two hops, which keeps chain's warm start)."""
    return 0 if n_calls < 2 else 1 if n_calls == 2 else rng.randint(1, n_calls - 1)


class CalcTask(Task):
    plain_prompts = True
    played_as = "episodes"  # its worked solutions and answers are tool-using episodes

    def __init__(self, cfg: TaskConfig):
        # task.tiers left at its default (the arith task's tiers) means this task's own
        tiers = cfg.tiers if "tiers" in cfg.model_fields_set else DEFAULT_TIERS
        unknown = set(tiers) - set(TIERS)
        if unknown:
            raise ValueError(f"task.tiers: unknown calc tier(s) {sorted(unknown)}; choose "
                             f"from {sorted(TIERS)}")
        if sum(tiers.values()) <= 0 or any(w < 0 for w in tiers.values()):
            raise ValueError(f"task.tiers = {tiers}: weights must be >= 0 with a positive sum")
        names = [t for t, w in tiers.items() if w > 0]
        weights = [tiers[t] for t in names]
        rng = random.Random(cfg.seed)
        seen: set[str] = set()
        self.eval = self._draw(names, weights, cfg.eval_size, rng, seen, "eval")
        self.train = self._draw(names, weights, cfg.train_size, rng, seen, "train")

    @staticmethod
    def _draw(names, weights, n, rng, exclude, split) -> list[Problem]:
        """n problems, tiers drawn by weight (rollwise.tasks.draw_unique)."""
        def draw(i: int) -> Problem:
            tier = rng.choices(names, weights=weights)[0]
            terms = list(TIERS[tier](rng))
            a, op, b = hops(terms)[-1]
            return Problem(id=f"{split}-{tier}-{i}", prompt="".join(map(str, terms)) + "=",
                           answer=str(_OPS[op](a, b)), tier=tier, data={"terms": terms})
        return draw_unique(n, draw, exclude, split, "the calc task")

    def worked_actions(self, problem: Problem, rng: random.Random, noisy: bool) -> list[str]:
        """The teacher's turns: a calculator call per hop and then the result for a product,
        the answer for a sum. A noisy teacher answers a one-hop product with a near miss and no
        call, and a chain with a near miss after its first call."""
        calls = [f"calculator({a}{op}{b})" for a, op, b in hops(problem.data["terms"])] \
            if problem.tier in TOOL_TIERS else []
        if noisy:
            return calls[:stop_after(len(calls), rng)] + [noisy_answer(int(problem.answer), rng)]
        return calls + [problem.answer]

    def extract_answer(self, response: str) -> str | None:
        """The last number of the response (the final turn's answer)."""
        digits = "".join(c if c.isdigit() or c == "-" else " " for c in response).split()
        return digits[-1] if digits else None
