"""How big an engine's parts are, from the config and the model: the engine's dtype, its KV
budget in tokens (or vLLM's in bytes, within the memory the trainer leaves), the prefix cache
for agent episodes, and vLLM's arguments. Shared by every place that builds an engine
(backends.py, ray_pool.py)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from rollwise import registry
from rollwise.sync.payload import dtype_name, to_dtype


def engine_dtype(cfg, model) -> torch.dtype:
    return model.dtype if cfg.sync.engine_dtype == "same" else to_dtype(cfg.sync.engine_dtype)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of K and V one token takes in the cache of a model with this HF config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // \
        config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * size


def kv_budget_tokens(cfg, model) -> int | None:
    """engine.kv_budget_tokens, or engine.kv_budget_bytes in tokens of this model's cache."""
    e = cfg.engine
    if e.kv_budget_bytes is None:
        return e.kv_budget_tokens
    per = kv_bytes_per_token(model.config, engine_dtype(cfg, model))
    if e.kv_budget_bytes < per:
        raise ValueError(f"engine.kv_budget_bytes = {e.kv_budget_bytes} holds no token of this "
                         f"model's KV cache ({per} bytes per token); raise it")
    return e.kv_budget_bytes // per


def prefix_cache_tokens(cfg) -> int:
    """engine.prefix_cache_tokens, auto resolved: room for every episode of a step (prompt and
    episode, the prompt taken as long as the episode) when episodes are played (generate.env,
    or a strategy whose requests extend earlier ones: Generator.multi_turn), else off."""
    n, g = cfg.engine.prefix_cache_tokens, cfg.generate
    if n != "auto":
        return n
    strategy = registry.resolve("generator", g.strategy, "generate.strategy")
    if not g.env and not getattr(strategy, "multi_turn", False):
        return 0
    episode = g.max_episode_tokens or g.max_new_tokens * g.max_turns
    return cfg.control.prompts_per_step * g.group_size * 2 * episode


GIB = 2**30


def memory_available() -> int:
    """Bytes of this machine's memory still free: the operating system's MemAvailable (the
    total memory where /proc/meminfo is absent)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def serving_kv_budget(model, gib: float | None = None) -> tuple[int, int]:
    """A served engine's K/V budget as (tokens, bytes): `gib` GiB, or by default half the
    memory this machine has available (read after the model has loaded), so that no request,
    whatever its n and max_tokens, can take the machine's memory."""
    per = kv_bytes_per_token(model.config, model.dtype)
    size = int(gib * GIB) if gib is not None else memory_available() // 2
    if size < per * 64:
        raise ValueError(f"a K/V budget of {size / GIB:.3g} GiB holds fewer than 64 tokens of "
                         f"this model ({per} bytes a token); raise it")
    return size // per, size


def trainer_bytes(model) -> int:
    """What a trainer beside the engine holds besides activations: weights, gradients and
    AdamW's two moments in fp32 (bf16 weights keep fp32 master weights too)."""
    n = sum(p.numel() for p in model.parameters())
    return n * (16 + (4 if model.dtype != torch.float32 else 0))


def vllm_kv_budget_bytes(cfg, model) -> int:
    """vLLM's KV cache beside the trainer on CPU, in bytes: engine.kv_budget_bytes (or
    _tokens) where given, else what a step's sequences can use (prompts x group x
    (max_new_tokens x turns + a 1,024-token prompt allowance)) within half the memory the
    trainer leaves. (vLLM left to size itself takes most of the machine, and the kernel kills
    the trainer beside it at the first update.) A ValueError naming the figures when the
    budget does not fit, or holds less than one sequence of the model's context."""
    e, g = cfg.engine, cfg.generate
    dtype = engine_dtype(cfg, model)
    per = kv_bytes_per_token(model.config, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * size  # vLLM's copy and its mirror
    left = memory_available() - trainer_bytes(model) - 2 * weights
    one = per * model.config.max_position_embeddings
    if e.kv_budget_bytes or e.kv_budget_tokens:
        budget = e.kv_budget_bytes or e.kv_budget_tokens * per
        key = "engine.kv_budget_bytes" if e.kv_budget_bytes else "engine.kv_budget_tokens"
        if budget > left:
            raise ValueError(f"{key}: a {budget / GIB:.1f} GiB KV cache does not fit: "
                             f"{max(left, 0) / GIB:.1f} GiB are left once the trainer "
                             f"({trainer_bytes(model) / GIB:.1f} GiB of weights, gradients and "
                             f"optimizer state) and the engine's weights are counted; lower it")
    else:
        turns = g.max_turns if g.env else 1
        want = cfg.control.prompts_per_step * g.group_size * (g.max_new_tokens * turns + 1024)
        budget = max(one, min(want * per, left // 2))
        key = "the default KV cache (set engine.kv_budget_bytes)"
    if budget < one:
        raise ValueError(f"{key}: {budget / GIB:.2f} GiB holds less than one sequence of the "
                         f"model's {model.config.max_position_embeddings} positions "
                         f"({one / GIB:.2f} GiB), which vLLM needs; raise it")
    return int(budget)


def vllm_kwargs(cfg, model, colocated: bool = True) -> dict:
    """VLLMEngine's arguments from the config (besides the model's folder). colocated: beside
    the trainer, on its device (a Ray rollout worker has its own)."""
    dtype = engine_dtype(cfg, model)
    e, extra = cfg.engine, {}
    if e.kv_budget_bytes:
        extra["kv_cache_memory_bytes"] = e.kv_budget_bytes
    elif e.kv_budget_tokens:  # vLLM sizes its KV cache in blocks of 16 tokens
        extra["num_gpu_blocks_override"] = math.ceil(e.kv_budget_tokens / 16)
    on_gpu = colocated and next(model.parameters()).device.type == "cuda"
    if colocated and not on_gpu:  # beside the trainer on CPU: within what it leaves
        budget = vllm_kv_budget_bytes(cfg, model)
        if not e.kv_budget_tokens:
            extra["kv_cache_memory_bytes"] = budget
    if e.sleep_level and not on_gpu:
        raise ValueError(f"engine.sleep_level = {e.sleep_level} needs vLLM on a CUDA GPU "
                         "beside the trainer (run.device=cuda, loop.backend=local); set "
                         "engine.sleep_level=0")
    if on_gpu:  # colocated with the trainer: vLLM takes only its share of the device
        extra["gpu_memory_utilization"] = e.gpu_memory_utilization
        extra["enable_sleep_mode"] = e.sleep_level > 0
    return dict(seed=cfg.run.seed, max_batch=min(e.max_batch, 1024), segment=e.segment,
                dtype=dtype_name(dtype), sleep_level=e.sleep_level,
                max_model_len=model.config.max_position_embeddings,
                entropy_logprobs=entropy_logprobs(model.config.vocab_size),
                lora_rank=cfg.train.lora.rank, **extra)


EXACT_ENTROPY_MAX_VOCAB = 4096
ENTROPY_TOP_K = 20


def entropy_logprobs(vocab_size: int) -> int:
    """The log-probabilities vLLM returns per token, from which the engine's entropy comes:
    the whole vocabulary (-1, exact) for a small one; the top ENTROPY_TOP_K (and the sampled
    token) for a real one, whose whole vocabulary per token, as Python objects, takes
    gigabytes within a step (a 49k vocabulary ran a 24 GB machine out of memory) and slows
    generation twentyfold. The entropy is then the top-k part of the sum, a lower bound."""
    return -1 if vocab_size <= EXACT_ENTROPY_MAX_VOCAB else ENTROPY_TOP_K
