"""How many tokens one forward pass of the trainer may hold: train.max_tokens_per_microbatch
"auto" chooses it from the model's shape and the device's memory.

Half the device's memory goes to the trainer (the rest is the engine's, the allocator's slack
and everything else). From it come the states that do not depend on the batch: the weights, their
gradients, the fp32 masters and their gradients, AdamW's two moments, a reference copy. What
is left, over the activations a token keeps for the backward pass, is the budget.

The budget depends on the device's total memory, not on what is free at the moment: a run's
micro-batches (and so its float rounding) are then the same whatever else the machine runs.
On a CPU it is at most AUTO_MAX_TOKENS, where larger passes stop paying;
a CPU run sizes it within run.memory_gib instead (rollwise.memory_budget).
"""

from __future__ import annotations

import os

import torch

TRAINER_SHARE = 0.5  # of the device's memory
MIN_TOKENS = 1024  # never cut passes smaller than this; a longer row goes alone anyway
AUTO_MAX_TOKENS = 4096  # on a CPU: where a larger pass stops paying (BENCHMARKS.md)
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def device_memory(device: torch.device) -> int:
    """Bytes of memory of the device: a GPU's total, or this machine's RAM within the
    container's limit."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:  # v2, v1; "max" (v2) means none
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def state_bytes(model, reference: bool) -> int:
    """What the trainer holds whatever the batch: weights, gradients, and AdamW's moments on
    the trainable tensors (on fp32 masters, with their gradients, for a low-precision model),
    and a reference copy of the weights."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = [p for p in params if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    n = sum(p.numel() for p in trainable)
    low = any(p.element_size() < 4 for p in trainable)
    optimizer = n * 4 * (4 if low else 2)  # (master, its gradient,) two moments, fp32
    return weights * (2 if reference else 1) + grads + optimizer


def activation_bytes_per_token(config, dtype_bytes: int, checkpointing: bool) -> int:
    """Activations a token keeps for the backward pass of a Llama-family decoder, an upper
    estimate: per layer, the norms' inputs and fp32 copies, q, k, v, the attention output,
    the MLP's gate, up, activation and product; with checkpointing, each layer's input and
    one layer recomputed at a time."""
    H, mlp = config.hidden_size, getattr(config, "intermediate_size", 4 * config.hidden_size)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) * (H // heads)
    layer = (10 * H + 2 * kv + 4 * mlp) * dtype_bytes + 2 * H * 4
    L = config.num_hidden_layers
    return (L * H * dtype_bytes + layer) if checkpointing else L * layer


def auto_token_budget(model, *, checkpointing: bool, reference: bool,
                      memory: int | None = None) -> int:
    """Tokens (rows x their longest sequence) per forward pass that fit the trainer's share
    of the device's memory (`memory`: that device's bytes; measured when None)."""
    p = next(model.parameters())
    memory = device_memory(p.device) if memory is None else memory
    left = TRAINER_SHARE * memory - state_bytes(model, reference)
    per_token = activation_bytes_per_token(model.config, p.element_size(), checkpointing)
    fits = max(MIN_TOKENS, int(left // per_token))
    return min(fits, AUTO_MAX_TOKENS) if p.device.type == "cpu" else fits
