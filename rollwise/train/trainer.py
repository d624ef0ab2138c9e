"""The trainer: groups of scored samples -> advantages -> minibatched policy-gradient steps.

Log-probabilities are recomputed by the trainer: the proximal ("old") policy once at the start
of the update, the current one per minibatch. The engine's behaviour log-probabilities travel in
the Batch for the importance corrections; the gap between them is reported as a metric.
"""

from __future__ import annotations

import copy
import math

import torch

from rollwise.config import TrainConfig
from rollwise.train.advantages import get_advantage
from rollwise.train.losses import aggregate, get_policy_loss, kl_k3, masked_mean
from rollwise.types import Batch, Group


def token_logprobs(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and entropy per position, (B, T-1) each, from one forward pass."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp_all = logits[:, :-1].float().log_softmax(-1)
    logp = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


class Trainer:
    def __init__(self, model, cfg: TrainConfig, *, pad_id: int, seed: int = 0):
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        self.seed = seed
        self.version = 0
        self.advantage_fn = get_advantage(cfg.advantage)
        self.loss_fn = get_policy_loss(cfg.loss)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        total = max(cfg.steps, 1)
        end = cfg.lr_end_factor
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: 1 - (1 - end) * min(s, total) / total)
        self.ref_model = None
        if cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)

    def make_batch(self, groups: list[Group]) -> Batch:
        samples = [s for g in groups for s in g.samples]
        gidx = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)
        adv = self.advantage_fn(rewards, gidx)
        return Batch.from_samples(samples, adv.tolist(), self.pad_id, gidx.tolist())

    def update(self, groups: list[Group]) -> dict[str, float]:
        """One policy update on these groups; bumps the policy version."""
        self.model.train()
        metrics: dict[str, float] = {"train/samples": float(sum(len(g.samples) for g in groups))}
        if not groups:
            self._step_schedule()
            return metrics
        batch = self.make_batch(groups)
        with torch.no_grad():
            old_logp, _ = token_logprobs(self.model, batch)
            ref_logp = token_logprobs(self.ref_model, batch)[0] if self.ref_model else None
        mask = batch.loss_mask
        metrics["train/behaviour_gap_max"] = float(
            ((old_logp - batch.behaviour_logprobs).abs() * mask).max())
        gen = torch.Generator().manual_seed(self.seed * 100003 + self.version)
        sums: dict[str, float] = {}
        n_mb = 0
        for _ in range(self.cfg.epochs):
            order = torch.randperm(batch.size, generator=gen)
            for idx in order.chunk(min(self.cfg.minibatches, batch.size)):
                mb = batch.select(idx)
                m = self._minibatch_step(mb, old_logp[idx][:, :mb.loss_mask.shape[1]],
                                         None if ref_logp is None else
                                         ref_logp[idx][:, :mb.loss_mask.shape[1]])
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                n_mb += 1
        metrics.update({f"train/{k}": v / n_mb for k, v in sums.items()})
        metrics["train/tokens"] = float(mask.sum())
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        self._step_schedule()
        return metrics

    def _minibatch_step(self, mb: Batch, old_logp, ref_logp) -> dict[str, float]:
        logp, ent = token_logprobs(self.model, mb)
        mask = mb.loss_mask
        token_loss, m = self.loss_fn(logp, old_logp, mb.advantages, mask,
                                     clip_low=self.cfg.clip_low, clip_high=self.cfg.clip_high)
        if ref_logp is not None:
            kl = kl_k3(logp, ref_logp)
            token_loss = token_loss + self.cfg.kl_coef * kl
            m["kl_ref"] = masked_mean(kl.detach(), mask).item()
        loss = aggregate(token_loss, mask)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        if not math.isfinite(float(grad_norm)):
            raise FloatingPointError("non-finite gradient norm; lower train.lr")
        self.optimizer.step()
        m.update(loss=loss.item(), grad_norm=float(grad_norm),
                 entropy=masked_mean(ent, mask).item())
        return m

    def _step_schedule(self) -> None:
        self.scheduler.step()
        self.version += 1

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}
