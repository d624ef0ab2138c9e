"""Held-out evaluation: greedy pass@1 per tier and overall."""

from __future__ import annotations

from collections import defaultdict

from rollwise.engine import Engine, Request, SamplingParams
from rollwise.stages.filter import Scorer
from rollwise.tasks import Problem


def evaluate(engine: Engine, tokenizer, problems: list[Problem], scorer: Scorer,
             max_new_tokens: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                            stop_ids=(tokenizer.eos_token_id,))
    requests = [Request(tokenizer(p.prompt)["input_ids"], params, i)
                for i, p in enumerate(problems)]
    by_tier: dict[str, list[float]] = defaultdict(list)
    for p, c in zip(problems, engine.generate(requests)):
        text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        try:
            reward, _ = scorer(text, p)
        except Exception:  # a scorer failure counts as wrong, never stops the eval
            reward = 0.0
        by_tier[p.tier].append(float(reward >= 1.0))
    allv = [v for vs in by_tier.values() for v in vs]
    out = {"eval/pass1": sum(allv) / max(len(allv), 1)}
    if len(by_tier) > 1:
        out.update({f"eval/pass1/{t}": sum(v) / len(v) for t, v in sorted(by_tier.items())})
    return out
