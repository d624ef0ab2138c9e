"""Rollout replay (DOTS + RR, Sun et al. 2025, "Improving Data Efficiency for LLM Reinforcement
Fine-tuning Through Difficulty-targeted Online Data Selection and Rollout Replay";
docs/methods.md#replay; ASTRAL-Group/data-efficient-llm-rl ray_trainer_teacher_replay.py).

Each step generates fresh groups for only part of the batch and fills the rest with groups
drawn uniformly from a buffer of recent ones, so a step costs fewer generated tokens:

    n_replay = min(round(share * prompts_per_step), groups eligible now)
    fresh    = prompts_per_step - n_replay prompts, generated and scored as usual

The buffer holds the latest group of each prompt (a newer group of the same prompt replaces
it and counts as new), at most `capacity` groups, the oldest evicted first (FIFO). Only groups
with a learning signal (rewards that differ) enter. A group is never replayed once its oldest
token is more than `max_staleness` policy versions behind the trainer: it is evicted instead.
Replayed tokens keep the behaviour log-probabilities and policy versions they were sampled
with, so the trainer's importance correction (train.correction.*, the decoupled clip of
rollwise.training.correction) sees exactly how stale each token is.
"""

from __future__ import annotations

import abc
import random
from collections import OrderedDict

from rollwise import registry
from rollwise.types import Group


def staleness(group: Group, version: int) -> int:
    """Policy versions between `version` and the group's oldest token (0: on-policy)."""
    oldest = min((v for s in group.samples for v in s.versions), default=version)
    return max(version - oldest, 0)


class ReplayBuffer:
    def __init__(self, capacity: int = 512, max_staleness: int | None = 8):
        if capacity < 1:
            raise ValueError(f"replay.capacity = {capacity}: must be >= 1")
        self.capacity, self.max_staleness = capacity, max_staleness
        self.groups: OrderedDict[str, Group] = OrderedDict()  # prompt id -> latest, oldest first
        self.evicted = {"capacity": 0, "stale": 0, "replaced": 0}

    def __len__(self) -> int:
        return len(self.groups)

    def put(self, groups: list[Group]) -> None:
        """Add fresh groups (those with mixed rewards); the newest group of a prompt wins."""
        for g in groups:
            if not g.is_mixed:
                continue
            if g.prompt_id in self.groups:
                del self.groups[g.prompt_id]
                self.evicted["replaced"] += 1
            self.groups[g.prompt_id] = g
        while len(self.groups) > self.capacity:
            self.groups.popitem(last=False)
            self.evicted["capacity"] += 1

    def evict_stale(self, version: int) -> None:
        if self.max_staleness is None:
            return
        for pid in [p for p, g in self.groups.items()
                    if staleness(g, version) > self.max_staleness]:
            del self.groups[pid]
            self.evicted["stale"] += 1

    def eligible(self, version: int) -> int:
        self.evict_stale(version)
        return len(self.groups)

    def take(self, n: int, version: int, rng: random.Random) -> list[Group]:
        """Up to n groups drawn uniformly without replacement; they stay in the buffer (DOTS
        replays a group until it is replaced, evicted or too stale)."""
        self.evict_stale(version)
        keys = list(self.groups)
        return [self.groups[k] for k in rng.sample(keys, min(n, len(keys)))]

    def state_dict(self) -> dict:
        return {"groups": [g.to_dict() for g in self.groups.values()],
                "evicted": dict(self.evicted)}

    def load_state_dict(self, state: dict) -> None:
        self.groups = OrderedDict((g.prompt_id, g) for g in map(Group.from_dict,
                                                                 state["groups"]))
        self.evicted = dict(state["evicted"])


class Replay(abc.ABC):
    """The Replay stage: groups reused without generating them again. Stale groups keep their
    behaviour log-probabilities and versions, so the trainer corrects them exactly."""

    @abc.abstractmethod
    def take(self, slots: int, version: int, rng: random.Random) -> list[Group]:
        """Groups for up to `slots - 1` of a batch's prompt slots (one stays fresh)."""

    @abc.abstractmethod
    def put(self, groups: list[Group]) -> None:
        """This step's freshly scored groups, kept or not."""

    def metrics(self, taken: list[Group], slots: int, version: int) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class NoReplay(Replay):
    """replay.enabled = false: every group is generated."""

    def __init__(self, cfg=None):
        pass

    def take(self, slots: int, version: int, rng: random.Random) -> list[Group]:
        return []

    def put(self, groups: list[Group]) -> None:
        pass

    def metrics(self, taken, slots, version) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class BufferReplay(Replay):
    """DOTS rollout replay: replay.share of each batch from a ReplayBuffer (see the module
    docstring); cfg: the run's Config."""

    def __init__(self, cfg):
        self.share = cfg.replay.share
        self.buffer = ReplayBuffer(cfg.replay.capacity, cfg.replay.max_staleness)

    def take(self, slots: int, version: int, rng: random.Random) -> list[Group]:
        n = replay_quota(self.share, slots, self.buffer.eligible(version))
        return self.buffer.take(n, version, rng)

    def put(self, groups: list[Group]) -> None:
        self.buffer.put(groups)

    def metrics(self, taken, slots, version) -> dict[str, float]:
        return replay_metrics(taken, slots, version, self.buffer)

    def state_dict(self) -> dict:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)


def build_replay(cfg) -> Replay:
    """The configured Replay stage (cfg: the run's Config)."""
    name = cfg.replay.strategy if cfg.replay.enabled else "none"
    factory = registry.resolve("replay", name, "replay.strategy")
    return registry.conform(factory(cfg), Replay, "replay.strategy")


def replay_quota(share: float, batch: int, available: int) -> int:
    """Replayed groups in a batch of `batch` prompt slots; at least one slot stays fresh, so
    the buffer keeps being refilled."""
    return max(0, min(round(share * batch), batch - 1, available))


def replay_metrics(replayed: list[Group], batch: int, version: int,
                   buffer: ReplayBuffer) -> dict[str, float]:
    """replay/*: how much of the batch was replayed and how stale its tokens are."""
    ages = [version - v for g in replayed for s in g.samples
            for v, m in zip(s.versions, s.loss_mask) if m]
    return {"replay/groups": float(len(replayed)), "replay/share": len(replayed) / batch,
            "replay/tokens": float(len(ages)),
            "replay/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "replay/staleness_max": float(max(ages, default=0)),
            "replay/buffer_groups": float(len(buffer)),
            **{f"replay/evicted_total/{k}": float(v) for k, v in buffer.evicted.items()}}
