"""Policy losses, loss aggregations and KL estimators: pure functions over per-token tensors,
each chosen by name in the config (`train.loss`, `train.loss_agg`, `train.kl_estimator`).

Shapes: logprobs, old_logprobs, mask are (B, T); advantages is (B,) or (B, T).
A policy loss returns (per-token loss (B, T), metrics); an aggregation turns the per-token loss
into the scalar to differentiate. Only `logprobs` carries a gradient; everything else is data.
The behaviour importance weights of rollwise.training.correction multiply the per-token loss
(AReaL's decoupled objective) outside these functions, so every loss composes with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollwise import registry

ZERO_AT_ZERO_ADVANTAGE = {"ppo_clip", "dual_clip", "gspo", "rec_oneside"}
"""Losses that are a multiple of each token's advantage: a token with advantage 0 adds exactly 0
to the loss and its gradient, so the trainer may skip rows made only of such tokens."""


@dataclass(frozen=True)
class LossParams:
    clip_low: float | torch.Tensor = 0.2  # ratio floor 1 - clip_low; a (B, 1) tensor: per row
    clip_high: float | torch.Tensor = 0.2  # ratio ceiling 1 + clip_high (DAPO clip-higher: 0.28)
    dual_clip_c: float = 3.0  # dual-clip bound on negative-advantage tokens, c > 1


def get_policy_loss(name: str):
    return registry.resolve("policy_loss", name, "train.loss")


def get_kl(name: str):
    return registry.resolve("kl", name, "train.kl_estimator")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(x[mask > 0].max()) if (mask > 0).any() else 0.0


def _masked_min(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(x[mask > 0].min()) if (mask > 0).any() else 0.0


def _adv2d(advantages: torch.Tensor) -> torch.Tensor:
    advantages = advantages.detach()  # data, never a path for gradients
    return advantages[:, None] if advantages.dim() == 1 else advantages


@torch.no_grad()
def _clip_metrics(ratio, adv, mask, p: LossParams) -> dict[str, float]:
    """Share of tokens whose gradient the clip removed, split by side, and ratio statistics."""
    high = ((adv > 0) & (ratio > 1 + p.clip_high)).float()
    low = ((adv < 0) & (ratio < 1 - p.clip_low)).float()
    return {"clip_frac_high": masked_mean(high, mask).item(),
            "clip_frac_low": masked_mean(low, mask).item(),
            "clip_frac": masked_mean(high + low, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": _masked_max(ratio, mask), "ratio_min": _masked_min(ratio, mask)}


def _clipped_surrogate(ratio, adv, p: LossParams) -> torch.Tensor:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), per token."""
    return -torch.minimum(ratio * adv, ratio.clamp(1 - p.clip_low, 1 + p.clip_high) * adv)


def ppo_clip(logprobs, old_logprobs, advantages, mask, p: LossParams = LossParams()):
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with DAPO's decoupled bounds
    (Yu et al. 2025, "clip-higher"):
    loss_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A), r_t = exp(logp_t - old_t)."""
    adv = _adv2d(advantages)
    old_logprobs = old_logprobs.detach()
    ratio = torch.exp(logprobs - old_logprobs)
    loss = _clipped_surrogate(ratio, adv, p)
    m = _clip_metrics(ratio.detach(), adv, mask, p)
    m["approx_kl"] = masked_mean((old_logprobs - logprobs).detach(), mask).item()
    return loss, m


def dual_clip(logprobs, old_logprobs, advantages, mask, p: LossParams = LossParams()):
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games"): for
    A < 0 the objective max(min(r A, clip(r) A), c A) bounds the loss of a token whose ratio
    has grown far above 1, loss_t = min(ppo_loss_t, -c A); A >= 0 is plain PPO-clip."""
    if p.dual_clip_c <= 1:
        raise ValueError(f"train.dual_clip_c = {p.dual_clip_c}: must be > 1 (3 is usual)")
    adv = _adv2d(advantages)
    old_logprobs = old_logprobs.detach()
    ratio = torch.exp(logprobs - old_logprobs)
    ppo = _clipped_surrogate(ratio, adv, p)
    bounded = torch.minimum(ppo, -p.dual_clip_c * adv)
    loss = torch.where(adv < 0, bounded, ppo)
    m = _clip_metrics(ratio.detach(), adv, mask, p)
    m["dual_clip_frac"] = masked_mean(((adv < 0) & (bounded < ppo)).float(), mask).item()
    m["approx_kl"] = masked_mean((old_logprobs - logprobs).detach(), mask).item()
    return loss, m


def rec_oneside(logprobs, old_logprobs, advantages, mask, p: LossParams = LossParams()):
    """REC's one-sided clip with no importance weight (Connect-the-Dots; Trinity-RFT's
    rec-oneside-noIS): the REINFORCE gradient -A grad log pi on every token, except tokens whose
    ratio already left the trust region on the side their advantage pushes to (A > 0 and
    r > 1 + eps_high, or A < 0 and r < 1 - eps_low), which add nothing."""
    adv = _adv2d(advantages)
    old_logprobs = old_logprobs.detach()
    ratio = torch.exp(logprobs - old_logprobs).detach()
    out = ((adv > 0) & (ratio > 1 + p.clip_high)) | ((adv < 0) & (ratio < 1 - p.clip_low))
    unit = torch.exp(logprobs - logprobs.detach())  # 1, with the gradient of log pi
    loss = -adv * unit * (~out).float()
    m = _clip_metrics(ratio, adv, mask, p)
    m["approx_kl"] = masked_mean((old_logprobs - logprobs).detach(), mask).item()
    return loss, m


def sequence_log_ratio(logprobs, old_logprobs, mask) -> torch.Tensor:
    """(1/|y_i|) sum_t (logp - old) over each sequence's masked tokens, (B,)."""
    return ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp_min(1)


def gspo(logprobs, old_logprobs, advantages, mask, p: LossParams = LossParams(0.0003, 0.0004)):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071: the
    GSPO objective and its GSPO-token form): one ratio per sequence, the geometric mean
    s_i = exp((1/|y_i|) sum_t log(pi/pi_old)), clipped as in PPO (paper: eps 3e-4 / 4e-4).
    Token form: s_it = sg[s_i] * pi(y_t) / sg[pi(y_t)], whose value is s_i and whose gradient
    is s_i grad log pi(y_t); with seq-mean-token-mean aggregation this is exactly the
    sequence objective. The sequence log-ratio is capped at 10, as in verl, against overflow."""
    adv, old_logprobs = _adv2d(advantages), old_logprobs.detach()
    seq = sequence_log_ratio(logprobs, old_logprobs, mask).detach().clamp(max=10.0)
    log_ratio = seq[:, None] + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio)
    loss = _clipped_surrogate(ratio, adv, p)
    m = _clip_metrics(ratio.detach(), adv, mask, p)
    m["approx_kl"] = masked_mean((old_logprobs - logprobs).detach(), mask).item()
    return loss, m


# ------------------------------------------------------------------------ aggregations

def token_mean(token_loss, mask, *, num_tokens=None, num_seqs=None, norm_length=None):
    """DAPO (Yu et al. 2025, token-level policy-gradient loss): every token of the batch
    weighs the same, sum_{i,t} l_it / sum_i |y_i|. Long answers are not down-weighted."""
    n = mask.sum() if num_tokens is None else num_tokens
    return (token_loss * mask).sum() / max(float(n), 1.0)


def seq_mean_token_mean(token_loss, mask, *, num_tokens=None, num_seqs=None, norm_length=None):
    """GRPO (Shao et al. 2024, eq. 3): mean over each sequence's tokens, then over the
    sequences, (1/G) sum_i (1/|y_i|) sum_t l_it. Sequences with no trained token don't count."""
    lengths = mask.sum(-1)
    per_seq = (token_loss * mask).sum(-1) / lengths.clamp_min(1)
    n = (lengths > 0).sum() if num_seqs is None else num_seqs
    return per_seq.sum() / max(float(n), 1.0)


def seq_mean_token_sum_norm(token_loss, mask, *, num_tokens=None, num_seqs=None,
                            norm_length=None):
    """Dr.GRPO (Liu et al. 2025, its objective and released code): token sums divided by one
    constant L (the generation budget) instead of each |y_i|, then mean over sequences,
    (1/G) sum_i (1/L) sum_t l_it. This removes GRPO's length bias."""
    if not norm_length:
        raise ValueError("loss_agg 'seq-mean-token-sum-norm' needs a constant length "
                         "(train.norm_length)")
    n = (mask.sum(-1) > 0).sum() if num_seqs is None else num_seqs
    return (token_loss * mask).sum() / (max(float(n), 1.0) * norm_length)


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, mode: str = "seq-mean-token-mean",
              *, num_tokens=None, num_seqs=None, norm_length=None) -> torch.Tensor:
    """Scalar loss. Pass num_tokens / num_seqs of the whole optimizer batch when this is one
    micro-batch of it, so that the micro-batch losses sum to the full-batch loss."""
    fn = registry.resolve("aggregation", mode, "train.loss_agg")
    return fn(token_loss, mask, num_tokens=num_tokens, num_seqs=num_seqs,
              norm_length=norm_length)


# ------------------------------------------------------------------------- KL estimators
# Schulman 2020, "Approximating KL Divergence": estimators of KL(pi || ref) from samples of pi,
# with d = log ref - log pi at the sampled token.

def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = -d = log pi - log ref: unbiased, high variance, can be negative."""
    return logprobs - ref_logprobs.detach()


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2: biased, low variance, >= 0; its gradient is that of the true KL's
    second-order expansion."""
    return 0.5 * (ref_logprobs.detach() - logprobs) ** 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1: unbiased, low variance, >= 0 (GRPO's KL term, DeepSeekMath eq. 4)."""
    d = ref_logprobs.detach() - logprobs
    return torch.exp(d) - d - 1
