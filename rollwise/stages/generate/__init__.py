"""Generate stage: which trajectories are proposed, and their shape.

A `Generator` turns the prompts Control selected (each Problem's `prompt_ids` made, and
`group_size` set when Control sizes groups per prompt) into groups of samples, through the rollout
driver (rollout.py), which feeds engine events into samples and applies the in-flight
controller's decisions. `generate.strategy` picks one by name (rollwise.registry): group
(i.i.d. samples, group.py), latr and echo (tree rollouts, latr.py and echo.py), or
'package.module:factory' called as factory(cfg, tokenizer).
"""

from __future__ import annotations

from rollwise import registry
from rollwise.config import ConfigError
from rollwise.stages.control.inflight import RunToEnd, build_inflight
from rollwise.stages.generate.base import Generator
from rollwise.stages.generate.group import new_sample
from rollwise.stages.generate.rollout import Rollout
from rollwise.types import Group


def build_generator(cfg, tokenizer) -> Generator:
    factory = registry.resolve("generator", cfg.generate.strategy, "generate.strategy")
    return registry.conform(factory(cfg, tokenizer), Generator, "generate.strategy")


def check_generator(generator: Generator, task, cfg) -> None:
    """Before any work: a generator whose samples must run to their end gets no in-flight
    controller that pauses them; a task whose samples must be episodes or packs gets a
    generator that produces them (the message lists the registered ones that do)."""
    if generator.runs_to_end and not isinstance(build_inflight(cfg), RunToEnd):
        raise ConfigError(f"generate.strategy={cfg.generate.strategy} runs every sample to its "
                         f"end; control.inflight={cfg.control.inflight} would pause or carry "
                         f"them: set control.inflight=none")
    if task.played_as in ("responses", generator.produces):
        return
    fits = [n for n in registry.names("generator")
            if getattr(registry.resolve("generator", n), "produces", None) == task.played_as]
    if fits:
        others = f" (or {', '.join(fits[1:])})" if len(fits) > 1 else ""
        fix = f"set generate.strategy={fits[0]}{others} and what it needs (generate.env)"
    else:
        fix = "register a generator that produces them"
    raise ConfigError(f"task.name={cfg.task.name} is played as {task.played_as}, which "
                     f"generate.strategy={cfg.generate.strategy} does not produce: {fix}")


def generate_round(engine, generator: Generator, control, params, n: int, step: int,
                   ledger, prompter, gate=None, keep_kv: bool = False) -> list:
    """One round of `n` groups: the in-flight controller's carried groups resume first, then
    new prompts from Control, their ids made by `prompter` (rollwise.tasks.prompts) before the
    generator sees them; returns the groups the controller releases for scoring. keep_kv:
    paused samples keep their K/V in the engine for the next round (Rollout)."""
    carried, fresh = control.inflight.begin(n, step)
    rollout = Rollout(engine, control.inflight, ledger, params, gate, keep_kv)
    for g in carried:
        rollout.add(g)
    problems = prompter.render(control.select(fresh, step, ledger))
    problems = control.sized(problems, step, ledger)  # per-prompt group sizes
    saved = engine.prefix_tokens_saved
    generator.generate(rollout, problems, step)
    rollout.run()  # whatever the generator left running (a no-op when it ran to the end)
    if engine.prefix_tokens_saved > saved:  # K/V copied: tree forks, shared prefixes
        ledger.tokens_to("prefix_saved", engine.prefix_tokens_saved - saved)
    groups = control.inflight.end(rollout, n)
    unfinished = [s.uid for g in groups for s in g.samples if not s.finished]
    if unfinished:  # a plugin's bug: a paused sample must never be scored or trained on
        raise RuntimeError(f"the in-flight controller {type(control.inflight).__name__} "
                           f"released {len(unfinished)} unfinished sample(s) (e.g. "
                           f"{unfinished[0]}) for scoring; keep paused samples until they finish")
    return groups


def run_to_end(engine, groups: list, params, ledger, gate=None) -> None:
    """Generate every unfinished sample of the groups to its end, with no in-flight control
    (sGPO's profiling pass, DARS's extra samples)."""
    rollout = Rollout(engine, RunToEnd(), ledger, params, gate)
    for g in groups:
        rollout.add(g)
    rollout.run()


def extend_groups(engine, groups: list, counts: list[int], params, ledger, gate=None
                  ) -> list:
    """`counts[i]` more i.i.d. samples for groups[i] (DARS's second stage), run to their end;
    returns, per group that grew, a Group of its new samples only (for scoring) after
    appending them to the group itself."""
    added = []
    for g, k in zip(groups, counts):
        if k > 0:
            step = g.samples[0].step if g.samples else -1
            fresh = [new_sample(g.problem, g.samples[0].prompt_ids, step) for _ in range(k)]
            for s in fresh:
                s.group_id = g.samples[0].group_id
            added.append(Group(g.prompt_id, fresh, g.problem))
    run_to_end(engine, added, params, ledger, gate)
    for g, part in zip([g for g, k in zip(groups, counts) if k > 0], added):
        g.samples += part.samples
    return added


__all__ = ["Generator", "Rollout", "build_generator", "extend_groups", "generate_round",
           "run_to_end"]
