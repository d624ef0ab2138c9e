"""Token-in, token-out generation. The engine knows nothing about text."""

from rollwise.engine.engine import Completion, Engine, Request, SparseUpdate
from rollwise.engine.sampling import SamplingParams
from rollwise.engine.scheduler import Event

__all__ = ["Completion", "Engine", "Event", "Request", "SamplingParams", "SparseUpdate"]
