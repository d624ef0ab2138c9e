"""rollwise: the rollout side of RL post-training of language models (Generate / Filter /
Control / Replay). Entry points: `python -m rollwise --help`."""

__version__ = "0.1.0"
