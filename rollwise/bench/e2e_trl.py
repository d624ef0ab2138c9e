"""TRL's GRPOTrainer set up to match a rollwise config, for `rollwise bench e2e --vs trl`.

Matched: the initial model and its tokenizer (the warm start and character tokenizer, or a
pretrained chat model), the train prompts (as the same chat messages, which TRL renders with the
same chat template and generation prompt, or the same plain text), the reward (rollwise's own
scorer for the config's ground-truth verifier: exact, math, ...), group size, prompts per step,
optimizer steps per generation batch (rollwise's train.minibatches), AdamW and its
learning-rate schedule, gradient clipping, clip range, GRPO advantages (group std scaling) and
sequence-mean-token-mean loss ("grpo"), temperature, max new tokens, no KL (beta=0),
precision (model.dtype: bf16 mixed precision or float32) and activation checkpointing.
Held-out pass@1 is measured by rollwise's evaluate() on a copy of TRL's model.

TRL counts optimizer steps; one rollwise step (one generation batch) is
`train.minibatches` of them, each accumulated over micro-batches of train.micro_batch_size
completions: per_device_train_batch_size = micro, gradient_accumulation_steps = prompts * group
/ minibatches / micro, steps_per_generation = prompts * group / micro (TRL's micro-steps).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from rollwise.config import Config
from rollwise.stages.filter import eval_scorer
from rollwise.training.trainer import lr_factor
from rollwise.types import Problem


def trl_batch_args(cfg: Config, micro_batch: int | None = None) -> dict:
    """GRPOConfig batch arithmetic giving rollwise's prompts x group per generation batch
    and train.minibatches optimizer steps on it, each accumulated over micro-batches of
    `micro_batch` completions (None: train.micro_batch_size; 0: one per optimizer step).
    Accumulation leaves the update as it is: it only bounds TRL's memory."""
    completions = cfg.control.prompts_per_step * cfg.generate.group_size
    mb = cfg.train.minibatches
    if cfg.train.minibatch_groups is not None:
        raise ValueError("train.minibatch_groups makes the optimizer steps per batch vary, "
                         "which TRL's fixed steps_per_generation cannot follow: unset it and "
                         "use train.minibatches")
    if completions % mb:
        raise ValueError(f"prompts_per_step * group_size = {completions} must divide by "
                         f"train.minibatches = {mb} to map onto TRL's batches")
    per_step = completions // mb
    micro = (cfg.train.micro_batch_size if micro_batch is None else micro_batch) or per_step
    if per_step % micro:
        raise ValueError(f"a micro-batch of {micro} must divide the {per_step} "
                         "completions of an optimizer step to map onto TRL's accumulation")
    return {"num_generations": cfg.generate.group_size, "per_device_train_batch_size": micro,
            "steps_per_generation": completions // micro,
            "gradient_accumulation_steps": per_step // micro}


def checkpointing(config_cls, on: bool) -> dict:
    """Activation checkpointing as rollwise's train.gradient_checkpointing (TRL turns it on
    by default): the field is `activation_checkpointing` from transformers 5,
    `gradient_checkpointing` before."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    key = "activation_checkpointing" if "activation_checkpointing" in names \
        else "gradient_checkpointing"
    return {key: on}


def trl_precision(cfg: Config) -> dict:
    """TRL's precision matching rollwise's model.dtype: for bfloat16, its bf16 mixed
    precision (float32 weights, bf16 autocast), as rollwise trains bf16 weights on float32
    masters; float32 otherwise."""
    if cfg.model.dtype == "float16":
        raise ValueError("bench e2e --vs trl: TRL's trainer has no float16 on a CPU; set "
                         "model.dtype=bfloat16 or float32")
    return {"bf16": cfg.model.dtype == "bfloat16"}


def make_reward(task, scorer):
    """TRL reward function: rollwise's scorer on each decoded completion, against the problem
    it answers (found by the dataset's problem_id column); a scorer failure scores 0."""
    by_id = {p.id: p for p in task.train}

    def verified_answer(completions: list, problem_id: list[str], **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [_score(scorer, t, by_id[pid]) for t, pid in zip(texts, problem_id)]
    return verified_answer


def _score(scorer, text: str, problem: Problem) -> float:
    try:
        return float(scorer(text, problem)[0])
    except Exception:  # a scorer failure scores 0, as an unscorable sample in evaluation
        return 0.0


def trl_prompts(task, prompter) -> dict[str, list]:
    """The dataset TRL trains on: each train problem's prompt as rollwise renders it (chat
    messages, system prompt and template applied; or the plain text) and its id."""
    render = prompter.messages if prompter.chat else prompter.render_text
    return {"prompt": [render(p.prompt) for p in task.train],
            "problem_id": [p.id for p in task.train]}


def rollwise_optimizer(model, cfg: Config, opt_steps_per_rl_step: int):
    """rollwise's AdamW (its kernel too) and schedule (trainer.lr_factor, per RL step),
    stepped once per TRL optimizer step."""
    from rollwise.training.precision import adamw_kernel
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                            **adamw_kernel(params))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(cfg.train, s // opt_steps_per_rl_step))
    return opt, sched


def run_trl(cfg: Config, task, warm_dir: Path, out_dir: Path, eval_fn, prompter,
            log=print, micro_batch: int | None = None) -> dict:
    """Train with TRL for cfg.train.steps rollwise-sized steps; eval_fn(model) -> metrics
    every cfg.run.eval_every steps (its time excluded). Writes metrics.jsonl rows in
    rollwise's format, so `rollwise report` can overlay the two frameworks."""
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        PreTrainedTokenizerFast,
        TrainerCallback,
    )
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    batch = trl_batch_args(cfg, micro_batch)
    mb = cfg.train.minibatches  # optimizer steps per generation batch
    model = AutoModelForCausalLM.from_pretrained(str(warm_dir), dtype=torch.float32)
    tok = PreTrainedTokenizerFast.from_pretrained(str(warm_dir))
    data = Dataset.from_dict(trl_prompts(task, prompter))
    args = GRPOConfig(
        output_dir=str(out_dir / "trl"), use_cpu=True, **trl_precision(cfg), use_vllm=False,
        seed=cfg.run.seed, max_steps=cfg.train.steps * mb, **batch,
        learning_rate=cfg.train.lr, weight_decay=cfg.train.weight_decay,
        max_grad_norm=cfg.train.grad_clip, max_completion_length=cfg.generate.max_new_tokens,
        temperature=cfg.generate.temperature, top_p=cfg.generate.top_p,
        top_k=cfg.generate.top_k, beta=0.0, num_iterations=cfg.train.epochs,
        epsilon=cfg.train.clip_low, epsilon_high=cfg.train.clip_high, loss_type="grpo",
        scale_rewards="group", mask_truncated_completions=False,
        **checkpointing(GRPOConfig, cfg.train.gradient_checkpointing),
        remove_unused_columns=False, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0)
    reward = make_reward(task, eval_scorer(cfg.filter, task))
    recorder = _Recorder(cfg, mb, eval_fn, out_dir / "metrics.jsonl", log)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=tok, optimizers=rollwise_optimizer(model, cfg, mb),
                          callbacks=[_callback(TrainerCallback, recorder)])
    trainer.remove_callback(PrinterCallback)  # TRL's per-step dicts; the recorder logs instead
    recorder.start(model)
    trainer.train()
    recorder.close()
    return {"rows": recorder.rows, "train_seconds": recorder.train_seconds}


class _Recorder:
    """Times TRL's training (evaluation excluded) and keeps rollwise-style metric rows.

    Transformers calls on_step_end before on_log of the same optimizer step, so rows are
    keyed by rollwise step and written at the end; TRL logs its generation metrics (reward,
    zero-std groups, lengths) at the first optimizer step of each generation batch."""

    def __init__(self, cfg: Config, mb: int, eval_fn, path: Path, log):
        self.cfg, self.mb, self.eval_fn, self.log, self.path = cfg, mb, eval_fn, log, path
        self.by_step: dict[int, dict] = {}
        self.eval_seconds = self.train_seconds = 0.0

    @property
    def rows(self) -> list[dict]:
        return [self.by_step[k] for k in sorted(self.by_step)]

    def start(self, model) -> None:
        self.wall0 = time.time()
        self.by_step[0] = {"step": 0, **self._eval(model), "wall_seconds": 0.0,
                           "train_seconds": 0.0}
        self._say(0)
        self.eval_seconds = 0.0  # the clock starts after the step-0 evaluation
        self.t0 = self.t_last = time.time()

    def _eval(self, model) -> dict[str, float]:
        t = time.time()
        was_training = model.training
        with torch.random.fork_rng(devices=[]):  # evaluating must not move TRL's sampling
            out = self.eval_fn(model)
        model.train(was_training)
        self.eval_seconds += time.time() - t
        return out

    def on_log(self, global_step: int, logs: dict) -> None:
        row = self.by_step.setdefault(-(-global_step // self.mb), {})
        for src, dst in [("reward", "reward/mean"), ("completions/mean_length",
                                                      "response/length_mean")]:
            if isinstance(logs.get(src), float) and math.isfinite(logs[src]):
                row.setdefault(dst, logs[src])
        if "response/length_mean" in row:
            per_step = self.cfg.control.prompts_per_step * self.cfg.generate.group_size
            row.setdefault("tokens/generated", row["response/length_mean"] * per_step)
            row.setdefault("tokens/trained", row["tokens/generated"])  # TRL trains on all
        zero = logs.get("frac_reward_zero_std")
        if isinstance(zero, float) and math.isfinite(zero):
            row.setdefault("groups/mixed_share", 1 - zero)

    def on_step_end(self, global_step: int, model) -> None:
        if global_step % self.mb:
            return
        step = global_step // self.mb
        now = time.time()
        self.train_seconds = now - self.t0 - self.eval_seconds
        row = self.by_step.setdefault(step, {})
        row.update({"step": step, "perf/step_seconds": now - self.t_last,
                    "train_seconds": self.train_seconds})
        if step % self.cfg.run.eval_every == 0 or step == self.cfg.train.steps:
            row.update(self._eval(model))
            self._say(step)
        row["wall_seconds"] = time.time() - self.wall0
        self.t_last = time.time()

    def _say(self, step: int) -> None:
        self.log(f"trl step {step}/{self.cfg.train.steps}: held-out pass@1 "
                 f"{self.by_step[step]['eval/pass1']:.3f}, {self.train_seconds:.0f}s training")

    def close(self) -> None:
        with open(self.path, "w") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")


def _callback(base, recorder: _Recorder):
    class RecorderCallback(base):
        def on_log(self, args, state, control, logs=None, **kw):
            recorder.on_log(state.global_step, logs or {})

        def on_step_end(self, args, state, control, model=None, **kw):
            recorder.on_step_end(state.global_step, model)
    return RecorderCallback()
