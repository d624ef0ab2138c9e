"""rollwise: the rollout side of RL post-training of language models (Generate / Filter /
Control / Replay). Entry points: `python -m rollwise --help`, and in Python:

    import rollwise
    summary = rollwise.train(dataset=rows, reward=fn, train={"steps": 50})
    cfg = rollwise.load_config("smollm2", ["train.lr=1e-4"])  # a preset's name, or a YAML path
"""

from rollwise.numerics import choose_strict_mkl

choose_strict_mkl()  # before anything here imports torch and runs MKL

from rollwise.api import train  # noqa: E402
from rollwise.config import load_config  # noqa: E402
from rollwise.version import __version__  # noqa: E402

__all__ = ["__version__", "load_config", "train"]
