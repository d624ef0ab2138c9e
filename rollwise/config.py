"""Typed configuration: one pydantic section per component, loaded from YAML plus
`section.key=value` overrides. Defaults are the embedded CPU run; a bad key, type or value
fails before any work with a message that names the field, the value and what is allowed.

    cfg = load_config("configs/default.yaml", ["train.lr=1e-4", "run.seed=1"])
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str | None = None
    """Local Hugging Face causal-LM folder. None builds the tiny model from the fields below."""
    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(4, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(512, gt=0)
    max_positions: int = Field(64, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class TaskConfig(Section):
    name: str = "arith"
    """'arith' (built-in tiers), 'gym:<reasoning-gym dataset>', or 'file' (JSONL/Parquet)."""
    tiers: dict[str, float] = {"add2": 0.35, "sub2": 0.35, "add3": 0.15, "chain": 0.15}
    """Built-in tiers and their share of the train mix (see rollwise.tasks.arith.TIERS)."""
    train_size: int = Field(20000, gt=0)
    eval_size: int = Field(400, gt=0)
    """Held-out prompts, split across tiers in the same shares as the train mix."""
    seed: int = 1234
    """Problem-set seed; independent of run.seed so every run sees the same problems."""
    path: str | None = None
    """For name='file': a .jsonl or .parquet file of (prompt, answer) rows."""
    eval_path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"


class EngineConfig(Section):
    backend: Literal["builtin"] = "builtin"
    max_batch: int = Field(1024, gt=0)
    """Most sequences decoded at once; larger requests are split."""


class GenerateConfig(Section):
    group_size: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    """0 disables top-k."""
    max_new_tokens: int = Field(8, gt=0)


class FilterConfig(Section):
    reward: str = "exact"
    """'exact', 'math_verify', or a user function 'package.module:function(sample)->float'."""
    drop_equal_reward_groups: bool = True
    """Drop groups whose rewards are all equal: their GRPO advantages are zero."""


class ControlConfig(Section):
    selector: Literal["uniform"] = "uniform"
    prompts_per_step: int = Field(64, gt=0)


class ReplayConfig(Section):
    enabled: bool = False


class TrainConfig(Section):
    steps: int = Field(60, ge=0)
    advantage: Literal["grpo"] = "grpo"
    loss: Literal["ppo_clip"] = "ppo_clip"
    lr: float = Field(3e-4, gt=0)
    lr_end_factor: float = Field(0.1, ge=0, le=1)
    """Linear decay to lr * lr_end_factor over the run (a constant rate swings late pass@1)."""
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    minibatches: int = Field(2, ge=1)
    epochs: int = Field(1, ge=1)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL estimate to the initial policy; 0 keeps no reference model."""


class SFTConfig(Section):
    steps: int = Field(1200, ge=0)
    batch_size: int = Field(64, gt=0)
    lr: float = Field(2e-3, gt=0)
    noise: float = Field(0.6, ge=0, le=1)
    """Share of worked solutions whose top answer digit is off by one, so RL has work to do."""
    eval_every: int = Field(100, gt=0)


class SyncConfig(Section):
    mode: Literal["full"] = "full"


class RunConfig(Section):
    name: str = "default"
    root: str = "runs"
    seed: int = 0
    eval_every: int = Field(10, gt=0)
    log: Literal["auto", "rich", "plain", "quiet"] = "auto"
    init: str | None = None
    """Start RL from this model folder instead of the (cached) warm start."""
    threads: int = Field(0, ge=0)
    """torch CPU threads; 0 keeps torch's default."""


class Config(Section):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    engine: EngineConfig = EngineConfig()
    generate: GenerateConfig = GenerateConfig()
    filter: FilterConfig = FilterConfig()
    control: ControlConfig = ControlConfig()
    replay: ReplayConfig = ReplayConfig()
    train: TrainConfig = TrainConfig()
    sft: SFTConfig = SFTConfig()
    sync: SyncConfig = SyncConfig()
    run: RunConfig = RunConfig()


class ConfigError(ValueError):
    """A config problem, phrased for the user."""


def _allowed_keys(loc: tuple) -> list[str]:
    model: Any = Config
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type) or not issubclass(
                field.annotation, BaseModel):
            break
        model = field.annotation
    return list(model.model_fields)


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(e["loc"][:-1])
            guess = difflib.get_close_matches(str(e["loc"][-1]), allowed, n=1)
            hint = f" Did you mean '{guess[0]}'?" if guess else ""
            lines.append(f"unknown key '{where}'.{hint} Allowed here: {', '.join(allowed)}")
        else:
            lines.append(f"{where} = {e.get('input')!r}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key part")
    return parts, yaml.safe_load(raw) if raw.strip() else None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} not found")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: '{p}' is not a section")
        node[parts[-1]] = value
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
