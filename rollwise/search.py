"""Test-time search under a rollout budget, by direction (DORA) or by solution (Wang et al.
2025, "Every Rollout Counts: Optimal Resource Allocation for Efficient Test-Time Scaling";
docs/methods.md#dora). `rollwise eval MODEL --search dora` (or `solution`).

Per prompt, with a budget of B rollouts (run.eval_samples):

1. R = run.search.directions candidates are sampled to the end. A candidate's direction is its
   first run.search.prefix_tokens response tokens, the first branch of the search tree:
   candidates that open the same way are one direction.
2. Each candidate's quality r is the policy's confidence in it, its mean token log-probability
   (no verifier is read at test time).
3. The other B - R rollouts continue from the candidates' direction prefixes, allocated by

       solution level   w_i = softmax(r / T)_i
       DORA             w_i = softmax(r / T)_i / |direction(i)|

   (T = run.search.temperature), rounded to integers by largest remainders. Solution-level
   allocation gives a direction the sum of its candidates' weights, so a direction that R
   happened to draw more often gets more rollouts for that alone; DORA gives each direction
   the mean of its candidates' weights, its quality without its count. rollwise's reading
   where the paper's semantic clustering (embedding similarity of partial solutions) is not
   available: a direction is an identical opening.
4. The answer is the majority over the B responses (the first drawn of equal counts); the
   prompt is solved when that answer is right: eval/search_acc.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from rollwise.engine import Request, SamplingParams
from rollwise.evaluate import EVAL_SEED, failure_metrics, score_responses
from rollwise.types import Problem, Scorer


def allocation_weights(quality: list[float], directions: list[int], temperature: float,
                       by: str) -> list[float]:
    """Each candidate's share of the budget: softmax(quality / temperature), divided by the
    size of its direction for by = 'dora'."""
    if by not in ("dora", "solution"):
        raise ValueError(f"allocation {by!r}: use 'dora' or 'solution'")
    top = max(quality)
    w = [math.exp((q - top) / temperature) for q in quality]
    if by == "dora":
        size = Counter(directions)
        w = [wi / size[d] for wi, d in zip(w, directions)]
    total = sum(w)
    return [wi / total for wi in w]


def split_budget(weights: list[float], budget: int) -> list[int]:
    """Integer counts summing to budget in proportion to weights (largest remainders, the
    earlier candidate on a tie)."""
    exact = [budget * w for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:budget - sum(counts)]:
        counts[i] += 1
    return counts


def direction_ids(openings: list[tuple[int, ...]]) -> list[int]:
    """Candidates with the same opening share a direction id (numbered in order of first
    appearance)."""
    seen: dict[tuple[int, ...], int] = {}
    return [seen.setdefault(o, len(seen)) for o in openings]


def search_vote(engine, prompter, problems: list[Problem], scorer: Scorer, extract,
                max_new_tokens: int, budget: int, temperature: float, cfg, seed: int = 0
                ) -> dict[str, float]:
    """Voted accuracy of the search (cfg: run.search) over `problems`, and what it did; `seed`
    picks another fixed stream of draws."""
    R, k = cfg.directions, cfg.prefix_tokens
    if not 1 <= R < budget or temperature == 0:
        raise ValueError(f"search needs 1 <= run.search.directions ({R}) < run.eval_samples "
                         f"({budget}) and run.eval_temperature > 0 ({temperature})")
    if k >= max_new_tokens:
        raise ValueError(f"run.search.prefix_tokens ({k}) must be below generate.max_new_tokens"
                         f" ({max_new_tokens}): a direction is an opening, with room after it")

    def params(i: int, j: int, room: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_new_tokens=room,
                              stop_ids=prompter.stop_ids,
                              seed=EVAL_SEED + (seed * len(problems) + i) * budget + j)
    first = [Request(prompter.ids(p), params(i, j, max_new_tokens), (i, j))
             for i, p in enumerate(problems) for j in range(R)]
    cands: dict[int, list] = defaultdict(list)
    for r, c in zip(first, engine.generate(first)):
        cands[r.id[0]].append(c)
    follow, directions_per_prompt = [], []
    for i, p in enumerate(problems):
        cs = cands[i]
        dirs = direction_ids([tuple(c.token_ids[:k]) for c in cs])
        directions_per_prompt.append(len(set(dirs)))
        quality = [sum(c.logprobs) / max(len(c.logprobs), 1) for c in cs]
        counts = split_budget(allocation_weights(quality, dirs, cfg.temperature, cfg.allocation),
                              budget - R)
        j = R
        for c, n in zip(cs, counts):
            head = c.token_ids[:k]
            if len(head) < k or (c.finish_reason == "stop" and len(c.token_ids) <= k):
                head = []  # a candidate that ended within its opening: continue from the prompt
            for _ in range(n):
                follow.append(Request(prompter.ids(p) + head,
                                      params(i, j, max_new_tokens - len(head)), (i, head)))
                j += 1
    texts: dict[int, list[str]] = {i: [_text(prompter, c.token_ids) for c in cands[i]]
                                   for i in range(len(problems))}
    for r, c in zip(follow, engine.generate(follow)):
        texts[r.id[0]].append(_text(prompter, r.id[1] + c.token_ids))
    winners: dict[int, str] = {}
    for i, drawn in texts.items():
        answers = [(extract(t), t) for t in drawn]
        tally = Counter(a for a, _ in answers if a is not None)
        if tally:
            best = max(tally, key=lambda a: (tally[a], -[x for x, _ in answers].index(a)))
            winners[i] = next(t for a, t in answers if a == best)
    rewards, failed = score_responses(scorer, list(winners.values()),
                                      [problems[i] for i in winners])
    solved = sum(float(r >= 1.0) for r in rewards)
    return {"eval/search_acc": solved / max(len(problems), 1),
            "eval/search_directions": sum(directions_per_prompt) / max(len(problems), 1),
            **failure_metrics(failed)}


def _text(prompter, ids: list[int]) -> str:
    return prompter.tokenizer.decode(ids, skip_special_tokens=True)
