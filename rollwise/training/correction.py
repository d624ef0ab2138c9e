"""Importance correction for tokens the current policy did not sample: pure functions over
per-token tensors (B, T), all without gradient.

Three log-probabilities describe a response token sampled at policy version v while the
trainer is at version V >= v:

    mu        the engine's behaviour log-probability (Sample.logprobs), version v
    pi_v      the trainer's log-probability under the weights of version v (kept snapshots)
    pi_prox   the trainer's log-probability under the weights of version V, recomputed at the
              start of the update (the proximal / "old" policy of the PPO ratio)

The behaviour ratio splits exactly into two factors ("Missing Old Logits",
docs/methods.md#correction):

    pi_prox / mu  =  [pi_v / mu]  x  [pi_prox / pi_v]
       total          mismatch         staleness
                   (engine vs trainer,  (policy drift over
                    same weights)       V - v updates)

With staleness 0 the total is pure mismatch. Without a snapshot of version v the split of a
stale token is unknown (APRIL's entangled case); it is counted as `unsplit`.

The loss is AReaL's decoupled PPO objective (Fu et al. 2025, arXiv 2505.24298;
docs/methods.md#correction):
    loss_t = -w_t * min(r_t A, clip(r_t) A),  r_t = pi / anchor,  w_t = anchor / mu,
with the anchor either pi_prox (`anchor='proximal'`: w corrects mismatch and staleness) or
pi_v (`anchor='version'`: the clip handles staleness and w corrects mismatch only). DOTS's
band [r_old(1-eps), r_old(1+eps)] on pi/mu is the same objective with an untruncated w.
The weight w is truncated (TIS) or masked (MIS) per token or per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rollwise.training.losses import masked_mean


@dataclass
class ISWeights:
    weights: torch.Tensor  # (B, T) detached multipliers of the per-token loss
    keep: torch.Tensor  # (B, T) float; 0 where MIS rejected the token (or its sequence)
    metrics: dict[str, float] = field(default_factory=dict)


def staleness(versions: torch.Tensor, current_version: int) -> torch.Tensor:
    """Policy versions between the trainer and the token, (B, T) long (0 = on-policy)."""
    return (current_version - versions).clamp_min(0)


def staleness_keep(versions: torch.Tensor, current_version: int, mask: torch.Tensor,
                   max_staleness: int | None) -> torch.Tensor:
    """1 where a trained token is at most max_staleness versions old, else 0, (B, T) float."""
    if max_staleness is None:
        return mask.clone()
    return mask * (staleness(versions, current_version) <= max_staleness).float()


def sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log of the sequence importance weight, sum_t log_ratio_t over trained tokens, (B,)."""
    return (log_ratio * mask).sum(-1)


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, mode: str = "none",
                       level: str = "token", low: float = 0.5, high: float = 2.0) -> ISWeights:
    """Per-token loss weights from log(anchor / mu), (B, T).

    mode 'none': w = 1 (the behaviour policy is taken to be the anchor).
    mode 'tis' (truncated IS; Ionides 2008; Yao et al. 2025, "Your Efficient RL Framework
      Secretly Brings You Off-Policy RL Training"): w = min(rho, high).
    mode 'mis' (masked IS, IcePop-style rejection; verl rollout_is 'mask'): w = rho when
      low <= rho <= high, else the token leaves the loss.
    mode 'icepop' (Ling Team 2025, IcePop: the two-sided mask M(rho; low, high) on the
      train/inference ratio of each token): 'mis' at level 'token', by that name; its paper's
      band is [0.5, 5].
    level 'token': rho = exp(log_ratio_t); level 'sequence': rho = exp(sum_t log_ratio_t),
      one weight (and one keep/reject decision) for the whole sequence.
    """
    if mode not in ("none", "tis", "mis", "icepop"):
        raise ValueError(f"train.correction.mode = {mode!r}: choose 'none', 'tis', 'mis' or "
                         f"'icepop'")
    if mode == "icepop" and level != "token":
        raise ValueError("train.correction.mode = icepop masks token by token: set "
                         "train.correction.level = token (or mode = mis for sequences)")
    if level not in ("token", "sequence"):
        raise ValueError(f"train.correction.level = {level!r}: choose 'token' or 'sequence'")
    lr = log_ratio.detach()
    if level == "sequence":
        lr = sequence_log_ratio(lr, mask)[:, None].expand_as(mask)
    lo, hi = math.log(low) if low > 0 else -math.inf, math.log(high)
    keep = mask.clone()
    if mode == "none":
        w = torch.ones_like(lr)
    elif mode == "tis":
        w = torch.exp(lr.clamp(max=hi))
    else:
        inside = (lr >= lo) & (lr <= hi)
        keep = keep * inside.float()
        w = torch.where(inside, torch.exp(lr.clamp(max=hi)), torch.zeros_like(lr))
    n = mask.sum().clamp_min(1)
    metrics = {
        "is_weight_mean": float((w * keep).sum() / keep.sum().clamp_min(1)),
        "is_weight_max": float(w[keep > 0].max()) if (keep > 0).any() else 0.0,
        "is_truncated_frac": float(((lr > hi) * mask).sum() / n) if mode == "tis" else 0.0,
        "is_rejected_frac": float(((mask - keep).clamp_min(0)).sum() / n),
    }
    return ISWeights(w * keep, keep, metrics)


def effective_sample_size(log_weights: torch.Tensor) -> float:
    """Kish's ESS = (sum w)^2 / sum w^2 of the sequence weights w = exp(log_weights), (N,),
    computed after subtracting the max log-weight (ESS is scale-free). N equal weights give N."""
    if log_weights.numel() == 0:
        return 0.0
    w = torch.exp(log_weights.double() - log_weights.double().max())
    return float(w.sum() ** 2 / (w ** 2).sum())


def vcpo_lr_scale(ess_frac: float, rho0: float = 1.0) -> float:
    """VCPO (docs/methods.md#vcpo, mit-han-lab/vcpo): the step's learning rate is multiplied by
    sqrt(min(1, rho / rho0)), rho = ESS / B, the square-root rule chosen for Adam."""
    return math.sqrt(max(0.0, min(1.0, ess_frac / rho0)))


SINCE_SYNC_BUCKETS = (0, 16, 64, 256)  # tokens since a response's latest weight sync


@torch.no_grad()
def carried_kv_metrics(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                       versions: torch.Tensor, current_version: int,
                       mask: torch.Tensor) -> dict[str, float]:
    """Tokens trained by version age, and how far sampling after a weight sync moved from the
    trainer's recompute under the same weights, by tokens since that sync.

    A response that spans versions and whose latest tokens are the trainer's version V was
    continued across a sync: with loop.carried_kv=keep on a context the old weights encoded,
    with recompute on one prefilled again. pi_prox is then exactly "a recompute under the
    same weights", so KL(mu || pi_prox) on those tokens (the k3 estimate, E_mu[rho - 1 -
    log rho], rho = pi_prox / mu) is what the kept K/V adds to the engine's own mismatch:
    `kl_one_version` is the same estimate on responses sampled by V alone."""
    m: dict[str, float] = {}
    on = mask > 0
    if not on.any():
        return m
    age = (current_version - versions).clamp_min(0)
    for a in range(int(age[on].max()) + 1):
        n = float((on & (age == a)).sum())
        if n:
            m[f"tokens_age_{a}"] = n
    d = prox_logp - behaviour_logp
    k3 = d.exp() - 1 - d
    now = on & (versions == current_version)
    older = on & (versions < current_version)
    spans = older.any(-1, keepdim=True)  # rows continued across a sync
    single = now & ~older.any(-1, keepdim=True)
    if single.any():
        m["kl_one_version"] = float(k3[single].mean())
    cont = now & spans
    if cont.any():
        first = torch.where(now, torch.arange(now.shape[1]).expand_as(now),
                            now.shape[1]).min(-1, keepdim=True).values
        since = torch.arange(now.shape[1]).expand_as(now) - first
        edges = [*SINCE_SYNC_BUCKETS, None]
        for lo, hi in zip(edges, edges[1:]):
            sel = cont & (since >= lo) & (since < hi if hi is not None else True)
            if sel.any():
                name = f"kl_since_sync_{lo}_{hi}" if hi is not None else f"kl_since_sync_{lo}+"
                m[name] = float(k3[sel].mean())
                m[name.replace("kl_", "tokens_")] = float(sel.sum())
    return m


@torch.no_grad()
def ratio_metrics(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                  version_logp: torch.Tensor | None, split_known: torch.Tensor,
                  stale: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the data is from the policy being trained, split into mismatch and staleness.

    version_logp: pi_v per token (defined where split_known), or None without snapshots.
    stale: (B, T) long staleness per token. Log-ratios are reported as mean |log rho|.
    """
    total = prox_logp - behaviour_logp
    m = {"total_abs_log_ratio": masked_mean(total.abs(), mask).item(),
         "total_ratio_max": float(total[mask > 0].exp().max()) if (mask > 0).any() else 0.0,
         "staleness_mean": masked_mean(stale.float(), mask).item(),
         "staleness_max": float(stale[mask > 0].max()) if (mask > 0).any() else 0.0}
    fresh = mask * (stale == 0).float()
    known = mask * split_known.float()
    m["unsplit_tokens"] = float((mask * (1 - split_known.float())).sum())
    if version_logp is None:  # only on-policy tokens split exactly: there mismatch = total
        m["mismatch_abs_log_ratio"] = masked_mean(total.abs(), fresh).item()
        m["mismatch_abs_log_ratio_max"] = float(total.abs()[fresh > 0].max()) \
            if (fresh > 0).any() else 0.0
        return m
    mismatch = version_logp - behaviour_logp
    drift = prox_logp - version_logp
    stale_known = known * (stale > 0).float()
    m["mismatch_abs_log_ratio"] = masked_mean(mismatch.abs(), known).item()
    m["mismatch_abs_log_ratio_max"] = float(mismatch.abs()[known > 0].max()) \
        if (known > 0).any() else 0.0
    m["staleness_abs_log_ratio"] = masked_mean(drift.abs(), stale_known).item()
    return m
