"""fp32 master weights for a model whose parameters are bf16 or fp16 (model.dtype).

The forward and backward run in the model's dtype; the optimizer (and its state) steps on fp32
copies, and the model then holds their cast, so small updates accumulate instead of rounding
away. What the engine receives is the model's parameters: exactly the cast of the master.

    master = MasterWeights.of(model)       # None for an fp32 model
    opt = AdamW(master.params())
    loss.backward(); master.grads_to_master(); opt.step(); master.master_to_model()
"""

from __future__ import annotations

import torch


class MasterWeights:
    def __init__(self, model):
        self.pairs = [(p, p.detach().float().clone().requires_grad_(True))
                      for p in model.parameters() if p.requires_grad]

    @classmethod
    def of(cls, model) -> "MasterWeights | None":
        low = {p.dtype for p in model.parameters()
               if p.is_floating_point() and p.requires_grad} - {torch.float32}
        return cls(model) if low else None

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
