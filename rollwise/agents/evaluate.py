"""Held-out evaluation of agent episodes: each eval problem is played as the training loop plays
it (rollwise.agents.episode, the same environment and limits), greedily or at a temperature,
and an episode succeeds when its environment's reward is 1 or more.

Metrics: eval/pass1 (and per tier), and for environments that report tool calls
(info['tool_calls']): eval/tool_use, the share of episodes that called a tool, and
eval/solved_without_tool/<tier>, the share of a tier's episodes solved with no call.
"""

from __future__ import annotations

from collections import defaultdict

from rollwise.agents.episode import EpisodeGenerator
from rollwise.engine import SamplingParams
from rollwise.evaluate import EVAL_SEED
from rollwise.stages.control.inflight import RunToEnd
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger


def evaluate_episodes(engine, prompter, problems, cfg, samples: int = 1,
                      temperature: float = 0.0) -> dict[str, float]:
    """pass@1 of `samples` episodes per problem (greedy at temperature 0)."""
    if samples > 1 and temperature == 0:
        raise ValueError(f"{samples} eval samples at temperature 0 are {samples} copies of "
                         "the greedy episode: set a temperature > 0, or 1 sample")
    generate = cfg.generate.model_copy(update={"group_size": samples})
    # fixed seeds per episode when sampling: the same call gives the same number
    generator = EpisodeGenerator(cfg.model_copy(update={"generate": generate}),
                                 prompter.tokenizer, seed=EVAL_SEED if temperature > 0 else None)
    params = SamplingParams(temperature=temperature, max_new_tokens=cfg.generate.max_new_tokens,
                            stop_ids=prompter.stop_ids)
    rollout = Rollout(engine, RunToEnd(), Ledger(), params)
    generator.generate(rollout, prompter.render(list(problems)), step=0)
    return episode_metrics(rollout.groups)


def episode_metrics(groups) -> dict[str, float]:
    """Per-problem success rates from finished episodes (a split episode counts once, by its
    last piece), overall and per tier, and the tool-use shares."""
    wins, calls = defaultdict(list), defaultdict(list)
    for g in groups:
        for s in g.samples:
            if s.meta.get("split"):
                continue  # an earlier piece of an episode that went on in a new sample
            ok = "env_error" not in s.meta and s.meta.get("env_reward", 0.0) >= 1.0
            wins[g.problem.tier].append(ok)
            if "env_tool_calls" in s.meta:
                calls[g.problem.tier].append((s.meta["env_tool_calls"] > 0, ok))
    every = [w for ws in wins.values() for w in ws]
    out = {"eval/pass1": sum(every) / max(len(every), 1)}
    if len(wins) > 1:
        out.update({f"eval/pass1/{t}": sum(w) / len(w) for t, w in sorted(wins.items())})
    if calls:
        used = [c for cs in calls.values() for c, _ in cs]
        out["eval/tool_use"] = sum(used) / len(used)
        out.update({f"eval/solved_without_tool/{t}": sum(ok and not c for c, ok in cs) / len(cs)
                    for t, cs in sorted(calls.items())})
    return out
