"""`rollwise bench e2e --vs trl`: the settings handed to TRL match rollwise's (batch
arithmetic checked by TRL's own GRPOConfig, the reward by rollwise's scorer, the learning-rate
schedule by rollwise's Trainer), and the timing summary. A marked slow test runs TRL."""

import dataclasses
import json
import math

import pytest
import torch

from rollwise import models
from rollwise.bench import e2e
from rollwise.bench.e2e_trl import make_reward, rollwise_optimizer, trl_batch_args
from rollwise.config import ModelConfig, load_config
from rollwise.stages.filter import build_filter
from rollwise.tasks import load_task
from rollwise.training.trainer import Trainer, lr_factor
from rollwise.types import Sample


def test_batch_arithmetic_gives_prompts_times_group_per_generation():
    cfg = load_config(None, [])
    args = trl_batch_args(cfg)
    assert args == {"num_generations": 8, "per_device_train_batch_size": 256,
                    "steps_per_generation": 2, "gradient_accumulation_steps": 1}
    with pytest.raises(ValueError, match="train.minibatches = 3"):
        trl_batch_args(load_config(None, ["train.minibatches=3"]))
    micro = trl_batch_args(load_config(None, ["train.micro_batch_size=32"]))
    assert micro == {"num_generations": 8, "per_device_train_batch_size": 32,
                     "steps_per_generation": 16, "gradient_accumulation_steps": 8}
    with pytest.raises(ValueError, match="micro-batch of 48"):
        trl_batch_args(load_config(None, ["train.micro_batch_size=48"]))
    assert trl_batch_args(load_config(None, []), micro_batch=32) == micro


def test_trl_derives_the_same_generation_batch():
    pytest.importorskip("trl")
    from trl import GRPOConfig
    cfg = load_config(None, ["control.prompts_per_step=12", "generate.group_size=4",
                             "train.minibatches=3"])
    for micro in (0, 8):
        cfg.train.micro_batch_size = micro
        args = GRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False,
                          report_to="none", activation_checkpointing=False,
                          **trl_batch_args(cfg))
        assert args.generation_batch_size == 12 * 4  # completions per generation batch
        assert args.generation_batch_size // args.num_generations == 12  # prompts
        # optimizer steps per generation batch: train.minibatches
        assert args.steps_per_generation // args.gradient_accumulation_steps == 3


def test_trl_reward_is_rollwise_exact_answer():
    cfg = load_config(None, ["task.train_size=50", "task.eval_size=8"])
    task = load_task(cfg.task)
    from rollwise.stages.filter import make_scorer
    reward = make_reward(task, make_scorer("exact", task))
    problems = task.train[:20]
    # right (least-significant digit first), written the wrong way round, and junk
    texts = [p.solution for p in problems] + [p.answer for p in problems] + ["x"] * 20
    got = reward(texts, problem_id=[p.id for p in problems] * 3)
    samples = [Sample(prompt_id=p.id, prompt_ids=[1]) for p in problems * 3]
    build_filter(cfg.filter, task).score(samples, problems * 3, texts)
    assert got == [s.reward for s in samples]
    assert got[:20] == [1.0] * 20 and sum(got[40:]) == 0
    palindromes = sum(p.answer == p.answer[::-1] for p in problems)
    assert sum(got[20:40]) == palindromes  # reversed text is right only for palindromes


@pytest.mark.parametrize("warmup", [0, 3])
def test_learning_rate_schedule_matches_rollwise_trainer(warmup):
    cfg = load_config(None, ["train.steps=5", "train.lr=0.01", "train.lr_end_factor=0.2",
                             f"train.warmup_steps={warmup}"])
    model, tok = models.build(ModelConfig(hidden_size=16, num_layers=1, num_heads=2,
                                          num_kv_heads=1, intermediate_size=32))
    trainer = Trainer(model, cfg.train, pad_id=tok.pad_token_id)
    opt, sched = rollwise_optimizer(model, cfg, opt_steps_per_rl_step=2)
    assert type(opt) is type(trainer.optimizer)
    assert opt.defaults == trainer.optimizer.defaults  # lr, betas, eps, weight decay
    for rl_step in range(7):
        for _ in range(2):  # TRL steps its scheduler once per optimizer step
            assert opt.param_groups[0]["lr"] == pytest.approx(
                trainer.optimizer.param_groups[0]["lr"])
            opt.step()
            sched.step()
        trainer.optimizer.step()
        trainer.scheduler.step()
    # closed form at RL step s: min(1, (s+1)/3) * (1 - 0.8 * min(s, 5) / 5) * 0.01
    ramp = [1 / 3, 2 / 3, 1, 1, 1, 1, 1] if warmup else [1] * 7
    decay = [1, 0.84, 0.68, 0.52, 0.36, 0.2, 0.2]
    assert [lr_factor(cfg.train, s) for s in range(7)] == pytest.approx(
        [r * d for r, d in zip(ramp, decay)])


ROWS = [{"step": 0, "eval/pass1": 0.3},
        {"step": 1, "perf/step_seconds": 2.0},
        {"step": 2, "perf/step_seconds": 3.0, "eval/pass1": 0.5},
        {"step": 3, "perf/step_seconds": 1.0},
        {"step": 4, "perf/step_seconds": 4.0, "eval/pass1": 0.62}]


def test_time_to_target_uses_training_time_only():
    rows = e2e.rollwise_clock(ROWS)
    assert [r["train_seconds"] for r in rows] == [0.0, 2.0, 5.0, 6.0, 10.0]
    assert e2e.time_to_target(rows, 0.5, "train_seconds") == 5.0
    assert e2e.time_to_target(rows, 0.6, "train_seconds") == 10.0
    assert math.isinf(e2e.time_to_target(rows, 0.7, "train_seconds"))
    s = e2e.summarize("rollwise", 0, rows, 0.6)
    assert s["steps_to_target"] == 4 and s["seconds_per_step"] == 2.5
    assert (s["pass1_start"], s["pass1_final"], s["pass1_best"]) == (0.3, 0.62, 0.62)


def test_table_medians_and_not_reached():
    rows = e2e.rollwise_clock(ROWS)
    results = [e2e.summarize("rollwise", 0, rows, 0.5), e2e.summarize("rollwise", 1, rows, 0.5),
               e2e.summarize("trl", 0, rows, 0.9)]
    text = e2e.table(results, 0.5)
    assert "| trl | 0 | not reached |" in text
    assert "| **rollwise median** | | 5 |" in text
    assert "time to target TRL did not reach it" in text
    assert "time per step 1.00x" in text
    both = e2e.table([results[0], e2e.summarize("trl", 0, rows, 0.6)], 0.5)
    assert "time to target 0.50x" in both  # 5 s against TRL's 10 s


@pytest.mark.slow
def test_trl_runs_matched_and_starts_from_the_same_pass1(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    small = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
             "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=300",
             "task.eval_size=40", "sft.steps=30", "sft.eval_every=30", "train.steps=2",
             "control.prompts_per_step=6", "generate.group_size=4", "run.eval_every=1",
             "run.log=quiet", "run.tensorboard=false", f"run.root={tmp_path}"]
    warm = e2e.warm_model(load_config(None, small), log=lambda m: None)
    cfg = load_config(None, small + [f"run.init={warm}", "run.name=rw"])
    rw = e2e.run_rollwise(cfg, 0.99)
    cfg = load_config(None, small + [f"run.init={warm}", "run.name=trl"])
    trl = e2e.run_trl(cfg, warm, 0.99, log=lambda m: None)
    assert trl["pass1_start"] == rw["pass1_start"]  # same model, same evaluation
    assert trl["steps"] == rw["steps"] == 2
    rows = [json.loads(x) for x in open(tmp_path / "trl" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("eval/pass1" in r for r in rows) and "reward/mean" in rows[1]
    assert 0 < rows[1]["train_seconds"] < rows[2]["train_seconds"]


def test_recorder_keys_trl_logs_by_rollwise_step_and_excludes_eval_time(tmp_path, monkeypatch):
    from rollwise.bench import e2e_trl
    now = {"t": 0.0}
    monkeypatch.setattr(e2e_trl, "time", type("T", (), {"time": staticmethod(lambda: now["t"])}))

    def slow_eval(model):
        now["t"] += 10.0  # evaluation takes 10 s: not training time
        torch.rand(3)  # and draws random numbers (a model clone's init does)
        return {"eval/pass1": 0.5}
    cfg = load_config(None, ["train.steps=2", "run.eval_every=1", "control.prompts_per_step=4",
                             "generate.group_size=2"])
    rec = e2e_trl._Recorder(cfg, 2, slow_eval, tmp_path / "m.jsonl", log=lambda m: None)
    model = torch.nn.Linear(1, 1)
    rng = torch.get_rng_state()
    rec.start(model)
    assert torch.equal(torch.get_rng_state(), rng)  # TRL's sampling stream is untouched
    # transformers' order per optimizer step: on_step_end, then on_log; TRL logs the
    # generation metrics at the first optimizer step of each generation batch
    for gs, dt, logs in [(1, 3.0, {"reward": 0.25, "completions/mean_length": 3.0,
                                   "frac_reward_zero_std": 0.75}),
                         (2, 1.0, {"loss": 0.1}),
                         (3, 2.0, {"reward": 0.5, "completions/mean_length": 5.0,
                                   "frac_reward_zero_std": 0.5}),
                         (4, 2.0, {"reward": float("nan")})]:
        now["t"] += dt
        rec.on_step_end(gs, model)
        rec.on_log(gs, logs)
    rec.close()
    rows = [json.loads(x) for x in open(tmp_path / "m.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["reward/mean"] == 0.25 and rows[2]["reward/mean"] == 0.5  # nan ignored
    assert rows[1]["groups/mixed_share"] == 0.25
    assert rows[2]["tokens/generated"] == rows[2]["tokens/trained"] == 5.0 * 4 * 2
    assert [r["train_seconds"] for r in rows] == [0.0, 4.0, 8.0]  # evals (10 s each) excluded
    assert rows[2]["perf/step_seconds"] == 4.0


def test_trl_sees_the_prompt_ids_rollwise_generates_from(tmp_path):
    """TRL renders a conversational prompt with apply_chat_template(add_generation_prompt);
    the messages rollwise hands it (system prompt and template applied) give exactly the ids
    rollwise's engine is fed, and plain prompts the plain text."""
    from chat_model import build_chat_model

    from rollwise.bench.e2e_trl import trl_prompts
    from rollwise.config import TaskConfig
    from rollwise.tasks.prompts import Prompter
    tok = models.load_tokenizer(build_chat_model(tmp_path / "chat"))
    cfg = TaskConfig(name="gym:chain_sum", train_size=6, eval_size=2, system_prompt="Be brief.",
                     prompt_template="{prompt} Put the final answer in \\boxed{}.")
    task = load_task(cfg)
    prompter = Prompter.for_task(cfg, tok, task)
    data = trl_prompts(task, prompter)
    assert data["problem_id"] == [p.id for p in task.train]
    for messages, p in zip(data["prompt"], task.train):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        assert list(ids) == prompter.ids(p) and messages[0]["content"] == "Be brief."
    plain = Prompter(TaskConfig(chat_template="off"), tok)
    for text, p in zip(trl_prompts(task, plain)["prompt"], task.train):
        assert tok(text)["input_ids"] == plain.encode(p.prompt)


@pytest.mark.parametrize("dtype, bf16", [("float32", False), ("bfloat16", True)])
def test_trl_trains_in_the_precision_and_checkpointing_rollwise_does(dtype, bf16):
    from rollwise.bench.e2e_trl import checkpointing, trl_precision
    pytest.importorskip("trl")
    from trl import GRPOConfig
    cfg = load_config(None, [f"model.dtype={dtype}", "train.gradient_checkpointing=true"])
    assert trl_precision(cfg) == {"bf16": bf16}
    on = checkpointing(GRPOConfig, cfg.train.gradient_checkpointing)
    assert list(on.values()) == [True] and set(on) <= {f.name for f in
                                                       dataclasses.fields(GRPOConfig)}
    assert list(checkpointing(GRPOConfig, False).values()) == [False]


def test_a_precision_trl_cannot_match_stops_before_any_run(capsys, monkeypatch):
    monkeypatch.setattr(e2e, "_require_trl", lambda: None)
    monkeypatch.setattr(e2e, "warm_model", lambda *a: pytest.fail("work started"))
    with pytest.raises(ValueError, match="float16.*bfloat16 or float32"):
        e2e.main(["--vs", "trl", "model.dtype=float16"])
