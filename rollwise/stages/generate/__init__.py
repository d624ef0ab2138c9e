"""Generate stage: which trajectories are proposed, and their shape.

A `Generator` turns the prompts Control selected (each Problem's `prompt_ids` made, and
`group_size` set when Control sizes groups per prompt) into groups of samples, through the rollout
driver (rollout.py), which feeds engine events into samples and applies the in-flight
controller's decisions. `generate.strategy` picks one by name (rollwise.registry): group
(i.i.d. samples, group.py), latr and echo (tree rollouts, latr.py and echo.py), or
'package.module:factory' called as factory(cfg, tokenizer).
"""

from __future__ import annotations

from typing import Protocol

from rollwise.stages.generate.rollout import Rollout
from rollwise.tasks import Problem


class Generator(Protocol):
    def generate(self, rollout: Rollout, problems: list[Problem], step: int) -> None:
        """Add a group per problem to the rollout (rollout.add) and run it (rollout.run,
        optionally with an event hook of its own, e.g. a tree's branching)."""


def build_generator(cfg, tokenizer) -> Generator:
    from rollwise import registry
    return registry.resolve("generator", cfg.generate.strategy, "generate.strategy")(
        cfg, tokenizer)


def generate_round(engine, generator: Generator, control, params, n: int, step: int,
                   ledger, prompter) -> list:
    """One round of `n` groups: the in-flight controller's carried groups resume first, then
    new prompts from Control, their ids made by `prompter` (rollwise.tasks.prompts) before the
    generator sees them; returns the groups the controller releases for scoring."""
    carried, fresh = control.inflight.begin(n, step)
    rollout = Rollout(engine, control.inflight, ledger, params)
    for g in carried:
        rollout.add(g)
    problems = prompter.render(control.select(fresh, step, ledger))
    if hasattr(control, "sized"):  # per-prompt group sizes (a bare test double may lack it)
        problems = control.sized(problems, step, ledger)
    saved = getattr(engine, "prefix_tokens_saved", 0)
    generator.generate(rollout, problems, step)
    rollout.run()  # whatever the generator left running (a no-op when it ran to the end)
    if getattr(engine, "prefix_tokens_saved", 0) > saved:  # tree forks that copied K/V
        ledger.tokens_to("prefix_saved", engine.prefix_tokens_saved - saved)
    groups = control.inflight.end(rollout, n)
    unfinished = [s.uid for g in groups for s in g.samples if not s.finished]
    if unfinished:  # a plugin's bug: a paused sample must never be scored or trained on
        raise RuntimeError(f"the in-flight controller {type(control.inflight).__name__} "
                           f"released {len(unfinished)} unfinished sample(s) (e.g. "
                           f"{unfinished[0]}) for scoring; keep paused samples until they finish")
    return groups


def run_to_end(engine, groups: list, params, ledger) -> None:
    """Generate every unfinished sample of the groups to its end, with no in-flight control
    (sGPO's profiling pass, DARS's extra samples)."""
    from rollwise.stages.control.inflight import RunToEnd
    rollout = Rollout(engine, RunToEnd(), ledger, params)
    for g in groups:
        rollout.add(g)
    rollout.run()


def extend_groups(engine, groups: list, counts: list[int], params, ledger) -> list:
    """`counts[i]` more i.i.d. samples for groups[i] (DARS's second stage), run to their end;
    returns, per group that grew, a Group of its new samples only (for scoring) after
    appending them to the group itself."""
    from rollwise.stages.generate.group import new_sample
    from rollwise.types import Group
    added = []
    for g, k in zip(groups, counts):
        if k > 0:
            step = g.samples[0].step if g.samples else -1
            fresh = [new_sample(g.problem, g.samples[0].prompt_ids, step) for _ in range(k)]
            for s in fresh:
                s.group_id = g.samples[0].group_id
            added.append(Group(g.prompt_id, fresh, g.problem))
    run_to_end(engine, added, params, ledger)
    for g, part in zip([g for g, k in zip(groups, counts) if k > 0], added):
        g.samples += part.samples
    return added


__all__ = ["Generator", "Rollout", "build_generator", "extend_groups", "generate_round",
           "run_to_end"]
