"""Device and memory settings that a CPU machine can check: the KV budget in bytes, vLLM's GPU
options refused on CPU, and no CUDA-only code imported or initialised here."""

import subprocess
import sys

import pytest
import torch

from rollwise.config import ConfigError, load_config
from rollwise.engine.backends import build_engine
from rollwise.engine.sizing import kv_budget_tokens, kv_bytes_per_token


def test_kv_budget_in_bytes_is_the_closed_form_in_tokens(tiny):
    model, _ = tiny
    c = model.config  # 2 layers, 1 KV head, head dim 16, float32
    per = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size //
                                                             c.num_attention_heads) * 4
    assert kv_bytes_per_token(c, torch.float32) == per
    assert kv_bytes_per_token(c, torch.bfloat16) == per // 2
    cfg = load_config(None, [f"engine.kv_budget_bytes={per * 100 + 5}"])
    assert kv_budget_tokens(cfg, model) == 100
    engine = build_engine(cfg, model)
    assert engine.scheduler.kv_budget_tokens == 100
    with pytest.raises(ConfigError, match="give one of them"):
        load_config(None, ["engine.kv_budget_bytes=1000", "engine.kv_budget_tokens=10"])
    with pytest.raises(ValueError, match="holds no token"):
        kv_budget_tokens(load_config(None, ["engine.kv_budget_bytes=8"]), model)


def test_vllm_sleep_mode_on_cpu_is_refused_before_vllm_starts(tiny, tmp_path):
    model, tok = tiny
    cfg = load_config(None, ["engine.backend=vllm", "engine.sleep_level=1"])
    with pytest.raises(ValueError, match="sleep_level = 1 needs vLLM on a CUDA GPU"):
        build_engine(cfg, model, tok, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_nothing_cuda_only_is_imported_or_initialised_on_a_cpu_machine(tmp_path):
    code = f"""
import sys, torch
import rollwise
from rollwise.config import load_config
from rollwise.loop.run import Run
from rollwise.report.progress import Progress
cfg = load_config(None, ["run.root={tmp_path}", "model.path=" + {str(tmp_path / 'm')!r},
                         "control.prompts_per_step=2", "generate.group_size=2",
                         "filter.workers=0", "run.log=quiet"], check_files=False)
from rollwise import models
m, t = models.build(cfg.model.model_copy(update={{"path": None}}))
models.save(m, t, {str(tmp_path / 'm')!r})
run = Run(cfg, Progress("quiet", 1))
run.step(1)
bad = [n for n in ("vllm", "flash_attn", "triton", "apex", "deepspeed") if n in sys.modules]
print("BAD", bad, "CUDA", torch.cuda.is_initialized(), "DEVICE", run.device)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last == "BAD [] CUDA False DEVICE cpu", last


class FakeLLM:
    """Records the calls VLLMEngine makes on vLLM's LLMEngine (sleep mode needs a GPU)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append((name, a[0] if a else k.get("level")))


def test_a_sleeping_vllm_engine_wakes_its_weights_before_the_update(tmp_path):
    from rollwise.engine.vllm import VLLMEngine
    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM here: drive the logic on a recorder
    engine.llm, engine.sleep_level, engine.sleeping = FakeLLM(), 1, False
    engine._live, engine._tied, engine._mirror, engine.version = {}, False, {}, 0
    engine.sleep()  # the trainer's turn
    assert engine.sleeping and engine.llm.calls == [("reset_prefix_cache", None), ("sleep", 1)]
    engine.weights_written(1)  # after the step: weights woken, written in place, then the KV
    names = [c[0] for c in engine.llm.calls]
    assert names == ["reset_prefix_cache", "sleep", "wake_up", "collective_rpc", "wake_up",
                     "reset_prefix_cache"]
    wakes = [c[1] for c in engine.llm.calls if c[0] == "wake_up"]
    assert wakes == [["weights"], ["kv_cache"]]
    assert not engine.sleeping and engine.version == 1
    engine._live = {1: object()}
    with pytest.raises(RuntimeError, match="still running"):
        engine.sleep()  # never sleep under a running request


GIB = 2**30


def test_vllm_kv_cache_is_sized_within_what_the_trainer_leaves(tiny, monkeypatch):
    """Beside the trainer on CPU, vLLM gets a KV budget: what a step's sequences can use,
    within half of the memory left once the trainer and the engine's weights are counted;
    an explicit budget that does not fit, or holds no full-length sequence, is refused."""
    from rollwise.engine import sizing
    model, _ = tiny
    n = sum(p.numel() for p in model.parameters())
    per = sizing.kv_bytes_per_token(model.config, torch.float32)
    monkeypatch.setattr(sizing, "memory_available", lambda: 10 * GIB)
    left = 10 * GIB - 16 * n - 2 * 4 * n
    cfg = load_config(None, ["control.prompts_per_step=4", "generate.group_size=2",
                             "generate.max_new_tokens=32"])
    assert sizing.vllm_kv_budget_bytes(cfg, model) == 4 * 2 * (32 + 1024) * per  # the need
    big = load_config(None, ["control.prompts_per_step=4096", "generate.group_size=64"])
    assert sizing.vllm_kv_budget_bytes(big, model) == left // 2  # capped by the memory
    kwargs = sizing.vllm_kwargs(cfg, model)
    assert kwargs["kv_cache_memory_bytes"] == 4 * 2 * (32 + 1024) * per
    assert "kv_cache_memory_bytes" not in sizing.vllm_kwargs(cfg, model, colocated=False)
    with pytest.raises(ValueError, match=r"12\.0 GiB KV cache does not fit: 10\.0 GiB"):
        sizing.vllm_kv_budget_bytes(load_config(None, [f"engine.kv_budget_bytes={12 * GIB}"]),
                                      model)
    with pytest.raises(ValueError, match="less than one sequence of the model's 64 positions"):
        sizing.vllm_kv_budget_bytes(load_config(None, [f"engine.kv_budget_bytes={per}"]),
                                      model)
    tokens = load_config(None, ["engine.kv_budget_tokens=1000"])
    assert sizing.vllm_kv_budget_bytes(tokens, model) == 1000 * per
    assert "kv_cache_memory_bytes" not in sizing.vllm_kwargs(tokens, model)


def test_a_bad_vllm_kv_budget_stops_before_the_model_is_saved(tiny, tmp_path):
    model, tok = tiny
    cfg = load_config(None, ["engine.backend=vllm", f"engine.kv_budget_bytes={10**15}"])
    with pytest.raises(ValueError, match="does not fit"):
        build_engine(cfg, model, tok, tmp_path)
    assert not (tmp_path / "engine-model").exists()


def test_vllm_returns_the_whole_vocabulary_only_when_it_is_small():
    from rollwise.engine.sizing import entropy_logprobs
    assert entropy_logprobs(53) == -1  # exact entropy, as the built-in engine's
    assert entropy_logprobs(49152) == 20  # a real vocabulary: the top 20 and the sampled one
