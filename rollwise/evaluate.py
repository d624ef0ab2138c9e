"""Held-out evaluation: pass@1 per tier and overall, greedy or averaged over samples."""

from __future__ import annotations

from collections import defaultdict

from rollwise.engine import Engine, Request, SamplingParams
from rollwise.tasks.prompts import Prompter
from rollwise.types import Problem, Scorer

EVAL_SEED = 1_000_003  # sampled evals draw from fixed seeds: the same call gives the same number


def evaluate(engine: Engine, prompter: Prompter, problems: list[Problem], scorer: Scorer,
             max_new_tokens: int, samples: int = 1, temperature: float = 0.0
             ) -> dict[str, float]:
    """pass@1: greedy (temperature 0), or the mean success of `samples` draws per prompt at
    `temperature`, the unbiased pass@1 estimate of the sampled policy. Prompts and stop tokens
    are the prompter's, as in training."""
    if samples > 1 and temperature == 0:
        raise ValueError(f"{samples} eval samples at temperature 0 are {samples} copies of "
                         "the greedy answer: set a temperature > 0, or 1 sample")
    stop, tokenizer = prompter.stop_ids, prompter.tokenizer

    def params(i: int, j: int) -> SamplingParams:
        seed = None if temperature == 0 else EVAL_SEED + i * samples + j
        return SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens,
                              stop_ids=stop, seed=seed)
    requests = [Request(prompter.ids(p), params(i, j), i)
                for i, p in enumerate(problems) for j in range(samples)]
    per_prompt: dict[int, list[float]] = defaultdict(list)
    for r, c in zip(requests, engine.generate(requests)):
        p = problems[r.id]
        text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        try:
            reward, _ = scorer(text, p)
        except Exception:  # a scorer failure counts as wrong, never stops the eval
            reward = 0.0
        per_prompt[r.id].append(float(reward >= 1.0))
    by_tier: dict[str, list[float]] = defaultdict(list)
    for i, wins in sorted(per_prompt.items()):
        by_tier[problems[i].tier].append(sum(wins) / len(wins))
    allv = [v for vs in by_tier.values() for v in vs]
    out = {"eval/pass1": sum(allv) / max(len(allv), 1)}
    if len(by_tier) > 1:
        out.update({f"eval/pass1/{t}": sum(v) / len(v) for t, v in sorted(by_tier.items())})
    return out


def vote(engine: Engine, prompter: Prompter, problems: list[Problem], scorer: Scorer,
         extract, max_new_tokens: int, samples: int, temperature: float,
         weigh=None) -> dict[str, float]:
    """Voted accuracy: `samples` draws per prompt at `temperature`; each draw's answer
    (extract(text)) gets a vote: weigh([(prompt_ids, response_ids), ...]) gives the draws'
    weights (None: 1 each, majority voting; ARRoL's quality head: q-weighted voting). The
    prompt counts as solved when the answer with the largest total is right (a tie: the one
    drawn first). Draws with no answer do not vote."""
    if samples < 2 or temperature == 0:
        raise ValueError("voting needs run.eval_samples >= 2 draws at run.eval_temperature > 0")
    requests = [Request(prompter.ids(p), SamplingParams(
        temperature=temperature, max_new_tokens=max_new_tokens, stop_ids=prompter.stop_ids,
        seed=EVAL_SEED + i * samples + j), i) for i, p in enumerate(problems)
        for j in range(samples)]
    draws: dict[int, list] = defaultdict(list)
    for r, c in zip(requests, engine.generate(requests)):
        draws[r.id].append((r.prompt_ids, c.token_ids))
    solved = []
    for i, p in enumerate(problems):
        texts = [prompter.tokenizer.decode(ids, skip_special_tokens=True) for _, ids in draws[i]]
        weights = weigh(draws[i]) if weigh is not None else [1.0] * len(texts)
        totals: dict[str, float] = defaultdict(float)
        first: dict[str, str] = {}
        for text, w in zip(texts, weights):
            answer = extract(text)
            if answer is not None:
                totals[answer] += float(w)
                first.setdefault(answer, text)
        if not totals:
            solved.append(0.0)
            continue
        best = max(totals, key=totals.get)  # the first of equal totals, in draw order
        try:
            solved.append(float(scorer(first[best], p)[0] >= 1.0))
        except Exception:  # a scorer failure counts as wrong
            solved.append(0.0)
    return {"eval/vote_acc": sum(solved) / max(len(solved), 1)}
