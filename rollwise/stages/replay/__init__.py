"""Replay stage: what is kept and reused without a weight update. The rollout replay buffer
(DOTS RR, buffer.py) and the curriculum hook over per-prompt statistics (curriculum.py). The stage's
protocol is `Replay` (buffer.py); `replay.strategy` picks one by name. Paused partial rollouts
are carried by APRIL's in-flight controller (rollwise.stages.control.april) and saved with
checkpoints through its state_dict.
"""

from rollwise.stages.replay.buffer import (
           BufferReplay,
           NoReplay,
           Replay,
           ReplayBuffer,
           build_replay,
           replay_metrics,
           replay_quota,
)
from rollwise.stages.replay.curriculum import Curriculum, PromptStats, build_curriculum

__all__ = ["BufferReplay", "Curriculum", "NoReplay", "PromptStats", "Replay", "ReplayBuffer",
           "build_curriculum", "build_replay", "replay_metrics", "replay_quota"]
