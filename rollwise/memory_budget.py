"""run.memory_gib: one budget for a CPU run's resident memory. What does not grow with the
work is counted first (the runtime, the weights and their fp32 masters, gradients, AdamW's
moments, the engine's copy); from what is left come the built-in engine's K/V cache (which
also bounds an evaluation's batch) and the update's micro-batch tokens. A budget that cannot
hold the fixed part with one sequence is refused before any work, naming what to lower.

    plan = plan_memory(cfg, shape_of(model))   # or shape_from_config(cfg), before loading
    plan.kv_tokens, plan.microbatch_tokens, plan.describe()

Each part stays at what pays even where the budget is large: the K/V cache at what one step's
sequences can use, the micro-batches at AUTO_MAX_TOKENS (on this CPU a larger pass is no
faster; BENCHMARKS.md), so on any machine with room the run is cut the same way and its float
rounding is the same. Only a budget that binds changes them, and then the run says so.

With run.trim_memory the synchronous loop frees the engine's cache for the update, so the two
share what is left; otherwise (and when paused answers keep their K/V, loop.carried_kv=keep)
they split it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise.errors import ConfigError
from rollwise.training.microbatch import AUTO_MAX_TOKENS, activation_bytes_per_token

GIB = 2 ** 30
RUNTIME_BYTES = int(0.6 * GIB)  # Python, torch, transformers, the tokenizer, the task
AUTO_SHARE = 0.75  # run.memory_gib=auto: of the memory available when the run starts
PROMPT_ALLOWANCE = 256  # K/V positions counted for a prompt before it is tokenized


@dataclass(frozen=True)
class ModelShape:
    params: int
    trainable: int
    dtype_bytes: int
    kv_bytes_per_token: int
    activation_bytes_per_token: int  # what the update keeps per token (microbatch.py)

    @property
    def low_precision(self) -> bool:
        return self.dtype_bytes < 4


def shape_of(model, cfg) -> ModelShape:
    from rollwise.engine.sizing import kv_bytes_per_token
    params = sum(p.numel() for p in model.parameters())
    size = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    trainable = _lora_params(model, cfg) if cfg.train.lora.rank else params
    dtype = torch.bfloat16 if size == 2 else torch.float32
    return ModelShape(params, trainable, size, kv_bytes_per_token(model.config, dtype),
                      activation_bytes_per_token(model.config, size,
                                                 cfg.train.gradient_checkpointing))


def _lora_params(model, cfg) -> int:
    """Adapter parameters of rank r on every linear layer the targets name, an upper count."""
    r = cfg.train.lora.rank
    return sum(r * (m.in_features + m.out_features) for m in model.modules()
               if isinstance(m, torch.nn.Linear))


def shape_from_config(cfg) -> ModelShape:
    """The shape of the run's model from its config alone, built on the meta device (no
    weights read): what the check before any work uses."""
    from transformers import AutoModelForCausalLM

    from rollwise import models
    path = cfg.run.init or cfg.model.path
    with torch.device("meta"):
        if path:
            model = AutoModelForCausalLM.from_config(models.model_config(path))
        else:
            tok = models.char_tokenizer()
            model = models.tiny_model(cfg.model, len(tok), tok.pad_token_id, tok.eos_token_id)
        model = model.to(torch.bfloat16 if cfg.model.dtype == "bfloat16" else torch.float32)
        return shape_of(model, cfg)


@dataclass(frozen=True)
class MemoryPlan:
    budget: int
    fixed: dict[str, int]  # what does not grow with the work, by part
    kv_tokens: int | None  # the built-in engine's K/V budget (None: set by the config)
    microbatch_tokens: int
    shared: bool  # the K/V cache is freed for the update, so both use what is left
    binds: bool  # the budget, not AUTO_MAX_TOKENS or one step's need, set the sizes

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.fixed.items())
        kv = "as configured" if self.kv_tokens is None else f"{self.kv_tokens:,} K/V tokens"
        fixed = sum(self.fixed.values()) / GIB
        return (f"memory budget {self.budget / GIB:.1f} GiB: fixed {fixed:.2f} GiB ({parts}); "
                f"{kv}; micro-batches of {self.microbatch_tokens:,} tokens")


def budget_bytes(cfg) -> tuple[int, str]:
    """run.memory_gib in bytes, and where it came from."""
    from rollwise.engine.sizing import memory_available
    if cfg.run.memory_gib != "auto":
        return int(cfg.run.memory_gib * GIB), "run.memory_gib"
    return int(AUTO_SHARE * memory_available()), "run.memory_gib=auto (3/4 of what is free)"


def fixed_bytes(cfg, shape: ModelShape) -> dict[str, int]:
    n, t = shape.params, shape.trainable
    weights = n * shape.dtype_bytes + (t * 4 if shape.low_precision else 0)  # + fp32 masters
    grads = t * shape.dtype_bytes + (t * 4 if shape.low_precision else 0)
    engine = n * shape.dtype_bytes * (2 if shape.low_precision else 1)  # bf16: packed copies
    out = {"runtime": RUNTIME_BYTES, "weights": weights, "gradients": grads,
           "optimizer": t * 8, "engine weights": engine}
    if cfg.train.kl_coef > 0 and not cfg.train.lora.rank:
        out["reference"] = n * shape.dtype_bytes
    return out


def step_kv_tokens(cfg) -> int:
    """K/V positions one step's sequences can hold at once (the prompt by an allowance)."""
    g = cfg.generate
    turns = g.max_turns if g.env else 1
    return cfg.control.prompts_per_step * g.group_size * (g.max_new_tokens * turns +
                                                         PROMPT_ALLOWANCE)


def plan_memory(cfg, shape: ModelShape) -> MemoryPlan:
    """The plan for a CPU run, or a ConfigError saying what does not fit and what to lower."""
    budget, source = budget_bytes(cfg)
    fixed = fixed_bytes(cfg, shape)
    left = budget - sum(fixed.values())
    # kept answers (loop.carried_kv=keep) hold their K/V through the update: nothing to share
    shared = cfg.run.trim_memory and cfg.loop.mode == "sync" and not cfg.keeps_carried_kv()
    e = cfg.engine
    configured = e.kv_budget_tokens or (e.kv_budget_bytes and
                                        e.kv_budget_bytes // shape.kv_bytes_per_token)
    sequence = cfg.generate.max_new_tokens + PROMPT_ALLOWANCE
    want_kv = configured or step_kv_tokens(cfg)
    kv_room = left if shared else left // 2
    kv_tokens = configured or min(want_kv, max(kv_room, 0) // shape.kv_bytes_per_token)
    act_room = left if shared else left - kv_tokens * shape.kv_bytes_per_token
    tokens = min(AUTO_MAX_TOKENS, max(act_room, 0) // shape.activation_bytes_per_token)
    if kv_tokens < sequence or tokens < min(sequence, AUTO_MAX_TOKENS):
        need = sum(fixed.values()) + sequence * (shape.kv_bytes_per_token + (
            0 if shared else shape.activation_bytes_per_token))
        raise ConfigError(
            f"{source}: {budget / GIB:.2f} GiB cannot hold this run: its model alone takes "
            f"{sum(fixed.values()) / GIB:.2f} GiB ("
            + ", ".join(f"{k} {v / GIB:.2f}" for k, v in fixed.items())
            + f"), and one sequence of {sequence} tokens needs room in the K/V cache and the "
            f"update: at least {need / GIB:.2f} GiB. Raise run.memory_gib, or lower what the "
            f"run holds: " + ", ".join(_levers(cfg, shape)))
    binds = kv_tokens < want_kv or tokens < AUTO_MAX_TOKENS
    return MemoryPlan(budget, fixed, None if configured else kv_tokens, int(tokens), shared,
                      binds)


def _levers(cfg, shape: ModelShape) -> list[str]:
    out = []
    if not cfg.train.lora.rank:
        out.append("train.lora.rank=8 (adapters only: no full gradients or optimizer state)")
    if not shape.low_precision:
        out.append("model.dtype=bfloat16 (half the weights, where the CPU has bf16)")
    if not cfg.train.gradient_checkpointing:
        out.append("train.gradient_checkpointing=true (fewer activations kept)")
    return out + ["generate.max_new_tokens (shorter sequences)"]


def sized_for_memory(cfg, device, log, model=None):
    """On a CPU run: a copy of cfg with the plan's sizes in place of its automatic ones (the
    built-in engine's K/V budget, train.max_tokens_per_microbatch), said once; elsewhere cfg.
    Raises ConfigError, before any work, when the budget cannot hold the run."""
    if torch.device(device).type != "cpu":
        return cfg
    plan = plan_memory(cfg, shape_of(model, cfg) if model is not None else
                       shape_from_config(cfg))
    cfg = cfg.model_copy(deep=True)
    if plan.kv_tokens is not None and cfg.engine.backend == "builtin":
        cfg.engine.kv_budget_tokens = plan.kv_tokens
    if cfg.train.max_tokens_per_microbatch == "auto":
        cfg.train.max_tokens_per_microbatch = plan.microbatch_tokens
    log(plan.describe() + ("; the budget sets these, so set run.memory_gib to keep them "
                           "(and the run's float rounding) the same across runs"
                           if plan.binds else ""))
    return cfg
