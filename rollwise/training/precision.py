"""fp32 master weights for a model whose parameters are bf16 or fp16 (model.dtype).

The forward and backward run in the model's dtype; the optimizer (and its state) steps on fp32
copies, and the model then holds their cast, so small updates accumulate instead of rounding
away. What the engine receives is the model's parameters: exactly the cast of the master.

The masters start from the float32 values the model was cast from, where rollwise.models.to_dtype
kept them (a float32 checkpoint loaded in bf16), not from the cast. Started from the cast,
every master sits on the bf16 grid, and no weight of the policy moves until its summed update
passes half a grid step: at lr 2e-5 that is about 6 steps for a weight of size 0.04, so RL's
first steps barely change the policy. From the float32 values each weight's offset from the
grid is spread out, and the cast moves with the master on average from the first step.

    master = MasterWeights.of(model)       # None for an fp32 model
    opt = AdamW(master.params())
    loss.backward(); master.grads_to_master(); opt.step(); master.master_to_model()
"""

from __future__ import annotations

import torch


class MasterWeights:
    def __init__(self, model, full: dict[str, torch.Tensor] | None = None):
        """full: float32 values by parameter name to start from; one whose cast is not the
        parameter (the model changed since) is not used."""
        full = full or {}
        self.pairs = []
        for name, p in model.named_parameters():
            if p.requires_grad:
                src = full.get(name)
                if src is None or src.shape != p.shape or not torch.equal(
                        src.to(device=p.device, dtype=p.dtype), p.detach()):
                    src = p
                self.pairs.append((p, src.detach().to(p.device, torch.float32, copy=True)
                                   .requires_grad_(True)))

    @classmethod
    def of(cls, model) -> "MasterWeights | None":
        from rollwise.models import take_full_precision
        full = take_full_precision(model)
        low = {p.dtype for p in model.parameters()
               if p.is_floating_point() and p.requires_grad} - {torch.float32}
        return cls(model, full) if low else None

    def params(self) -> list[torch.Tensor]:
        return [m for _, m in self.pairs]

    def grads_to_master(self) -> None:
        """Move the model's gradients onto the master copies (in fp32)."""
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach().clone() for _, m in self.pairs]

    @torch.no_grad()
    def load_state_dict(self, state: list[torch.Tensor]) -> None:
        if len(state) != len(self.pairs):
            raise ValueError(f"master weights: the checkpoint has {len(state)} tensors, the "
                             f"model {len(self.pairs)}")
        for (_, m), v in zip(self.pairs, state):
            m.copy_(v)
        self.master_to_model()
