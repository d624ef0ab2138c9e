"""Token-in, token-out generation. The engine knows nothing about text: `Engine` is the
contract (base.py), `BuiltinEngine` the built-in continuous-batching engine (builtin.py);
backends.py builds the one a config names, in this process, in a child process
(process.py), as a Ray worker pool (ray_pool.py) or on vLLM (vllm.py)."""

from rollwise.engine.base import Completion, Engine, Request, SparseUpdate
from rollwise.engine.builtin import BuiltinEngine
from rollwise.engine.sampling import SamplingParams
from rollwise.engine.scheduler import Event

__all__ = ["BuiltinEngine", "Completion", "Engine", "Event", "Request", "SamplingParams",
           "SparseUpdate"]
