"""Policy losses and loss aggregation: pure functions over per-token tensors.

Shapes: logprobs, old_logprobs, mask are (B, T); advantages is (B,) or (B, T).
Each loss returns (per-token loss (B, T), metrics dict of floats).
"""

from __future__ import annotations

from typing import Callable

import torch

POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict]]] = {}


def register_policy_loss(name: str):
    def wrap(fn):
        POLICY_LOSSES[name] = fn
        return fn
    return wrap


def get_policy_loss(name: str):
    if name not in POLICY_LOSSES:
        raise KeyError(f"unknown policy loss {name!r}; choose from {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


@register_policy_loss("ppo_clip")
def ppo_clip(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2):
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), with DAPO's separate bounds:
    loss_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A), r_t = exp(logp - old)."""
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        clip_frac = masked_mean((clipped < unclipped).float(), mask).item()
        approx_kl = masked_mean(old_logprobs - logprobs, mask).item()
    return loss, {"clip_frac": clip_frac, "approx_kl": approx_kl}


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor,
              mode: str = "seq-mean-token-mean") -> torch.Tensor:
    """seq-mean-token-mean (GRPO): mean over each sequence's tokens, then over sequences."""
    if mode == "seq-mean-token-mean":
        per_seq = (token_loss * mask).sum(-1) / mask.sum(-1).clamp_min(1)
        return per_seq[mask.sum(-1) > 0].mean() if (mask.sum(-1) > 0).any() else per_seq.sum() * 0
    raise KeyError(f"unknown loss aggregation {mode!r}")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1
