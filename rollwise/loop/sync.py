"""The synchronous, on-policy RL loop: select -> generate -> score -> persist -> train -> sync.

    rollwise train                      # the default embedded CPU run
    rollwise train train.steps=100 run.name=longer

Every step writes one line to runs/<name>/metrics.jsonl; the run ends with summary.json, the
final model as a Hugging Face folder and the rollouts as Parquet.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import torch

from rollwise import models
from rollwise.config import Config, dump_config
from rollwise.engine import Engine, Request, SamplingParams
from rollwise.evaluate import evaluate
from rollwise.report.progress import Progress
from rollwise.stages.filter import build_filter, make_scorer
from rollwise.store.rollouts import RolloutStore
from rollwise.tasks import Problem, load_task
from rollwise.train.sft import warm_start
from rollwise.train.trainer import Trainer
from rollwise.types import Group, Sample, Status


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def initial_model(cfg: Config, task, progress: Progress):
    if cfg.run.init:
        progress.log(f"initial model: {cfg.run.init}")
        return models.load_model(cfg.run.init, cfg.model.dtype)
    if cfg.model.path:
        progress.log(f"initial model: {cfg.model.path}")
        return models.load_model(cfg.model.path, cfg.model.dtype)
    return warm_start(cfg, task, log=progress.log)


def make_requests(problems: list[Problem], tokenizer, cfg: Config) -> list[Request]:
    g = cfg.generate
    params = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                            max_new_tokens=g.max_new_tokens, stop_ids=(tokenizer.eos_token_id,))
    requests = []
    for i, p in enumerate(problems):
        ids = tokenizer(p.prompt)["input_ids"]
        requests += [Request(ids, params, i * g.group_size + j) for j in range(g.group_size)]
    return requests


def to_samples(problems, requests, completions, step: int, group_size: int) -> list[Sample]:
    samples = []
    for req, c in zip(requests, completions):
        p = problems[req.id // group_size]
        s = Sample(prompt_id=p.id, prompt_ids=list(req.prompt_ids), group_id=f"{step}:{p.id}",
                   step=step, meta={"tier": p.tier, "answer": p.answer})
        s.response_ids, s.logprobs, s.versions = c.token_ids, c.logprobs, c.versions
        s.entropies, s.loss_mask = c.entropies, [1] * len(c.token_ids)
        s.status = Status.COMPLETED if c.finish_reason == "stop" else Status.TRUNCATED
        samples.append(s)
    return samples


class Run:
    """Holds the parts of one training run; `step()` is one pass of the loop."""

    def __init__(self, cfg: Config, progress: Progress):
        self.cfg, self.progress = cfg, progress
        seed_everything(cfg.run.seed)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.dir = Path(cfg.run.root) / cfg.run.name
        if self.dir.exists():
            progress.log(f"replacing the earlier run in {self.dir}")
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        (self.dir / "config.yaml").write_text(dump_config(cfg))
        self.task = load_task(cfg.task)
        model, self.tokenizer = initial_model(cfg, self.task, progress)
        self.pad_id = self.tokenizer.pad_token_id
        self.trainer = Trainer(model, cfg.train, pad_id=self.pad_id, seed=cfg.run.seed)
        self.engine = Engine(model, pad_id=self.pad_id, max_batch=cfg.engine.max_batch,
                             seed=cfg.run.seed)
        self.filter = build_filter(cfg.filter, self.task)
        self.eval_scorer = make_scorer("exact" if cfg.filter.reward not in ("math_verify",)
                                       else cfg.filter.reward, self.task)
        self.store = RolloutStore(self.dir / "rollouts")
        self.rng = random.Random(cfg.run.seed)
        self.totals = {"rollouts": 0, "tokens_generated": 0, "tokens_trained": 0}

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.engine, self.tokenizer, self.task.eval, self.eval_scorer,
                        self.cfg.generate.max_new_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, step: int) -> dict[str, float]:
        cfg, m = self.cfg, {}
        assert self.engine.version == self.trainer.version, "engine holds stale weights"
        t0 = time.time()
        # Control: which prompts this step
        problems = self.rng.sample(self.task.train, cfg.control.prompts_per_step)
        # Generate: G samples per prompt
        self.progress.phase("generate")
        requests = make_requests(problems, self.tokenizer, cfg)
        completions = self.engine.generate(requests)
        samples = to_samples(problems, requests, completions, step, cfg.generate.group_size)
        t_gen = time.time() - t0
        # Filter: rewards per sample, then which groups carry signal
        self.progress.phase("score")
        texts = [self.decode(s.response_ids) for s in samples]
        by_sample = [problems[r.id // cfg.generate.group_size] for r in requests]
        m.update(self.filter.score(samples, by_sample, texts))
        self.store.append(step, samples, [p.prompt for p in by_sample], texts)
        groups = [Group(p.id, samples[i * cfg.generate.group_size:(i + 1) * cfg.generate.group_size])
                  for i, p in enumerate(problems)]
        mixed = [g for g in groups if g.is_mixed]
        train_groups = mixed if cfg.filter.drop_equal_reward_groups else groups
        # Train, then sync the new weights into the engine
        self.progress.phase("train")
        t1 = time.time()
        m.update(self.trainer.update(train_groups))
        t_train = time.time() - t1
        self.progress.phase("sync")
        self.engine.load_weights(self.trainer.weights(), self.trainer.version)
        n_gen = sum(s.num_tokens for s in samples)
        self.totals["rollouts"] += len(samples)
        self.totals["tokens_generated"] += n_gen
        self.totals["tokens_trained"] += int(m.get("train/tokens", 0))
        rewards = [s.reward for s in samples]
        m.update({
            "step": step, "reward/mean": sum(rewards) / len(rewards),
            "groups/mixed_share": len(mixed) / len(groups),
            "groups/dropped_equal_reward": len(groups) - len(train_groups),
            "tokens/generated": n_gen, "response/length_mean": n_gen / len(samples),
            "samples/truncated": sum(s.status == Status.TRUNCATED for s in samples),
            "perf/gen_seconds": t_gen, "perf/train_seconds": t_train,
            "perf/gen_tokens_per_s": n_gen / max(t_gen, 1e-9),
            "perf/step_seconds": time.time() - t0, "policy/version": self.trainer.version,
        })
        return m


def train(cfg: Config, progress: Progress | None = None) -> dict:
    progress = progress or Progress(cfg.run.log, cfg.train.steps)
    wall0 = time.time()
    run = Run(cfg, progress)
    progress.log(f"run directory: {run.dir}  ({models.num_params(run.trainer.model) / 1e6:.2f}M "
                 f"parameters, {cfg.train.steps} steps of {cfg.control.prompts_per_step} prompts "
                 f"x {cfg.generate.group_size})")
    start = run.evaluate()
    progress.log("held-out pass@1 at start: " + _fmt(start))
    progress.step(0, start)
    last_eval = start
    with open(run.dir / "metrics.jsonl", "w") as sink:
        sink.write(json.dumps({"step": 0, **start, "wall_seconds": time.time() - wall0}) + "\n")
        for step in range(1, cfg.train.steps + 1):
            m = run.step(step)
            if step % cfg.run.eval_every == 0 or step == cfg.train.steps:
                progress.phase("eval")
                last_eval = run.evaluate()
                m.update(last_eval)
            m["wall_seconds"] = time.time() - wall0
            sink.write(json.dumps(m) + "\n")
            sink.flush()
            progress.step(step, m)
    progress.close()
    models.save(run.trainer.model, run.tokenizer, run.dir / "model")
    summary = {"eval_pass1_start": start["eval/pass1"], "eval_pass1_end": last_eval["eval/pass1"],
               "eval_start": start, "eval_end": last_eval, "steps": cfg.train.steps,
               **run.totals, "wall_seconds": time.time() - wall0, "run_dir": str(run.dir)}
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=2))
    progress.log("held-out pass@1 at end:   " + _fmt(last_eval))
    progress.log(f"done in {summary['wall_seconds']:.0f}s: pass@1 {summary['eval_pass1_start']:.3f}"
                 f" -> {summary['eval_pass1_end']:.3f}; summary in {run.dir / 'summary.json'}")
    return summary


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items())
