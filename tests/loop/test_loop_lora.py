"""Whole runs with train.lora: a killed LoRA run resumes to the uninterrupted one's adapters
and rollouts; the engine in a child process, the asynchronous loop and sparse payloads take
the adapters as the in-process engine does; the final adapter exports merged."""

from __future__ import annotations

import signal

import pytest
import torch
from loop_helpers import SMALL, fork_main
from safetensors.torch import load_file

from rollwise import models
from rollwise.bench.crash import compare, metric_rows, store_rows
from rollwise.cli import main
from rollwise.config import load_config
from rollwise.loop.run import train
from rollwise.training.lora import quiet_peft

pytestmark = pytest.mark.integration  # whole training loops

LORA = ["train.lora.rank=4", "train.lora.targets=all-linear", "train.lr=1e-2",
        "sync.check=true"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    train(load_config(None, SMALL + LORA + [f"run.root={root}", "run.name=reference"]))
    return root


def test_a_killed_lora_run_resumes_to_the_uninterrupted_one(reference):
    run = reference / "crashed"
    argv = ["train", *SMALL, *LORA, f"run.root={reference}", "run.name=crashed"]
    assert fork_main(argv, "train:5") == -signal.SIGKILL
    assert fork_main(["train", "--resume", str(run)]) == 0
    assert compare(reference / "reference", run) == []  # metrics, rollouts, adapters


def test_the_run_trains_and_sends_only_adapters(reference):
    rows = metric_rows(reference / "reference")[1:]
    model = models.load_model(reference / "reference" / "model")[0]  # loads merged
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    adapter = load_file(reference / "reference" / "model" / "adapter_model.safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    assert all(r["sync/full_bytes"] == adapter_bytes for r in rows)
    assert all(r["sync/bytes"] < model_bytes / 3 for r in rows)
    assert rows[-1]["train/grad_norm"] > 0


@pytest.mark.parametrize("placement", [["sync.transport=process"], ["sync.mode=sparse"]],
                         ids=["child-process", "sparse"])
def test_every_placement_samples_what_the_in_process_engine_does(reference, placement):
    """sync.check compares the engine's adapters with the trainer's after every sync; the
    same rollouts show the merged weights are the same too."""
    name = placement[0].replace("=", "-")
    train(load_config(None, SMALL + LORA + placement + [f"run.root={reference}",
                                                        f"run.name={name}"]))
    assert store_rows(reference / name) == store_rows(reference / "reference")


def test_the_asynchronous_loop_trains_lora_against_kept_adapter_snapshots(reference):
    """Stale tokens are corrected against the adapters of the version that sampled them."""
    out = train(load_config(None, SMALL + LORA + [
        f"run.root={reference}", "run.name=async", "loop.mode=async", "loop.max_staleness=1",
        "train.correction.mode=tis", "train.correction.anchor=version",
        "train.correction.snapshots=2"]))
    rows = metric_rows(reference / "async")
    assert [r["step"] for r in rows] == list(range(7)) and out["tokens_trained"] > 0
    assert max(r["staleness/max"] for r in rows[1:]) <= 1
    assert max(r["staleness/max"] for r in rows[1:]) == 1  # some tokens were stale
    assert all(r.get("train/dropped_tokens/no_snapshot", 0) == 0 for r in rows[1:])


def test_export_merge_writes_the_model_the_adapter_computes(reference, tmp_path):
    from peft import PeftModel
    folder = reference / "reference" / "model"
    assert main(["export", str(folder), "--merge", "--out", str(tmp_path / "merged")]) == 0
    merged = models.load_model(tmp_path / "merged")[0]
    assert not any("lora" in k for k in merged.state_dict())
    base = models.load_model(models.adapter_base(folder))[0]
    assert models.model_config(folder).to_dict() == base.config.to_dict()  # the base's
    with quiet_peft():
        unmerged = PeftModel.from_pretrained(base, str(folder)).eval()
    ids = torch.tensor([[5, 9, 12, 7, 3, 20]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, unmerged(ids).logits, atol=1e-5)
    assert main(["export", str(tmp_path / "merged"), "--merge"]) == 2  # a full model: refused


@pytest.mark.parametrize("strategy, extra", [
    ("latr", ["generate.strategy=latr", "generate.latr.tau_abs=0", "generate.latr.tau_rel=1",
              "generate.latr.ages=[2]", "generate.max_new_tokens=12", "sft.steps=0"]),
    ("episode", ["task.name=calc", "generate.strategy=episode", "generate.env=tools",
                 "generate.tools=[calculator]", "generate.tool_format=plain",
                 "generate.max_new_tokens=24", "generate.max_turns=3", "filter.reward=env",
                 "filter.drop_equal_reward_groups=false"]),
])
def test_trees_and_episodes_train_lora(tmp_path, strategy, extra):
    """Forked trees and multi-turn episodes run on the engine's merged weights; every sync
    is checked against the trainer's adapters (sync.check)."""
    small = [o for o in SMALL if not o.startswith(("filter.reward", "train.steps"))]
    train(load_config(None, small + LORA + extra + [f"run.root={tmp_path}", "train.steps=2",
                                                    f"run.name={strategy}"]))
    rows = metric_rows(tmp_path / strategy)[1:]
    assert [r["policy/version"] for r in rows] == [1, 2]
    assert all(r["sync/full_bytes"] == rows[0]["sync/full_bytes"] for r in rows)
    if strategy == "latr":
        assert sum(r.get("decisions/generate/fork/latr_branch", 0) for r in rows) > 0
    assert (tmp_path / strategy / "model" / "adapter_model.safetensors").exists()
