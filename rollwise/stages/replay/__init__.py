"""Replay stage: what is kept and reused without a weight update. The rollout replay buffer
(DOTS RR, buffer.py) and the curriculum hook over per-prompt statistics (curriculum.py). Paused
partial rollouts are carried by the APRIL generator (rollwise.stages.generate.partial_april) and
saved with checkpoints through its state_dict.
"""

from rollwise.stages.replay.buffer import ReplayBuffer, replay_metrics, replay_quota
from rollwise.stages.replay.curriculum import Curriculum, PromptStats, build_curriculum

__all__ = ["Curriculum", "PromptStats", "ReplayBuffer", "build_curriculum", "replay_metrics",
           "replay_quota"]
