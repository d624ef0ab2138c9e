"""Group filters and length handling (DAPO, Yu et al. 2025, §3.2 and §3.4).

- `dynamic_sampling(groups)`: drop groups whose rewards are all equal (their group-relative
  advantages are zero), returning the kept groups and counts per reason. The loop calls it
  before `Trainer.update`.
- `overlong_keep(samples)`: overlong filtering, DAPO §3.4: a response cut at max_new_tokens
  (Status.TRUNCATED) leaves the loss, instead of being punished for an answer it never wrote.
- `soft_overlong_penalty(length, ...)`: DAPO's soft overlong punishment, a reward that falls
  linearly from 0 to -1 over the last `buffer` tokens of the length budget.

Every decision carries its reason, and the reasons are counted in the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollwise.types import Group, Sample, Status


@dataclass(frozen=True)
class Decision:
    keep: bool
    reason: str  # why a group was dropped ("" when kept)


def soft_overlong_penalty(length: int, max_length: int, buffer: int,
                          factor: float = 1.0) -> float:
    """DAPO's soft overlong punishment R_length(y) (Yu et al. 2025, §3.4), scaled by `factor`:
         0                                   if |y| <= L_max - L_cache
         ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        -1                                   if |y| > L_max
    with L_max = max_length and L_cache = buffer. buffer 0 disables it."""
    if buffer <= 0:
        return 0.0
    if buffer > max_length:
        raise ValueError(f"train.overlong_buffer = {buffer} exceeds train.overlong_max_length "
                         f"= {max_length}; use a buffer below the length budget")
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length <= max_length:
        return factor * (start - length) / buffer
    return -factor


def shaped_reward(sample: Sample, cfg=None) -> float:
    """The scalar reward the trainer uses: Sample.reward plus the soft overlong penalty when
    cfg (a TrainConfig) turns it on."""
    if cfg is None or cfg.overlong_buffer <= 0:
        return float(sample.reward)
    return float(sample.reward) + soft_overlong_penalty(
        sample.num_tokens, cfg.overlong_max_length, cfg.overlong_buffer,
        cfg.overlong_penalty_factor)


def overlong_keep(samples: list[Sample]) -> list[bool]:
    """DAPO overlong filtering: False for samples cut at the length budget (TRUNCATED)."""
    return [s.status != Status.TRUNCATED for s in samples]


def judge_group(group: Group, cfg=None) -> Decision:
    """DAPO dynamic sampling for one group: keep it only if its rewards differ."""
    if len(group.samples) < 2:
        return Decision(False, "single_sample")
    rewards = [shaped_reward(s, cfg) for s in group.samples]
    if max(rewards) == min(rewards):
        return Decision(False, "equal_reward")
    return Decision(True, "")


def dynamic_sampling(groups: list[Group], cfg=None) -> tuple[list[Group], dict[str, float]]:
    """Keep the groups with a learning signal; count the rest by reason.

    cfg: the TrainConfig, so the rewards compared include its soft overlong penalty, exactly
    as the trainer will see them (None compares Sample.reward). Metrics:
    filter/groups_in, filter/groups_kept, filter/dropped_samples, filter/dropped_tokens and
    filter/dropped/<reason> (groups)."""
    kept: list[Group] = []
    metrics = {"filter/groups_in": float(len(groups)), "filter/groups_kept": 0.0,
               "filter/dropped_samples": 0.0, "filter/dropped_tokens": 0.0,
               "filter/dropped/equal_reward": 0.0}
    for g in groups:
        d = judge_group(g, cfg)
        if d.keep:
            kept.append(g)
            continue
        key = f"filter/dropped/{d.reason}"
        metrics[key] = metrics.get(key, 0.0) + 1
        metrics["filter/dropped_samples"] += len(g.samples)
        metrics["filter/dropped_tokens"] += sum(s.num_tokens for s in g.samples)
    metrics["filter/groups_kept"] = float(len(kept))
    return kept, metrics
