"""Connect-the-Dots rollouts (docs/methods.md#cod; generate.strategy=cod, generate.env=<pack>):
each problem is a pack of K related tasks, played generate.group_size times. One play is a long
rollout that alternates solve-task episodes, conditioned on the current hint, with
update-context episodes that write the next hint from the last task's outcome. Every episode is
a sample of the pack's group, with

    meta['cod_key']    = (pack id, 'solve' or 'hint', index)   # baseline slot
    meta['cod_return'] = its reward-to-go over the rest of the pack
    meta['env_reward'] = its own reward (filter.reward=env)

for train.advantage=cod (rollwise.training.cod). A pack environment (registry kind 'pack',
factory(cfg, problem)) writes the texts and scores them:

    class PackEnvironment(Protocol):
        size: int                                           # tasks in the pack
        def task_prompt(self, i, hint) -> str
        def score_task(self, i, response) -> (reward, feedback text)
        def update_prompt(self, i, hint, response, feedback) -> str
        def hint_reward(self, hint) -> float

Plays go in lockstep: round i solves task i in every play of every pack at once, then writes
every play's next hint, so the engine batches them. `shuffle_hints` (evaluation) solves each
task with the hint a play of another pack wrote: the control for whether hints carry the rule.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from rollwise import registry
from rollwise.engine import SamplingParams
from rollwise.stages.control.inflight import RunToEnd
from rollwise.stages.generate.base import Generator
from rollwise.stages.generate.group import new_sample
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger
from rollwise.tasks.prompts import Prompter
from rollwise.training.cod import reward_to_go
from rollwise.types import Group, Sample


def build_pack_factory(cfg):
    if not cfg.generate.env:
        raise ValueError("generate.strategy=cod needs a pack environment: set generate.env "
                         "(remap, or 'package.module:factory')")
    make = registry.resolve("pack", cfg.generate.env, "generate.env")
    return lambda problem: make(cfg, problem)


@dataclass
class Play:
    """One play of a pack: its hint so far and its episodes' rewards."""
    problem: object
    env: object
    group: Group
    hint: str = ""
    solves: list[Sample] = field(default_factory=list)
    hints: list[Sample] = field(default_factory=list)


class CoDGenerator(Generator):
    produces = "packs"
    runs_to_end = True  # a pack's episodes are played in order: none may be carried out of it

    def __init__(self, cfg, tokenizer, shuffle_hints: random.Random | None = None):
        self.tokenizer = tokenizer
        self.repeats = cfg.generate.group_size
        self.make_env = build_pack_factory(cfg)
        self.prompter = Prompter(cfg.task, tokenizer)  # a chat template when it has one
        self.shuffle = shuffle_hints

    def evaluate(self, engine, prompter, problems, cfg, scorer) -> dict[str, float]:
        """Success by position, and with hints shuffled across packs (evaluate_packs)."""
        return evaluate_packs(engine, problems, cfg, self.tokenizer, prompter.stop_ids)

    def warm_start_examples(self, cfg, task, tokenizer) -> list[tuple]:
        """A task played as packs has a teacher (task.teacher_answer, task.teacher_hint) whose
        plays are the examples; any other task, its worked solutions."""
        if task.played_as == "packs":
            return pack_examples(cfg, task, tokenizer, cfg.sft.noise, cfg.run.seed)
        return super().warm_start_examples(cfg, task, tokenizer)

    def generate(self, rollout, problems, step: int) -> None:
        plays = []
        for p in problems:
            group = Group(p.id, [], p)
            rollout.add(group)  # its samples join it round by round (Rollout.extend)
            env = self.make_env(p)
            plays += [Play(p, env, group) for _ in range(p.group_size or self.repeats)]
        for i in range(max((pl.env.size for pl in plays), default=0)):
            live = [pl for pl in plays if i < pl.env.size]
            hints = self._hints_for(live)
            solves = self._round(rollout, live, step, "solve", i,
                                 [pl.env.task_prompt(i, h) for pl, h in zip(live, hints)])
            for pl, s, h in zip(live, solves, hints):
                reward, feedback = pl.env.score_task(i, self._text(s))
                s.meta.update(env_reward=reward, cod_feedback=feedback, hint=h)
                pl.solves.append(s)
            live = [pl for pl in live if i + 1 < pl.env.size]
            if not live:
                continue
            updates = self._round(rollout, live, step, "hint", i, [
                pl.env.update_prompt(i, pl.hint, self._text(s), s.meta["cod_feedback"])
                for pl, s in zip(live, (pl.solves[-1] for pl in live))])
            for pl, s in zip(live, updates):
                pl.hint = self._text(s)
                s.meta["env_reward"] = pl.env.hint_reward(pl.hint)
                pl.hints.append(s)
        for pl in plays:
            self._credit(pl)

    def _hints_for(self, live: list[Play]) -> list[str]:
        """Each play's own hint, or (shuffle_hints) the hint of a play of another pack."""
        hints = [pl.hint for pl in live]
        if self.shuffle is None:
            return hints
        order = list(range(len(live)))
        self.shuffle.shuffle(order)
        out = []
        for k, pl in enumerate(live):  # the first play in the shuffled order of another pack
            j = next((j for j in order[k:] + order[:k]
                      if live[j].problem.id != pl.problem.id), k)
            out.append(hints[j])
        return out

    def _round(self, rollout, live: list[Play], step: int, kind: str, i: int,
               prompts: list[str]) -> list[Sample]:
        samples = []
        for pl, text in zip(live, prompts):
            s = new_sample(pl.problem, self.prompter.encode(text), step)
            s.meta.update(cod_key=[pl.problem.id, kind, i], cod_kind=kind)
            samples.append((pl.group, s))
        by_group: dict[int, tuple[Group, list[Sample]]] = {}
        for g, s in samples:
            by_group.setdefault(id(g), (g, []))[1].append(s)
        for g, ss in by_group.values():
            rollout.extend(g, ss)
        rollout.run()
        if any(not s.finished for _, s in samples):  # a plugin controller paused one
            raise RuntimeError("an in-flight controller paused a Connect-the-Dots episode; a "
                               "pack's episodes must each finish before the next: run "
                               "generate.strategy=cod without in-flight control")
        return [s for _, s in samples]

    def _text(self, s: Sample) -> str:
        return self.tokenizer.decode(s.response_ids, skip_special_tokens=True).strip()

    @staticmethod
    def _credit(pl: Play) -> None:
        """Rewards-to-go over the pack: a solve earns the mean of the task rewards from it on,
        a hint the mean of its own reward and the later task rewards."""
        tasks = [s.meta["env_reward"] for s in pl.solves]
        solve, hint = reward_to_go(tasks, [s.meta["env_reward"] for s in pl.hints])
        for s, r in zip(pl.solves, solve):
            s.meta["cod_return"] = r
        for s, r in zip(pl.hints, hint):
            s.meta["cod_return"] = r


def pack_examples(cfg, task, tokenizer, noise: float | dict[str, float],
                  seed: int) -> list[tuple[list[int], int]]:
    """The warm start's (token ids, prompt length) pairs: each train pack played once by the
    task's teacher (task.teacher_answer, task.teacher_hint) through the pack environment, so
    the texts are the ones the rollouts show."""
    make_env, prompter = build_pack_factory(cfg), Prompter(cfg.task, tokenizer)
    eos, rng, out = tokenizer.eos_token_id, random.Random(seed), []

    def add(prompt: str, response: str) -> None:
        ids = prompter.encode(prompt)
        out.append((ids + tokenizer.encode(response, add_special_tokens=False) + [eos],
                    len(ids)))
    for p in task.train:
        env, hint = make_env(p), ""
        share = noise.get(p.tier, 0.0) if isinstance(noise, dict) else noise
        for i in range(env.size):
            answer = task.teacher_answer(p, i, hint, rng)
            add(env.task_prompt(i, hint), answer)
            if i + 1 < env.size:
                _, feedback = env.score_task(i, answer)
                new = task.teacher_hint(p, i, hint, rng, noisy=rng.random() < share)
                add(env.update_prompt(i, hint, answer, feedback), new)
                hint = new
    return out


def evaluate_packs(engine, problems, cfg, tokenizer, stop_ids) -> dict[str, float]:
    """Greedy plays of the eval packs, with their own hints and with hints shuffled across
    packs: solve success overall and per position, and the slope of success on position
    (least squares) for both."""
    one = cfg.model_copy(update={"generate": cfg.generate.model_copy(update={"group_size": 1})})
    params = SamplingParams(temperature=0.0, max_new_tokens=cfg.generate.max_new_tokens,
                            stop_ids=stop_ids)
    out = {}
    for name, shuffle in (("position", None), ("shuffled", random.Random(0))):
        rollout = Rollout(engine, RunToEnd(), Ledger(), params)
        CoDGenerator(one, tokenizer, shuffle_hints=shuffle).generate(rollout, problems, 0)
        solves = [(s.meta["cod_key"][2], s.meta["env_reward"]) for g in rollout.groups
                  for s in g.samples if s.meta["cod_kind"] == "solve"]
        out[f"eval/{name}_slope"] = slope(solves)
        if shuffle is None:
            out["eval/pass1"] = sum(r for _, r in solves) / max(len(solves), 1)
            for i in sorted({i for i, _ in solves}):
                rs = [r for j, r in solves if j == i]
                out[f"eval/pass1/pos{i}"] = sum(rs) / len(rs)
        else:
            out["eval/shuffled_pass1"] = sum(r for _, r in solves) / max(len(solves), 1)
    return out


def slope(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of y on x (0 when x does not vary)."""
    xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
    if len(set(xs)) < 2:
        return 0.0
    return statistics.linear_regression(xs, ys).slope
