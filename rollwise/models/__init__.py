"""Tokenizer and model factory: a character tokenizer and a tiny Hugging Face causal LM built
from a config, and load/save of any Hugging Face causal LM: a local folder (safetensors), a
model of rollwise's catalog fetched with `rollwise models get` (rollwise.models.fetch), or a
hub id resolved by transformers."""

from __future__ import annotations

import json
import os
import shutil
import weakref
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)
from transformers.utils import logging as hf_logging

from rollwise import catalog
from rollwise.config import ModelConfig
from rollwise.models import fetch  # noqa: F401 (rollwise.models.fetch, as before)

hf_logging.disable_progress_bar()  # no per-save/load bars in the run's progress display

# Characters of the built-in tasks, plus a few letters for user prompts and hints.
CHARSET = "0123456789+-*=;#.,:?() abcdefghijklmnopqrstuvwxyz"
SPECIALS = ["<pad>", "<eos>", "<unk>"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FULL_PRECISION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def to_dtype(model, dtype: str, for_training: bool = False):
    """The model in `dtype`. for_training: a cast from float32 to bf16 or fp16 keeps the
    float32 values it rounded away, by parameter name, until take_full_precision(model) takes
    them: the trainer's master weights start from them (rollwise.training.precision says
    why). Without it nothing is kept (an engine or an evaluation has no use for them)."""
    full = {n: p.detach() for n, p in model.named_parameters()
            if p.dtype == torch.float32} if for_training else {}
    _cast(model, DTYPES[dtype])  # swaps each parameter's data: `full` keeps the old
    if DTYPES[dtype] != torch.float32 and full:
        _FULL_PRECISION[model] = full
    return model


@torch.no_grad()
def _cast(model, dtype: torch.dtype) -> None:
    """Parameters and saved floating buffers to dtype, as transformers' loading in a dtype
    does. Buffers that are not saved (rotary inv_freq) stay as computed, in float32: in bf16
    they would shift every position's rotation (model.to(bf16) casts them too)."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b.is_floating_point() and name not in module._non_persistent_buffers_set:
                module._buffers[name] = b.to(dtype)


def take_full_precision(model) -> dict[str, torch.Tensor] | None:
    """The float32 values to_dtype kept for this model, handed over once (None if none)."""
    return _FULL_PRECISION.pop(model, None)


def char_tokenizer(charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """One token per character. Load a saved one with PreTrainedTokenizerFast.from_pretrained
    (AutoTokenizer on a qwen2 folder would swap in a byte-level pre-tokenizer)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(dict.fromkeys(charset)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def tiny_model(cfg: ModelConfig, vocab_size: int, pad_id: int, eos_id: int):
    common = dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size,
                  max_position_embeddings=cfg.max_positions, tie_word_embeddings=True,
                  pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None)
    config = Qwen2Config(**common) if cfg.arch == "qwen2" else LlamaConfig(**common)
    model = AutoModelForCausalLM.from_config(config)
    return to_dtype(model, cfg.dtype)


resolve_path = catalog.resolve_model_path  # where a model comes from, checked without torch


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    return _from_pretrained(PreTrainedTokenizerFast, resolve_path(path))


def load_model(path: str | Path, dtype: str = "float32", for_training: bool = False):
    """A model folder, catalog name or hub id; a LoRA adapter folder (what a run with
    train.lora saves) loads as its base model with the adapter merged in (in `dtype`, so
    nothing is kept for training). for_training: see to_dtype."""
    where = resolve_path(path)
    if is_adapter(where):
        return merged_adapter(where, dtype), load_tokenizer(where)
    model = _from_pretrained(AutoModelForCausalLM, where, dtype="auto")  # the saved dtype
    return to_dtype(model, dtype, for_training), load_tokenizer(where)


def model_config(path: str | Path):
    """The Hugging Face config of what load_model(path) loads (an adapter's: its base's)."""
    where = resolve_path(path)
    if is_adapter(where):
        return model_config(adapter_base(where))
    return _from_pretrained(AutoConfig, where)


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def adapter_base(path: str | Path) -> str:
    """The base model an adapter folder was trained on (recorded when it was saved)."""
    base = json.loads((Path(path) / "adapter_config.json").read_text()).get(
        "base_model_name_or_path")
    if not base:
        raise FileNotFoundError(f"{path}: the adapter does not record its base model; merge "
                                f"it with 'rollwise export {path} --merge --base MODEL'")
    return base


def merged_adapter(path: str | Path, dtype: str = "float32", base: str | None = None):
    """The base model with the adapter in `path` merged into its weights (a plain model)."""
    from peft import PeftModel  # peft: only for adapter folders

    from rollwise.training.lora import quiet_peft
    model, _ = load_model(base or adapter_base(path), dtype)
    with quiet_peft():
        return PeftModel.from_pretrained(model, str(path)).merge_and_unload()


def _from_pretrained(cls, where: str, **kwargs):
    try:
        return cls.from_pretrained(where, **kwargs)
    except OSError as e:
        if Path(where).is_dir():
            raise
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
        hint = ("HF_HUB_OFFLINE is set, so only the local cache is read: fetch it once "
                "online, or give a local folder" if offline else
                "check the id and the network, or give a local folder")
        raise FileNotFoundError(f"{where}: the Hugging Face hub could not provide it ({hint}; "
                                f"{type(e).__name__}: {str(e).splitlines()[0]})") from None


def build_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerFast:
    """The tokenizer `build(cfg)` gives, without building the model."""
    return load_tokenizer(cfg.path) if cfg.path else char_tokenizer()


def build(cfg: ModelConfig, seed: int = 0):
    """The configured model and tokenizer: from cfg.path, or a fresh tiny model."""
    if cfg.path:
        return load_model(cfg.path, cfg.dtype)
    tok = char_tokenizer()
    torch.manual_seed(seed)
    return tiny_model(cfg, len(tok), tok.pad_token_id, tok.eos_token_id), tok


def save(model, tokenizer, path: str | Path, state_dict: dict | None = None,
         base: str | None = None) -> None:
    """Save as a Hugging Face folder (safetensors), atomically: write aside, then rename.
    state_dict: other values for the model's tensors (e.g. cast to an engine's dtype). A
    peft model saves its adapter alone, recording `base` as the model it applies to."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if base is not None and hasattr(model, "peft_config"):
        model.peft_config["default"].base_model_name_or_path = base
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())
