"""Engine backends by name (`engine.backend`, rollwise.registry kind 'engine'): each is a
factory(cfg, model, tokenizer, run_dir) -> an engine with the protocols of engine/base.py.

    engine = build_engine(cfg, model, tokenizer, run_dir)

- builtin: rollwise's engine, in this process or, with sync.transport=process|socket, in a child
  process fed through shared memory or a socket (rollwise.sync.engine_proc);
- vllm: vLLM in this process (rollwise.engine.vllm), from the model saved to
  run_dir/engine-model; the trainer's weights reach it through the same weight sync.

Both read engine.max_batch, engine.segment and engine.kv_budget_tokens, and weights in
sync.engine_dtype ('same': the trainer's).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch


def build_engine(cfg, model, tokenizer=None, run_dir: str | Path | None = None):
    """The engine `cfg.engine.backend` names, holding `model`'s weights at version 0."""
    from rollwise import registry
    factory = registry.resolve("engine", cfg.engine.backend, "engine.backend")
    return factory(cfg, model, tokenizer, run_dir)


def engine_dtype(cfg, model) -> torch.dtype:
    from rollwise.sync.payload import to_dtype
    return model.dtype if cfg.sync.engine_dtype == "same" else to_dtype(cfg.sync.engine_dtype)


def builtin(cfg, model, tokenizer=None, run_dir=None):
    from rollwise.engine.engine import Engine
    from rollwise.sync.engine_proc import WIRES, EngineProcess
    kwargs = dict(max_batch=cfg.engine.max_batch, seed=cfg.run.seed, segment=cfg.engine.segment,
                  kv_budget_tokens=cfg.engine.kv_budget_tokens)
    dtype = None if cfg.sync.engine_dtype == "same" else engine_dtype(cfg, model)
    if cfg.sync.transport in WIRES:
        return EngineProcess(model, dtype=dtype, wire=WIRES[cfg.sync.transport], **kwargs)
    engine = Engine(model, **kwargs)
    if dtype is not None:
        engine.model.to(dtype)
    return engine


def vllm(cfg, model, tokenizer, run_dir):
    """vLLM on the model as it stands, saved (in the engine's dtype) where vLLM can load it."""
    if cfg.sync.transport != "inproc":
        raise ValueError(f"engine.backend=vllm runs in this process: set sync.transport=inproc "
                         f"(got {cfg.sync.transport})")
    from rollwise import models
    from rollwise.engine.vllm import VLLMEngine
    from rollwise.sync.payload import dtype_name
    if run_dir is None:
        raise ValueError("engine.backend=vllm needs a run directory to save the model to")
    path = Path(run_dir) / "engine-model"
    dtype = engine_dtype(cfg, model)
    copy = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    models.save(model, tokenizer, path, copy)
    extra = {}
    if cfg.engine.kv_budget_tokens:  # vLLM sizes its KV cache in blocks of 16 tokens
        extra["num_gpu_blocks_override"] = math.ceil(cfg.engine.kv_budget_tokens / 16)
    return VLLMEngine(path, seed=cfg.run.seed, max_batch=min(cfg.engine.max_batch, 1024),
                      segment=cfg.engine.segment, dtype=dtype_name(dtype),
                      max_model_len=model.config.max_position_embeddings, **extra)
