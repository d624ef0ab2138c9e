"""Held-out evaluation: pass@1 per tier and overall, greedy or averaged over samples."""

from __future__ import annotations

from collections import Counter, defaultdict

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
    done = engine.generate(requests)
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in done]
    rewards, failed = score_responses(scorer, texts, [problems[r.id] for r in requests])
    per_prompt: dict[int, list[float]] = defaultdict(list)
    for r, reward in zip(requests, rewards):
        per_prompt[r.id].append(float(reward >= 1.0))  # a failure counts as wrong
    by_tier: dict[str, list[float]] = defaultdict(list)
    for i, wins in sorted(per_prompt.items()):
        by_tier[problems[i].tier].append(sum(wins) / len(wins))
    allv = [v for vs in by_tier.values() for v in vs]
    out = {"eval/pass1": sum(allv) / max(len(allv), 1), **failure_metrics(failed)}
    if len(by_tier) > 1:
        out.update({f"eval/pass1/{t}": sum(v) / len(v) for t, v in sorted(by_tier.items())})
    return out


def score_responses(scorer: Scorer, texts: list[str], problems: list[Problem]
                    ) -> tuple[list[float], Counter]:
    """Each response's reward (0 where scoring failed) and the failures by cause: a held-out
    scorer scores them all at once (its workers in parallel, its deadline over the whole);
    any other scorer one at a time, an exception counting as an 'error'."""
    from rollwise.stages.filter import HeldOutScorer  # the filter stage imports this module
    if isinstance(scorer, HeldOutScorer):
        scored = scorer.score_all(texts, problems, _progress)
        return [r for r, _, _ in scored], Counter(c for _, _, c in scored if c)
    rewards, failed = [], Counter()
    for text, p in zip(texts, problems):
        try:
            rewards.append(float(scorer(text, p)[0]))
        except Exception:  # a scorer failure counts as wrong, never stops the eval
            rewards.append(0.0)
            failed["error"] += 1
    return rewards, failed


def _progress(done: int, total: int) -> None:
    print(f"  ... scored {done} of {total} held-out answers", flush=True)


def failure_metrics(failed: Counter) -> dict[str, float]:
    """eval/failed and eval/failed/<cause>: answers that could not be scored (counted as
    wrong in pass@1)."""
    return {"eval/failed": float(sum(failed.values())),
            **{f"eval/failed/{k}": float(v) for k, v in sorted(failed.items())}}


def scoring_bounded(scorer, deadline_s: float | None, play, log=print) -> dict[str, float]:
    """play() -> held-out metrics, the held-out scorer's scoring (a HeldOutScorer) bounded by
    deadline_s as a whole, and its failures reported: eval/failed in the metrics (from the
    scorer's count where the strategy's evaluation did not say them) and a line."""
    before = Counter(scorer.failures)
    scorer.start(deadline_s)
    try:
        out = play()
    finally:
        scorer.start(None)
    if "eval/failed" not in out:
        out.update(failure_metrics(scorer.failures - before))
    failed = {k.rsplit("/", 1)[1]: int(v) for k, v in out.items()
              if k.startswith("eval/failed/") and v}
    if failed:
        log(f"evaluation: {sum(failed.values())} held-out answers could not be scored "
            f"({', '.join(f'{k} {v}' for k, v in failed.items())}); counted as wrong")
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
    winners: dict[int, str] = {}  # the prompts with a voted answer: its first draw's text
    for i in range(len(problems)):
        texts = [prompter.tokenizer.decode(ids, skip_special_tokens=True) for _, ids in draws[i]]
        weights = weigh(draws[i]) if weigh is not None else [1.0] * len(texts)
        totals: dict[str, float] = defaultdict(float)
        first: dict[str, str] = {}
        for text, w in zip(texts, weights):
            answer = extract(text)
            if answer is not None:
                totals[answer] += float(w)
                first.setdefault(answer, text)
        if totals:
            winners[i] = first[max(totals, key=totals.get)]  # the first of equal totals
    rewards, failed = score_responses(scorer, list(winners.values()),
                                      [problems[i] for i in winners])
    solved = sum(float(r >= 1.0) for r in rewards)
    return {"eval/vote_acc": solved / max(len(problems), 1), **failure_metrics(failed)}
