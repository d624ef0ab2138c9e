"""run.device: where the trainer and the built-in engine run. Nothing here initialises CUDA on a
machine without it (torch.cuda.is_available only asks the driver)."""

from __future__ import annotations

import torch

from rollwise.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """cpu, cuda (an error naming the fix when torch sees none), or auto (cuda when visible)."""
    if name == "cpu":
        return torch.device("cpu")
    has_cuda = torch.cuda.is_available()
    if name == "cuda" and not has_cuda:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"run.device = cuda, but torch {torch.__version__} ({build}) sees no "
                         "CUDA device: set run.device=cpu (or auto), or install a CUDA build of "
                         "torch on a machine with a GPU")
    if name not in ("auto", "cuda"):
        raise ConfigError(f"run.device = {name!r}: use auto, cpu or cuda")
    return torch.device("cuda" if has_cuda else "cpu")
