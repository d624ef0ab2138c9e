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
    opt = AdamW(master.params(), **adamw_kernel(master.params()))
    loss.backward(); master.grads_to_master(); opt.step(); master.master_to_model()

Both copies are one foreach operation over every tensor (a kernel per few tensors on a GPU
instead of one per tensor), and the masters' gradient buffers are kept from step to step:
each step overwrites them, so they are neither zeroed nor allocated again.
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
        """Move the model's gradients onto the master copies (in fp32); a parameter without
        one gets a zero gradient."""
        have = [(p.grad, m) for p, m in self.pairs if p.grad is not None]
        for p, m in self.pairs:
            if m.grad is None:
                m.grad = torch.empty_like(m)
            if p.grad is None:
                m.grad.zero_()
        if have:
            _foreach_copy([m.grad for _, m in have], [g for g, _ in have])
        for p, _ in self.pairs:
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        _foreach_copy([p for p, _ in self.pairs], [m for _, m in self.pairs])

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


def _plain(tensors: list[torch.Tensor]) -> bool:
    """Plain tensors (not FSDP2's DTensors: torch has no sharding rule for _foreach_copy_ or
    a fused AdamW kernel on them)."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def _foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for all i (casting), as one foreach operation on plain tensors."""
    if _plain(dst) and _plain(src):
        torch._foreach_copy_(dst, src)
        return
    for d, s in zip(dst, src):
        d.copy_(s)


def adamw_kernel(params: list[torch.Tensor]) -> dict:
    """AdamW's implementation for these tensors: torch's fused kernel (one pass over each
    tensor's parameter, gradient and moments) where it has one for their device, else the
    foreach one; never the per-tensor loop of Python calls."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices
    devices = {p.device.type for p in params}
    floating = all(p.is_floating_point() for p in params)
    if _plain(params) and floating and devices <= set(_get_fused_kernels_supported_devices()):
        return {"fused": True}
    return {"foreach": True}
