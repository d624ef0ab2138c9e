"""LoRA training (train.lora): the policy wrapped with peft, only the adapters trainable.

    model = wrap(model, cfg.train.lora)       # a peft model; the base weights frozen
    spec = adapter_spec(model)                 # what an engine needs to apply them
    adapter_tensors(model, spec)               # the tensors weight sync sends, by engine name

Checkpoints keep the adapters (peft's state-dict names) and a fingerprint of the base weights,
so a resume on a different base model stops with a clear error instead of training on it.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from rollwise.config import LoraConfig
from rollwise.engine.adapters import AdapterSpec, Target


def wrap(model, cfg: LoraConfig, seed: int = 0):
    """`model` with LoRA adapters on cfg.targets (peft injects them in place), their random
    start drawn from `seed` alone: the same adapters whatever ran before (a warm start
    trained now or loaded from its cache)."""
    from peft import LoraConfig as PeftLoraConfig  # peft: imported when LoRA is on
    from peft import get_peft_model
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha or 2 * cfg.rank,
                              lora_dropout=cfg.dropout, target_modules=cfg.targets,
                              bias="none", task_type="CAUSAL_LM")
    try:
        devices = list(range(torch.cuda.device_count()))
        with quiet_peft(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return get_peft_model(model, peft_cfg)
    except ValueError as e:  # peft names the targets it did not find
        raise ValueError(f"train.lora.targets={cfg.targets!r}: {e}") from None


@contextmanager
def quiet_peft():
    """peft asks transformers a since-renamed question (is_gradient_checkpointing): its
    deprecation warning is peft's to fix, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                category=FutureWarning)
        yield


def adapter_spec(model) -> AdapterSpec:
    """Each adapted linear layer of a wrapped model, named as in the unwrapped model."""
    from peft.tuners.lora import LoraLayer
    targets = []
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, LoraLayer):
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            targets.append(Target(name, a.shape[0], a.shape[1], b.shape[0],
                                  float(module.scaling["default"])))
    return AdapterSpec(tuple(targets))


def adapter_tensors(model, spec: AdapterSpec) -> dict[str, torch.Tensor]:
    """The adapters' current values under the names AdapterSpec gives them."""
    modules = dict(model.get_base_model().named_modules())
    out = {}
    for t in spec.targets:
        m = modules[t.module]
        out[t.a] = m.lora_A["default"].weight.detach()
        out[t.b] = m.lora_B["default"].weight.detach()
    return out


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapters as peft saves them (what a checkpoint or a snapshot keeps)."""
    from peft import get_peft_model_state_dict
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def load_adapter_state(model, state: dict[str, torch.Tensor]) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    expected = set(get_peft_model_state_dict(model))
    if set(state) != expected:
        extra, missing = sorted(set(state) - expected), sorted(expected - set(state))
        raise ValueError(f"the saved adapters do not fit this model's (train.lora differs?): "
                         f"missing {missing[:3]}, unexpected {extra[:3]}")
    set_peft_model_state_dict(model, state)


@torch.no_grad()
def base_fingerprint(model) -> torch.Tensor:
    """Per frozen tensor, the float64 sum of its values and of their squares: cheap, and
    different for any other base model a resume could be given."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return torch.tensor([[p.double().sum(), p.double().square().sum()] for p in frozen],
                        dtype=torch.float64)


def check_base(here: torch.Tensor, saved: torch.Tensor) -> None:
    """Two base_fingerprint results: the same base weights, or a ValueError saying so."""
    if here.shape != saved.shape or not torch.equal(here, saved):
        raise ValueError("the checkpoint's LoRA adapters were trained on other base weights "
                         "than this run's model: resume with the same model.path (or run.init)")
