"""bench loop (the loop's generation against the engine alone on the same requests), bench
trainer (the update beside the matrix peak) and the GPU check's CPU mode, on the tiny model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollwise.bench import loop, trainer
from rollwise.devices import native_bf16
from tests.loop_helpers import SMALL

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def tiny_config(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("model: {hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
                    "intermediate_size: 64}\ncontrol: {prompts_per_step: 6}\n"
                    "generate: {group_size: 4}\n")
    return path


@pytest.mark.integration
def test_bench_loop_replays_each_step_at_its_own_shape(tiny_config, tmp_path, capsys):
    overrides = [o for o in SMALL if not o.startswith(("train.steps", "run.eval_every"))]
    assert loop.main(["--config", str(tiny_config), "--steps", "2", "--root",
                      str(tmp_path / "runs"), "--json", *overrides]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    run = tmp_path / "runs" / "bench-loop"
    metrics = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").open())}
    assert [r["step"] for r in out["rows"]] == [1, 2]
    for r in out["rows"]:
        assert r["tokens"] == metrics[r["step"]]["tokens/generated"]
        assert r["engine_alone_s"] > 0 and r["loop_over_engine"] > 0
        assert r["runner_alone_s"] > 0  # the same requests through engine.graph=off
        step_with_runner = r["step_s"] - r["loop_generate_s"] + r["runner_alone_s"]
        assert r["step_over_runner_step"] == pytest.approx(r["step_s"] / step_with_runner)
    # the first step's phase times also hold what ran before it (the held-out evaluation)
    assert 0 <= out["rows"][1]["score_share"] < 1
    assert out["median_loop_over_engine"] == out["rows"][1]["loop_over_engine"]
    stored = loop.step_requests(run)
    assert sum(n for _, n in stored[1]) == out["rows"][0]["tokens"]


@pytest.mark.integration
def test_bench_trainer_arms_report_against_their_dtype_peak(tiny_config, capsys):
    assert trainer.main(["--config", str(tiny_config), "--arms", "fp32+loopopt,bf16+ckpt+mb256",
                         "--repeats", "1", "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    fp32, bf16 = out["rows"]
    assert "error" not in fp32 and "error" not in bf16, out["rows"]
    assert fp32["tokens"] == bf16["tokens"]  # the same batch for every arm
    assert bf16["peak_flops"] > 0 and fp32["peak_flops"] > 0  # each against its own peak
    native = native_bf16("cpu")  # bf16 products in hardware outrun float32's; emulated, an
    if native:  # n x n product is far below, and no ceiling on what the trainer's kernels reach
        assert bf16["peak_flops"] > fp32["peak_flops"]
    for r in (fp32, bf16) if native else (fp32,):
        assert r["tokens_per_s"] > 0 and 0 < r["of_peak"] < 1
    assert bf16["tokens_per_s"] > 0 and bf16["of_peak"] > 0


def test_bench_trainer_refuses_a_bad_arm_before_any_run(tiny_config):
    with pytest.raises(ValueError, match="unknown option 'fast'"):
        trainer.main(["--config", str(tiny_config), "--arms", "fp32,bf16+fast"])
    with pytest.raises(ValueError, match="start with fp32 or bf16"):
        trainer.arm_settings("fp16")


def test_an_arm_uses_what_it_names_not_the_configs_defaults():
    import torch
    assert trainer.arm_settings("bf16") == (torch.bfloat16, {"gradient_checkpointing": False})
    assert trainer.arm_settings("fp32+ckpt+mb512") == (
        torch.float32, {"gradient_checkpointing": True, "max_tokens_per_microbatch": 512})
    assert trainer.arm_settings("bf16+full+loopopt") == (
        torch.bfloat16, {"gradient_checkpointing": False, "chunked_logits": False,
                         "loop_optimizer": True})


@pytest.mark.integration
def test_gpu_check_cpu_mode_runs_every_part(tmp_path):
    """What CI runs of scripts/gpu_check.sh: the tiny model on the CPU, every part passing."""
    out = tmp_path / "check.json"
    env = os.environ | {"GPU_CHECK_DEVICE": "cpu", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["parts"]) == {"decode", "bench_gpu", "train", "fsdp2", "profile"}
    assert all(p["ok"] for p in result["parts"].values())
    assert result["parts"]["fsdp2"]["max_weight_gap"] < 1e-5 < \
        result["parts"]["fsdp2"]["max_weight_change"]
    for run in ("builtin_decode", "hf_decode", "train_update", "train_update_without_levers",
                "train_update_attention_mask", "train_update_compiled_blocks"):
        prof = result["parts"]["profile"][run]
        assert prof["wall_s"] > 0 and prof["top_ops"] and prof["device_busy_s"] is None
        assert all(op["op"].startswith("aten::") and op["calls"] > 0 for op in prof["top_ops"])
    assert {r["part"] for r in result["parts"]["bench_gpu"]["tiny"]["rows"]} == {"train"}
    rows = result["parts"]["decode"]["tiny"]["rows"]
    measured = {(r["backend"], r["profile"]) for r in rows if "skipped" not in r}
    assert {("graph", "equal"), ("builtin", "equal"), ("hf", "equal"), ("graph", "longtail"),
            ("builtin", "longtail")} <= measured
    launches = result["parts"]["decode"]["launches"]
    assert launches["forward_passes"] > 0 and launches["host_launches_per_pass"] is None
