"""Engine side of LoRA training: the engine keeps its base weights, receives only the adapter
tensors through the weight sync, and merges them into the weights generation reads.

    engine.use_adapters(spec)     # from now on weight sync writes the adapters
    ... payload applied ...        # then weights_written() -> adapters.merge()

Merged rather than run as low-rank terms in the forward pass: a merge costs one (out x r) @
(r x in) product per target and sync, the forward then costs what the base model's does; the
low-rank terms cost two extra small products per target on every decode step (BENCHMARKS.md,
"LoRA", measures both). The merge writes W0 + (B @ A) * scale from a kept copy of the base
weights W0, so nothing accumulates over syncs (adding each new delta to W would), and in
float32 it is bit for bit what peft's own merge (merge_and_unload) computes. Cost: one copy of
the targeted base weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """One linear layer with an adapter: y = x W^T + scale * x A^T B^T."""

    module: str  # the layer's name in the Hugging Face model, e.g. model.layers.0.self_attn.q_proj
    rank: int
    in_features: int
    out_features: int
    scale: float

    @property
    def weight(self) -> str:
        return f"{self.module}.weight"

    @property
    def a(self) -> str:
        return f"{self.module}.lora_A"

    @property
    def b(self) -> str:
        return f"{self.module}.lora_B"


@dataclass(frozen=True)
class AdapterSpec:
    """What an engine needs to apply a trainer's adapters (picklable: it crosses processes)."""

    targets: tuple[Target, ...]

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Every adapter tensor's name and shape, as the trainer sends them."""
        out = {}
        for t in self.targets:
            out[t.a], out[t.b] = (t.rank, t.in_features), (t.out_features, t.rank)
        return out


class MergedAdapters:
    """The adapter tensors weight sync writes into, and their merge into `weights` (an
    engine's Hugging Face-layout tensors, written in place)."""

    def __init__(self, spec: AdapterSpec, weights: dict[str, torch.Tensor]):
        missing = [t.weight for t in spec.targets if t.weight not in weights]
        if missing:
            raise ValueError(f"the adapters target weights this engine's model does not have: "
                             f"{missing[:3]}")
        self.spec = spec
        self.weights = {t.weight: weights[t.weight] for t in spec.targets}
        for t in spec.targets:
            w = self.weights[t.weight]
            if tuple(w.shape) != (t.out_features, t.in_features):
                raise ValueError(f"{t.weight}: the engine's shape {tuple(w.shape)}, the "
                                 f"adapter's ({t.out_features}, {t.in_features})")
        self.base = {n: w.detach().clone() for n, w in self.weights.items()}
        w = next(iter(self.weights.values()), torch.empty(0))
        self.tensors = zero_adapters(spec, w.dtype, w.device)

    @torch.no_grad()
    def merge(self) -> None:
        """W = W0 + (B @ A) * scale for every target, computed in float32 (peft's order)."""
        for t in self.spec.targets:
            w = self.weights[t.weight]
            delta = (self.tensors[t.b].float() @ self.tensors[t.a].float()) * t.scale
            w.copy_(self.base[t.weight].float() + delta)


def zero_adapters(spec: AdapterSpec, dtype: torch.dtype, device=None) -> dict[str, torch.Tensor]:
    """The adapter tensors before the first payload: zeros, no change to the model (peft
    starts B at 0, so the trainer's model is the base too)."""
    return {n: torch.zeros(s, dtype=dtype, device=device) for n, s in spec.shapes().items()}


def save_peft_adapter(spec: AdapterSpec, tensors: dict[str, torch.Tensor], folder) -> None:
    """The adapters as a peft folder (adapter_config.json, adapter_model.safetensors), the
    format vLLM loads a LoRA adapter from. One rank and scale for every target."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file
    rank, scale = uniform(spec)
    suffixes = sorted({t.module.rsplit(".", 1)[-1] for t in spec.targets})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
              "lora_alpha": scale * rank, "target_modules": suffixes, "bias": "none",
              "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False,
              "modules_to_save": None}
    out = {}
    for t in spec.targets:
        out[f"base_model.model.{t.module}.lora_A.weight"] = tensors[t.a].contiguous()
        out[f"base_model.model.{t.module}.lora_B.weight"] = tensors[t.b].contiguous()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(out, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(config))


def uniform(spec: AdapterSpec) -> tuple[int, float]:
    """(rank, scale) shared by every target; ValueError when they differ."""
    pairs = {(t.rank, t.scale) for t in spec.targets}
    if len(pairs) != 1:
        raise ValueError(f"the adapters have several ranks or scales ({sorted(pairs)[:3]}); "
                         f"one is needed here")
    return next(iter(pairs))
