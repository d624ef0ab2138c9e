"""ECHO's update side (docs/methods.md#echo, `core_algos.py` of user683/ECHO@6f7b311): per-token
entropy-confidence advantage shaping and a confidence-adaptive clip, both read from the policy
before the update.

Confidence here is c_t = mean probability of the top-5 tokens at position t, in [0, 1] (the
rollout side's DeepConf confidence, -mean log p over top-5, is another quantity:
stages/generate/tree_rules.py).

- shaping (`train.token_shaping=echo`): S_t = z(H_t) + z(1 - c_t), z the whitening over the
  batch's response tokens, |S_t| <= 2; A_t = A * (1 + 0.1 S_t). Uncertain tokens of a sequence
  weigh more, sure ones less, and the sign of A is kept (|0.1 S| <= 0.2).
- clip (`train.adaptive_clip=echo`): per sequence, c_tail = mean c over its last 16 response
  tokens and eps = 0.05 + 0.15 sigmoid(4 (1 - c_tail)) on both sides of the ratio. A sequence
  that ends sure (c_tail -> 1) gets eps -> 0.125, an unsure one up to 0.197.
"""

from __future__ import annotations

import torch

TOP = 5  # tokens whose probabilities make the confidence
SHAPING_COEF, SCORE_CLAMP = 0.1, 2.0
CLIP_MIN, CLIP_MAX, CLIP_SHARPNESS, TAIL = 0.05, 0.2, 4.0, 16


@torch.no_grad()
def policy_token_stats(model, batch, chunks: list[torch.Tensor] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(entropy, confidence) per (B, T-1) target column of batch under `model`, one padded
    pass per chunk of rows (Trainer.token_chunks: the no-grad passes' token budget; None: one
    pass). Columns outside the sequences hold 0."""
    W = batch.input_ids.shape[1] - 1
    ent, conf = torch.zeros(batch.size, W), torch.zeros(batch.size, W)
    for rows in chunks or [torch.arange(batch.size)]:
        ids, att = batch.input_ids[rows], batch.attention_mask[rows]
        T = int(att.sum(1).max())
        logits = model(input_ids=ids[:, :T].to(model.device),
                       attention_mask=att[:, :T].to(model.device), use_cache=False).logits
        logp = logits[:, :-1].float().log_softmax(-1).cpu()
        inside = att[:, 1:T].float()
        ent[rows, :T - 1] = -(logp.exp() * logp).sum(-1) * inside
        conf[rows, :T - 1] = logp.topk(min(TOP, logp.shape[-1]), -1).values.exp().mean(-1) * inside
    return ent, conf


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased variance, as verl)."""
    n = mask.sum()
    mean = (x * mask).sum() / n.clamp_min(1)
    var = (((x - mean) ** 2) * mask).sum() / (n - 1).clamp_min(1)
    return (x - mean) * torch.rsqrt(var + eps)


def echo_score(entropy: torch.Tensor, confidence: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """S = z(H) + z(1 - c), clamped to |S| <= 2; 0 outside the mask."""
    s = masked_whiten(entropy, mask) + masked_whiten(1 - confidence, mask)
    return s.clamp(-SCORE_CLAMP, SCORE_CLAMP) * mask


def echo_shaping(token_advantages: torch.Tensor, batch) -> torch.Tensor:
    """A_t = A (1 + 0.1 S_t) on the batch's response tokens (train.token_shaping=echo)."""
    s = echo_score(batch.policy_entropy, batch.policy_confidence, batch.loss_mask)
    return token_advantages * (1 + SHAPING_COEF * s)


echo_shaping.needs_policy_stats = True  # Trainer.prepare fills Batch.policy_entropy/_confidence


def tail_confidence(confidence: torch.Tensor, mask: torch.Tensor, tail: int = TAIL) -> torch.Tensor:
    """Per row, mean confidence over its last `tail` masked positions, (B,); 1 for a row with
    none (the tightest clip)."""
    from_end = mask.flip(-1).cumsum(-1).flip(-1)  # masked positions at or after each column
    last = (mask > 0) & (from_end <= tail)
    n = last.sum(-1)
    mean = (confidence * last).sum(-1) / n.clamp_min(1)
    return torch.where(n > 0, mean, torch.ones_like(mean))


def echo_clip(confidence: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence clip eps = 0.05 + 0.15 sigmoid(4 (1 - c_tail)), (B, 1)."""
    c_tail = tail_confidence(confidence, mask)
    eps = CLIP_MIN + (CLIP_MAX - CLIP_MIN) * torch.sigmoid(CLIP_SHARPNESS * (1 - c_tail))
    return eps[:, None]
