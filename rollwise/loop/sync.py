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
from rollwise.engine import Engine
from rollwise.evaluate import evaluate
from rollwise.report.progress import Progress
from rollwise.report.sinks import build_sinks
from rollwise.stages.control import build_selector
from rollwise.stages.filter import build_filter, make_scorer
from rollwise.stages.generate.group import GroupGenerator
from rollwise.stages.ledger import Ledger
from rollwise.store.rollouts import RolloutStore
from rollwise.tasks import load_task
from rollwise.train.sft import warm_start
from rollwise.train.group_filters import Decision, judge_group
from rollwise.train.trainer import Trainer
from rollwise.types import Group, Status


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
        self.selector = build_selector(cfg.control)
        self.generator = GroupGenerator(cfg.generate, self.tokenizer)
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
        """One pass of Generate -> Filter -> Control -> Replay, then train and sync."""
        assert self.engine.version == self.trainer.version, "engine holds stale weights"
        t0 = time.time()
        ledger, m = Ledger(), {}
        groups, scored = self.collect(step, ledger, m)
        m["perf/gen_seconds"] = time.time() - t0
        self.persist(step, scored)  # every scored sample is on disk before training
        # Train, then sync the new weights into the engine
        self.progress.phase("train")
        t1 = time.time()
        m.update(self.trainer.update(groups))
        m["perf/train_seconds"] = time.time() - t1
        self.progress.phase("sync")
        self.engine.load_weights(self.trainer.weights(), self.trainer.version)
        # Control learns from every scored group, kept or not
        self.selector.observe({g.prompt_id: (sum(r >= 1.0 for r in g.rewards), len(g.samples))
                               for g in scored}, step)
        samples = [s for g in scored for s in g.samples]
        n_gen = sum(s.num_tokens for s in samples)
        ledger.tokens_to("trained", int(m.get("train/tokens", 0)))
        self.totals["rollouts"] += len(samples)
        self.totals["tokens_generated"] += n_gen
        self.totals["tokens_trained"] += int(m.get("train/tokens", 0))
        m.update(ledger.metrics())
        m.update({
            "step": step, "reward/mean": sum(s.reward for s in samples) / len(samples),
            "groups/mixed_share": sum(g.is_mixed for g in scored) / len(scored),
            "groups/scored": len(scored), "groups/trained": len(groups),
            "tokens/generated": n_gen, "response/length_mean": n_gen / len(samples),
            "samples/total": len(samples),
            "samples/truncated": sum(s.status == Status.TRUNCATED for s in samples),
            "perf/gen_tokens_per_s": n_gen / max(m["perf/gen_seconds"], 1e-9),
            "perf/step_seconds": time.time() - t0, "policy/version": self.trainer.version,
        })
        return m

    def collect(self, step: int, ledger: Ledger, m: dict) -> tuple[list[Group], list[Group]]:
        """Control picks prompts, Generate samples groups, Filter scores and keeps them. With
        control.dynamic_sampling, refill until prompts_per_step groups carry a signal (DAPO)."""
        cfg = self.cfg
        want, kept, scored = cfg.control.prompts_per_step, [], []
        for _ in range(cfg.control.max_rounds if cfg.control.dynamic_sampling else 1):
            problems = self.selector.select(self.task.train, want - len(kept), self.rng)
            ledger.decide("control", "select", cfg.control.selector, len(problems))
            self.progress.phase("generate")
            groups = self.generator.generate(self.engine, problems, step)
            self.progress.phase("score")
            self.score(groups, m)
            scored += groups
            for g in groups:
                decision = judge_group(g, cfg.train) if cfg.filter.drop_equal_reward_groups \
                    else Decision(True, "")
                tokens = sum(s.num_tokens for s in g.samples)
                if decision.keep:
                    kept.append(g)
                else:
                    ledger.decide("filter", "drop", decision.reason)
                    ledger.tokens_to(f"filtered/{decision.reason}", tokens)
            if len(kept) >= want:
                break
        if len(kept) > want:  # dynamic sampling trains on exactly prompts_per_step groups
            for g in kept[want:]:
                ledger.decide("filter", "drop", "batch_full")
                ledger.tokens_to("filtered/batch_full", sum(s.num_tokens for s in g.samples))
            kept = kept[:want]
        return kept, scored

    def score(self, groups: list[Group], m: dict) -> None:
        """Filter: reward every sample (a failing verifier marks its sample failed)."""
        samples = [s for g in groups for s in g.samples]
        problems = [g.problem for g in groups for _ in g.samples]
        texts = [self.decode(s.response_ids) for s in samples]
        for k, v in self.filter.score(samples, problems, texts).items():
            m[k] = m.get(k, 0.0) + v

    def persist(self, step: int, groups: list[Group]) -> None:
        samples = [s for g in groups for s in g.samples]
        prompts = [g.problem.prompt for g in groups for _ in g.samples]
        self.store.append(step, samples, prompts, [self.decode(s.response_ids) for s in samples])


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
    sinks = build_sinks(cfg, run.dir, log=progress.log)
    sinks.write(0, {**start, "wall_seconds": time.time() - wall0})
    progress.take_phase_seconds()  # warm start and first eval are not step 1's phases
    for step in range(1, cfg.train.steps + 1):
        m = run.step(step)
        if step % cfg.run.eval_every == 0 or step == cfg.train.steps:
            progress.phase("eval")
            last_eval = run.evaluate()
            m.update(last_eval)
        m.update(progress.take_phase_seconds())
        m["wall_seconds"] = time.time() - wall0
        sinks.write(step, m)
        progress.step(step, m)
    sinks.close()
    progress.close()
    models.save(run.trainer.model, run.tokenizer, run.dir / "model")
    summary = {"eval_pass1_start": start["eval/pass1"], "eval_pass1_end": last_eval["eval/pass1"],
               "eval_start": start, "eval_end": last_eval, "steps": cfg.train.steps,
               **run.totals, "wall_seconds": time.time() - wall0, "run_dir": str(run.dir)}
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.run.report:
        write_report_safely(run.dir, progress.log)
    progress.log("held-out pass@1 at end:   " + _fmt(last_eval))
    progress.log(f"done in {summary['wall_seconds']:.0f}s: pass@1 {summary['eval_pass1_start']:.3f}"
                 f" -> {summary['eval_pass1_end']:.3f}; summary in {run.dir / 'summary.json'}")
    return summary


def write_report_safely(run_dir: Path, log) -> None:
    """report.html for the finished run; a plotting failure is logged, never fatal."""
    try:
        from rollwise.report.report import write_report
        log(f"report: {write_report([run_dir])}")
    except Exception as e:  # the run's results are already on disk
        log(f"report.html not written ({type(e).__name__}: {e}); "
            f"retry with 'rollwise report {run_dir}'")


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items())
