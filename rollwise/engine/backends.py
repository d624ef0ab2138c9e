"""Engine backends by name (`engine.backend`, rollwise.registry kind 'engine'): each is a
factory(cfg, model, tokenizer, run_dir) -> an Engine (engine/base.py); sizes come from
sizing.py.

    engine = build_engine(cfg, model, tokenizer, run_dir)

- builtin: rollwise's engine, in this process or, with sync.transport=process|socket, in a child
  process fed through shared memory or a socket (rollwise.engine.process);
- vllm: vLLM in this process (rollwise.engine.vllm), from the model saved to
  run_dir/engine-model; the trainer's weights reach it through the same weight sync;
- with loop.backend=ray, either one in each Ray rollout worker (rollwise.engine.ray_pool).

Both read engine.max_batch, engine.segment and engine.kv_budget_tokens (or _bytes), and weights
in sync.engine_dtype ('same': the trainer's). The built-in engine runs where the model is
(run.device); vLLM on a GPU shares it with the trainer: engine.gpu_memory_utilization splits the
memory, and engine.sleep_level puts vLLM to sleep while the trainer works.
"""

from __future__ import annotations

from pathlib import Path

from rollwise import models, registry
from rollwise.engine.base import Engine
from rollwise.engine.builtin import BuiltinEngine
from rollwise.engine.process import EngineProcess
from rollwise.engine.sizing import engine_dtype, kv_budget_tokens, prefix_cache_tokens, vllm_kwargs
from rollwise.sync.transport import WIRES


def build_engine(cfg, model, tokenizer=None, run_dir: str | Path | None = None):
    """The engine `cfg.engine.backend` names, holding `model`'s weights at version 0."""
    if cfg.loop.backend == "ray":
        if cfg.engine.backend not in ("builtin", "vllm") or cfg.sync.transport != "inproc":
            raise ValueError(f"loop.backend=ray runs built-in or vLLM engines in Ray actors and "
                             f"ships weights through the object store: set engine.backend="
                             f"builtin or vllm, and sync.transport=inproc (got "
                             f"{cfg.engine.backend}, {cfg.sync.transport})")
        from rollwise.engine.ray_pool import worker_pool  # Ray: imported only when used
        return worker_pool(cfg, model)
    factory = registry.resolve("engine", cfg.engine.backend, "engine.backend")
    return registry.conform(factory(cfg, model, tokenizer, run_dir), Engine, "engine.backend")


def builtin(cfg, model, tokenizer=None, run_dir=None):
    kwargs = dict(max_batch=cfg.engine.max_batch, seed=cfg.run.seed, segment=cfg.engine.segment,
                  kv_budget_tokens=kv_budget_tokens(cfg, model),
                  prefix_cache_tokens=prefix_cache_tokens(cfg), graph=cfg.engine.graph,
                  share_prefix=cfg.engine.share_prefix)
    dtype = None if cfg.sync.engine_dtype == "same" else engine_dtype(cfg, model)
    if cfg.sync.transport in WIRES:
        return EngineProcess(model, dtype=dtype, wire=WIRES[cfg.sync.transport],
                             timeout_s=cfg.loop.wait_timeout_s, **kwargs)
    engine = BuiltinEngine(model, **kwargs)
    if dtype is not None:
        engine.model.to(dtype)
    return engine


def vllm(cfg, model, tokenizer, run_dir):
    """vLLM on the model as it stands, saved (in the engine's dtype) where vLLM can load it."""
    if cfg.sync.transport != "inproc":
        raise ValueError(f"engine.backend=vllm runs in this process: set sync.transport=inproc "
                         f"(got {cfg.sync.transport})")
    from rollwise.engine.vllm import VLLMEngine  # vLLM: imported only when used
    if run_dir is None:
        raise ValueError("engine.backend=vllm needs a run directory to save the model to")
    kwargs = vllm_kwargs(cfg, model)  # checks the settings (the KV budget) before any work
    path = Path(run_dir) / "engine-model"
    dtype = engine_dtype(cfg, model)
    copy = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    models.save(model, tokenizer, path, copy)
    return VLLMEngine(path, **kwargs)
