"""Token-in, token-out generation. The engine knows nothing about text."""

from rollwise.engine.engine import Completion, Engine, Request
from rollwise.engine.sampling import SamplingParams

__all__ = ["Completion", "Engine", "Request", "SamplingParams"]
