"""Multi-turn agent episodes as a Generator (generate.strategy=episode, generate.env=NAME).

Each sample of a group is one episode with its own environment. Turns are generated for every
live episode at once (one rollout round per turn, through the shared rollout driver, so
in-flight control and the engine's batching apply). After a turn, the environment reads the
model's text and answers; its observation becomes tokens through the chat template
(rollwise.agents.turns) and is appended with loss mask 0, behaviour log-probability 0 and
version -1 (no policy sampled it), while every model token keeps its own log-probability and
version. The next turn's request is the episode so far; an engine with a prefix cache (the
built-in one with engine.prefix_cache_tokens, vLLM's) reuses the K/V it kept from the turn
before and prefills only the environment's tokens.

The round's ledger counts episodes, turns, ends by reason (env, limit, error), splits, and of
the tokens a turn's request had been through the engine before, those it reused
(decisions/agent/prefill/reused) and those it had to prefill again
(decisions/agent/reprefill/tokens).

Limits: generate.max_turns model turns, generate.max_new_tokens per turn,
generate.max_episode_tokens per episode. An environment that raises ends its episode
(status failed, the reason in meta['env_error']); the run goes on. The episode's reward (the
sum of the environment's rewards) is in meta['env_reward'] for filter.reward=env.

Held-out evaluation plays each eval problem as training plays it (the same environment and
limits), greedily or at a temperature; an episode succeeds when its environment's reward is 1
or more. Metrics: eval/pass1 (and per tier), and for environments that report tool calls
(info['tool_calls']): eval/tool_use, the share of episodes that called a tool, and
eval/solved_without_tool/<tier>, the share of a tier's episodes solved with no call. The warm
start trains on the task's teacher transcripts (rollwise.agents.transcripts).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from rollwise.agents.env import as_message, build_env_factory
from rollwise.agents.transcripts import episode_examples
from rollwise.agents.turns import turns_for
from rollwise.engine import SamplingParams
from rollwise.evaluate import EVAL_SEED
from rollwise.stages.control.inflight import RunToEnd
from rollwise.stages.generate.base import Generator
from rollwise.stages.generate.group import new_sample
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger
from rollwise.types import Group, Sample, Status


@dataclass
class Episode:
    sample: Sample
    env: object
    group: Group
    messages: list[dict]
    turns: int = 0
    done: bool = False
    pieces: list[Sample] = field(default_factory=list)  # earlier samples of a split episode
    offset: int = 0  # tokens of a turn prefix it continues (TRACE), held in its prompt
    cuts: list[tuple[int, int, dict]] = field(default_factory=list)  # after each continued
    # turn: (the sample's tokens, the messages so far, the environment's info so far)


class EpisodeGenerator(Generator):
    produces = "episodes"

    def __init__(self, cfg, tokenizer, seed: int | None = None):
        g = cfg.generate
        if not g.env:
            raise ValueError("generate.strategy=episode needs an environment: set "
                             "generate.env (e.g. tools, or 'package.module:factory')")
        self.tokenizer, self.group_size = tokenizer, g.group_size
        self.max_turns, self.turn_tokens = g.max_turns, g.max_new_tokens
        self.episode_tokens = g.max_episode_tokens or g.max_new_tokens * g.max_turns
        self.make_env = build_env_factory(cfg)
        self.turns = turns_for(tokenizer)
        self.live: dict[str, Episode] = {}  # sample uid -> its unfinished episode
        self.ledger = None  # the current round's (Rollout.ledger): turns, ends, splits
        self.seed, self.started = seed, 0  # seed: each episode samples from its own stream

    def generate(self, rollout, problems, step: int) -> None:
        self.begin(rollout, problems, step)
        self.play(rollout)

    def evaluate(self, engine, prompter, problems, cfg, scorer) -> dict[str, float]:
        return evaluate_episodes(engine, prompter, problems, cfg, cfg.run.eval_samples,
                                 cfg.run.eval_temperature)

    def warm_start_examples(self, cfg, task, tokenizer) -> list[tuple]:
        """A task played as episodes gives the teacher's actions (task.worked_actions), played
        through the environment; any other task, its worked solutions."""
        if task.played_as == "episodes":
            return episode_examples(cfg, task, tokenizer, cfg.sft.noise, cfg.run.seed)
        return super().warm_start_examples(cfg, task, tokenizer)

    def begin(self, rollout, problems, step: int, n: int | None = None) -> list[Episode]:
        """Start n episodes per problem (default: its group size), one group each."""
        self.ledger = rollout.ledger
        started = []
        for p in problems:
            group = Group(p.id, [], p)
            for _ in range(n or p.group_size or self.group_size):
                e = self._start(p, group, step)
                if not e.done:  # an environment that failed to start ended its episode
                    self.live[e.sample.uid] = e
                started.append(e)
            rollout.add(group)
            self.ledger.decide("agent", "episode", "start", len(group.samples))
        return started

    def play(self, rollout) -> None:
        """Turn after turn, until no live episode of the round has a turn left."""
        while True:
            rollout.run()
            again: dict[int, tuple[Group, list[Sample]]] = {}
            # every group of the round: an in-flight controller may have carried an episode's
            # paused sample into it from an earlier round
            for group in list(rollout.groups):
                for s in list(group.samples):
                    e = self.live.get(s.uid)
                    if e is None or e.done or not s.finished:
                        continue  # not a live episode's current sample, or paused mid-turn
                    self._after_turn(e)
                    if e.done:
                        self.live.pop(s.uid, None)
                        continue
                    if e.sample is not s:  # split: the episode goes on in a new sample
                        self.live[e.sample.uid] = self.live.pop(s.uid)
                    again.setdefault(id(group), (group, []))[1].append(e.sample)
            if not again:
                return
            for group, samples in again.values():
                # a round an everyone-decision ended pauses these at once (carried onward)
                rollout.requeue(group, samples)

    def _start(self, problem, group: Group, step: int, join: bool = True) -> Episode:
        """A new episode; `join`: its sample joins the group now (else the caller adds it)."""
        s = new_sample(problem, problem.prompt_ids, step)
        if join:
            group.samples.append(s)
        messages = [as_message(problem.prompt)] if isinstance(problem.prompt, str) else \
            list(problem.prompt)
        e = Episode(s, None, group, messages)
        try:
            e.env = self.make_env(problem)
            first = e.env.reset(problem)
            if first is not None:  # the environment opens the episode itself
                e.messages = [as_message(first)]
                s.prompt_ids = self.turns.prompt_ids(e.messages)
        except Exception as ex:
            self._fail(e, "reset", ex)
        s.meta.update(turn_start=0, turn_budget=self.turn_tokens, env_reward=0.0)
        if self.seed is not None:  # read by Rollout._submit
            s.meta["seed"] = self.seed + 1_000 * self.started
        self.started += 1
        return e

    def _after_turn(self, e: Episode) -> None:
        s = e.sample
        turn_ids = s.response_ids[s.meta["turn_start"]:]
        e.turns += 1
        seen, cached = s.meta.pop("turn_seen", 0), s.meta.pop("kv_cached", 0)
        if seen:  # the request of this turn held `seen` tokens the engine had run before
            self.ledger.decide("agent", "prefill", "reused", min(seen, cached))
            self.ledger.decide("agent", "reprefill", "tokens", max(0, seen - cached))
        self.ledger.decide("agent", "turn", "model")
        action = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        e.messages.append({"role": "assistant", "content": action})
        try:
            observation, reward, done, info = e.env.step(action)
            s.meta["env_reward"] += float(reward)
            s.meta.update({f"env_{k}": v for k, v in (info or {}).items()})
        except Exception as ex:
            self._fail(e, "step", ex)
            return
        used = s.num_tokens + e.offset
        if done or observation is None or s.status != Status.COMPLETED or \
                e.turns >= self.max_turns or used >= self.episode_tokens:
            self._finish(e, "env" if done or observation is None else "limit")
            return
        try:
            obs = as_message(observation)
        except ValueError as ex:
            self._fail(e, "step", ex)
            return
        ids = self.turns.observation_ids(e.messages, turn_ids, obs)
        e.messages.append(obs)
        if ids is None:  # the template cannot extend this turn exactly: a new sample
            self._split(e)
            return
        if used + len(ids) >= self.episode_tokens:  # no room left for a model turn
            self._finish(e, "limit")
            return
        # the last sampled token was never fed: the engine has run the episode up to it
        s.meta["turn_seen"] = len(s.prompt_ids) + s.num_tokens - 1
        s.extend(ids, [0.0] * len(ids), [-1] * len(ids), [0.0] * len(ids), trainable=False)
        e.cuts.append((s.num_tokens, len(e.messages), dict(info or {})))
        s.meta["turn_start"] = s.num_tokens
        s.meta["turn_budget"] = min(self.turn_tokens, self.episode_tokens - used - len(ids))
        s.status = Status.RUNNING

    def _split(self, e: Episode) -> None:
        """Continue the episode in a new sample whose prompt is the conversation so far,
        rendered by the template; the finished piece gets the episode's reward too."""
        old = e.sample
        new = old.fork()
        new.prompt_ids = self.turns.prompt_ids(e.messages)
        for name in ("response_ids", "logprobs", "versions", "loss_mask", "entropies"):
            setattr(new, name, [])
        new.branch_point, new.chosen = 0, []
        new.meta.update(turn_start=0, split_from=old.uid,
                        turn_budget=min(self.turn_tokens, self.episode_tokens))
        old.meta["split"] = True
        e.pieces.append(old)
        e.sample = new
        e.group.samples.append(new)  # queued with the others' next turns
        new.status = Status.RUNNING
        self.ledger.decide("agent", "split", "template")

    def _finish(self, e: Episode, why: str) -> None:
        e.done = True
        self.ledger.decide("agent", "end", why)
        e.sample.meta["episode_end"] = why
        e.sample.meta["turns"] = e.turns
        for piece in e.pieces:  # every piece of a split episode is credited with its reward
            piece.meta["env_reward"] = e.sample.meta["env_reward"]

    def _fail(self, e: Episode, where: str, ex: Exception) -> None:
        e.sample.meta["env_error"] = f"{where}: {type(ex).__name__}: {ex}"
        e.sample.status = Status.FAILED
        self._finish(e, "error")


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
