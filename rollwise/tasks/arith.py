"""Built-in arithmetic tiers with exact answers, generated from a seed.

Prompts are right-aligned to a fixed width and answers are written least-significant digit
first ("12+39=" -> "15" for 51): carries then flow left to right, which a tiny model learns in
minutes. The warm start learns add2/sub2 from noisy worked solutions and mostly fails add3 and
chain, so RL has both fixable and hard prompts, reported per tier.

The stepped tiers (add2s to add5s) are additions whose worked solution is a scratchpad,
one column per step, least significant first, each with its carry, then ':' and the answer:
"347+586=" -> "7+6+0=13;4+8+1=13;3+5+1=09;:339" (933). A wrong step makes a wrong answer, so
the model's uncertainty sits at the steps; responses are 21-51 tokens long. The noisy teacher
(sft.noise of the solutions) forgets every carry, or gets a seeded set of digit-pair facts
wrong (task.stepped_teacher), so the warm start is unsure exactly at those columns.
"""

from __future__ import annotations

import random

from rollwise.config import TaskConfig
from rollwise.tasks.base import Task, draw_unique
from rollwise.types import Problem

WIDTH = 10  # prompt width in characters, left-padded with spaces


def _add2(r: random.Random):
    a, b = r.randint(10, 99), r.randint(10, 99)
    return f"{a}+{b}=", a + b
def _sub2(r: random.Random):
    a, b = sorted((r.randint(10, 99), r.randint(10, 99)), reverse=True)
    return f"{a}-{b}=", a - b
def _add3(r: random.Random):
    a, b = r.randint(100, 999), r.randint(100, 999)
    return f"{a}+{b}=", a + b
def _chain(r: random.Random):
    a, b, c = (r.randint(10, 99) for _ in range(3))
    return f"{a}+{b}-{c}=", a + b - c
def _mul1(r: random.Random):
    a, b = r.randint(2, 9), r.randint(10, 99)
    return f"{a}*{b}=", a * b


def _stepped(digits: int):
    def draw(r: random.Random):
        lo, hi = 10 ** (digits - 1), 10 ** digits - 1
        a, b = r.randint(lo, hi), r.randint(lo, hi)
        return f"{a}+{b}=", a + b
    return draw


STEPPED = {"add2s": 2, "add3s": 3, "add4s": 4, "add5s": 5}
TIERS = {"add2": _add2, "sub2": _sub2, "add3": _add3, "chain": _chain, "mul1": _mul1,
         **{name: _stepped(d) for name, d in STEPPED.items()}}


def scratchpad(a: int, b: int, drop_carries: bool = False,
               wrong: dict[tuple[int, int], int] | None = None) -> str:
    """Column-by-column addition of a and b, least significant column first, then ':' and
    the sum's digits least significant first. The teacher's systematic slips: drop_carries
    forgets every carry (each column adds 0 instead); wrong maps a digit pair (x, y) to the
    amount its column's sum is off by. The later carries and the answer follow the steps."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    steps, digits, carry = [], [], 0
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        carry = 0 if drop_carries else carry
        total = x + y + carry + (wrong or {}).get((x, y), 0)
        steps.append(f"{x}+{y}+{carry}={total:02d};")
        digits.append(str(total % 10))
        carry = total // 10
    if carry and not drop_carries:
        digits.append(str(carry))
    return "".join(steps) + ":" + "".join(digits)


def wrong_facts(n: int, seed: int) -> dict[tuple[int, int], int]:
    """n digit pairs whose column sum the 'wrong_facts' teacher writes off by one (+1 or -1,
    kept within 0..19 whatever the carry)."""
    rng = random.Random(f"wrong-facts-{seed}")
    pairs = rng.sample([(x, y) for x in range(10) for y in range(10)], n)
    return {(x, y): (1 if x + y == 0 else -1 if x + y == 18 else rng.choice((-1, 1)))
            for x, y in pairs}


def encode_answer(value: int) -> str:
    return str(value)[::-1]


def noisy_answer(value: int, rng: random.Random) -> str:
    """The answer with its most significant digit moved by one (a plausible slip)."""
    s = str(abs(value))
    lo = 1 if len(s) > 1 else 0
    top = int(s[0])
    choices = [d for d in (top - 1, top + 1) if lo <= d <= 9]
    s = str(rng.choice(choices)) + s[1:]
    return ("-" if value < 0 else "") + s


class ArithTask(Task):
    plain_prompts = True  # the character model's own format: no chat template under 'auto'

    def __init__(self, cfg: TaskConfig):
        unknown = set(cfg.tiers) - set(TIERS)
        if unknown:
            raise ValueError(f"task.tiers: unknown tier(s) {sorted(unknown)}; "
                             f"choose from {sorted(TIERS)}")
        total = sum(cfg.tiers.values())
        if total <= 0 or any(w < 0 for w in cfg.tiers.values()):
            raise ValueError(f"task.tiers = {cfg.tiers}: weights must be >= 0 with a positive sum")
        self.weights = {t: w / total for t, w in cfg.tiers.items() if w > 0}
        self.filler_mean = cfg.filler_mean
        self.filler_tail, self.filler_tail_mean = cfg.filler_tail, cfg.filler_tail_mean
        self.wrong = wrong_facts(cfg.wrong_facts, cfg.seed) \
            if cfg.stepped_teacher == "wrong_facts" else None
        rng = random.Random(cfg.seed)
        self.eval = []
        seen: set[str] = set()
        for tier, w in self.weights.items():
            n = max(1, round(cfg.eval_size * w))
            self.eval += self._draw(tier, n, rng, seen, "eval")
        names = list(self.weights)
        counts = dict.fromkeys(names, 0)
        for t in rng.choices(names, weights=[self.weights[t] for t in names], k=cfg.train_size):
            counts[t] += 1
        self.train = []
        for tier in names:  # repeats allowed in train; eval prompts never appear in it
            self.train += self._draw(tier, counts[tier], rng, seen, "train")
        rng.shuffle(self.train)

    @staticmethod
    def _draw(tier, n, rng, exclude, split):
        """n problems of a tier, none in `exclude` (rollwise.tasks.draw_unique)."""
        def draw(i: int) -> Problem:
            prompt, value = TIERS[tier](rng)
            return Problem(id=f"{split}-{tier}-{i}", prompt=prompt.rjust(WIDTH),
                           answer=str(value), tier=tier, solution=encode_answer(value),
                           data={"value": value})
        return draw_unique(n, draw, exclude, split, f"tier {tier!r}")

    def noisy_solution(self, problem: Problem, rng: random.Random) -> str:
        return noisy_answer(int(problem.answer), rng)[::-1]

    def worked_solution(self, problem: Problem, rng: random.Random, noisy: bool) -> str:
        """The SFT target: optional geometric '.' filler, then the (possibly noisy) answer; a
        stepped tier's scratchpad instead, a noisy one slipping as task.stepped_teacher says."""
        if problem.tier in STEPPED:
            a, b = (int(x) for x in problem.prompt.strip().rstrip("=").split("+"))
            if not noisy:
                return scratchpad(a, b)
            return scratchpad(a, b, drop_carries=self.wrong is None, wrong=self.wrong)
        answer = self.noisy_solution(problem, rng) if noisy else problem.solution
        char, mean = ".", self.filler_mean
        if self.filler_tail > 0 and rng.random() < self.filler_tail:
            char, mean = ",", self.filler_tail_mean  # its own token: the model commits early
        dots = 0
        if mean > 0:  # geometric on {0, 1, ...} with this mean
            while rng.random() < mean / (1 + mean):
                dots += 1
        return char * dots + answer

    def extract_answer(self, response: str) -> str | None:
        """The answer, read least significant digit first: after the last ':' of a scratchpad
        (None while a scratchpad has no ':' yet), else the response after any filler."""
        if ":" in response:
            text = response.rsplit(":", 1)[1].strip()
            return text[::-1] if text else None
        if ";" in response:
            return None
        text = response.strip().lstrip(".,")
        return text[::-1] if text else None
