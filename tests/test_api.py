"""The Python entry point (rollwise.train). The README's example runs as written in
tests/test_doc_examples.py, with every other code block of the documents."""

import os
import threading
from pathlib import Path

import pytest

import rollwise
from rollwise import models
from rollwise.config import ConfigError, ModelConfig
from rollwise.stages.filter.base import Item
from rollwise.stages.filter.python_fn import CallableVerifier
from rollwise.types import Problem

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1], "tier": "ab"[a % 2]}
        for a in range(10, 30) for b in range(10, 20)]
QUICK = {"train": {"steps": 2}, "control": {"prompts_per_step": 4},
         "generate": {"group_size": 2, "max_new_tokens": 4},
         "filter": {"workers": 0}}


def exact(response: str, problem) -> float:
    return float(response.strip() == problem.answer)


def trl_style(prompts, completions, answer, tier, **kwargs):
    """TRL's reward_funcs signature: whole batches, dataset columns as keyword lists."""
    return [float(c.strip() == a) + (0.5 if t == "a" else 0.0)
            for c, a, t in zip(completions, answer, tier)]


@pytest.fixture
def small_model():
    return models.build(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64), seed=0)


def test_train_takes_python_objects_and_returns_the_summary(tmp_path, small_model):
    model, tok = small_model
    summary = rollwise.train(model=model, tokenizer=tok, dataset=ROWS, reward=[exact, trl_style],
                             run={"root": str(tmp_path), "log": "quiet", "report": False},
                             **{"run.name": "objects"}, **QUICK)
    assert summary["steps"] == 2 and summary["rollouts"] == 2 * 4 * 2
    cfg = rollwise.load_config(Path(summary["run_dir"]) / "config.yaml")
    # a function named like a built-in verifier gets its own name, never shadowing it
    assert cfg.filter.reward == {"exact_fn": 1.0, "trl_style": 1.0} and cfg.task.name == "file"
    from rollwise import registry
    assert registry.resolve("verifier", "exact").__name__ == "build_exact"
    assert cfg.run.name == "objects" and cfg.train.steps == 2


def test_trl_style_rewards_get_the_dataset_columns():
    v = CallableVerifier(trl_style)
    assert v.batched and not v.isolated
    p = [Problem(str(i), r["prompt"], r["answer"], data=r) for i, r in enumerate(ROWS[:3])]
    verdicts = v.score([Item(r["answer"], q) for r, q in zip(ROWS[:3], p)])
    assert [x.rewards["trl_style"] for x in verdicts] == [1.5, 1.5, 1.5]


def test_per_sample_rewards_fail_alone_and_module_functions_run_isolated():
    def flaky(response, problem):
        if response == "boom":
            raise RuntimeError("bad sample")
        return 1.0
    v = CallableVerifier(flaky)
    assert v.isolated  # a closure goes to a worker process by value (cloudpickle)
    lock = threading.Lock()
    held = CallableVerifier(lambda response, problem: float(lock.locked()))
    assert not held.isolated  # what refers to a lock cannot be copied there: it runs here
    out = v.score([Item("ok", Problem("a", "q", "1")), Item("boom", Problem("b", "q", "1"))])
    assert out[0].rewards == {"flaky": 1.0} and out[1].failed == "error"
    assert "bad sample" in out[1].info
    assert CallableVerifier(exact).isolated  # an importable function goes to the workers


def test_bad_api_input_is_named(tmp_path):
    with pytest.raises(TypeError, match="not callable"):
        rollwise.train(dataset=ROWS, reward=42, run={"root": str(tmp_path)})
    with pytest.raises(ConfigError, match="train.stpes"):
        rollwise.train(dataset=ROWS, **{"train.stpes": 3})
    with pytest.raises(TypeError, match="list of dicts or a datasets.Dataset"):
        rollwise.train(dataset="data.jsonl", run={"root": str(tmp_path), "log": "quiet"},
                       model=models.build(ModelConfig(num_layers=1), 0)[0],
                       tokenizer=models.char_tokenizer())


def test_a_datasets_dataset_is_a_dataset(tmp_path, small_model):
    datasets = pytest.importorskip("datasets")
    model, tok = small_model
    summary = rollwise.train(model=model, tokenizer=tok, reward=exact,
                             dataset=datasets.Dataset.from_list(ROWS),
                             run={"root": str(tmp_path), "log": "quiet", "report": False},
                             **QUICK)
    assert summary["rollouts"] == 2 * 4 * 2


SCRIPT_WITH_A_HANGING_REWARD = '''
import time, rollwise

def reward(response, problem):  # defined in the script: sent to its worker by value
    if int(problem.answer[::-1]) % 2 == 0:  # half the problems
        time.sleep(3600)  # a hang: the per-sample limit must end it
    return float(response.strip() == problem.answer)

rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1], "solution": str(a + b)[::-1]}
        for a in range(10, 40) for b in range(10, 30)]
rollwise.train({"model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2,
                          "num_kv_heads": 1, "intermediate_size": 64},
                "sft": {"steps": 10}, "train": {"steps": 1}, "task": {"eval_size": 8},
                "control": {"prompts_per_step": 8}, "generate": {"group_size": 2},
                "filter": {"workers": 1, "timeout_s": 1.0},
                "run": {"root": "runs", "name": "hang", "log": "plain", "report": False,
                        "tensorboard": False, "threads": 1}},
               dataset=rows, reward=reward)
'''


@pytest.mark.integration
def test_a_reward_defined_in_a_script_is_bounded_by_its_time_limit(tmp_path):
    """The README's way to write a reward, in a script (its __main__), hanging on some
    samples: the run ends, those samples fail with `timeout` and are never trained, and no
    warning says the reward runs unbounded."""
    import subprocess
    import sys

    import pyarrow.parquet as pq
    (tmp_path / "train.py").write_text(SCRIPT_WITH_A_HANGING_REWARD)
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no time limit" not in done.stdout + done.stderr
    rows = [r for f in sorted((tmp_path / "runs/hang/rollouts").glob("step-*.parquet"))
            for r in pq.read_table(f).to_pylist()]
    hung = [r for r in rows if r["prompt_text"] and r["status"] == "failed"]
    assert hung and all("timeout" in (r["reward_info"] or "") or r["reward"] in (None, 0.0)
                        for r in hung)
