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
from rollwise.evaluate import evaluate
from rollwise.report.progress import Progress
from rollwise.report.sinks import build_sinks
from rollwise.stages.control import build_selector
from rollwise.stages.filter import build_filter, make_scorer
from rollwise.stages.generate.group import GroupGenerator
from rollwise.stages.generate.partial_april import PartialRolloutGenerator
from rollwise.stages.ledger import Ledger
from rollwise.stages.replay import (ReplayBuffer, build_curriculum, replay_metrics,
                                    replay_quota)
from rollwise.store import checkpoint as ckpt
from rollwise.store import killpoint
from rollwise.store.rollouts import RolloutStore
from rollwise.sync import build_engine, build_sync
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

    def __init__(self, cfg: Config, progress: Progress, resume: bool = False):
        self.cfg, self.progress = cfg, progress
        seed_everything(cfg.run.seed)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.dir = Path(cfg.run.root) / cfg.run.name
        if self.dir.exists() and not resume:
            progress.log(f"replacing the earlier run in {self.dir}")
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(dump_config(cfg))
        self.task = load_task(cfg.task)
        model, self.tokenizer = initial_model(cfg, self.task, progress)
        self.pad_id = self.tokenizer.pad_token_id
        self.trainer = Trainer(model, cfg.train, pad_id=self.pad_id, seed=cfg.run.seed)
        self.engine = build_engine(cfg, model, pad_id=self.pad_id)  # here or a child process
        self.sync = build_sync(cfg.sync, self.trainer, self.engine)
        self.filter = build_filter(cfg.filter, self.task)
        if cfg.filter.judge.model is None:  # a judge with no model of its own: the policy
            self.filter.attach_engine(self.engine, self.tokenizer)
        self.selector = build_selector(cfg.control)
        self.generator = (PartialRolloutGenerator(cfg.generate, self.tokenizer,
                                                  cfg.control.over_provision)
                          if cfg.control.inflight == "april"
                          else GroupGenerator(cfg.generate, self.tokenizer))
        self.eval_scorer = make_scorer("exact" if cfg.filter.reward not in ("math_verify",)
                                       else cfg.filter.reward, self.task)
        self.store = RolloutStore(self.dir / "rollouts", log=progress.log)  # repairs a crash
        self.replay = ReplayBuffer(cfg.replay.capacity, cfg.replay.max_staleness) \
            if cfg.replay.enabled else None
        self.curriculum = build_curriculum(cfg.replay)
        self.rng = random.Random(cfg.run.seed)
        self.totals = {"rollouts": 0, "tokens_generated": 0, "tokens_trained": 0}
        self.current_step = 0
        killpoint.instrument(self)  # crash tests only (ROLLWISE_KILL_AT)

    def evaluate(self) -> dict[str, float]:
        run = self.cfg.run
        return evaluate(self.engine, self.tokenizer, self.task.eval, self.eval_scorer,
                        self.cfg.generate.max_new_tokens, run.eval_samples, run.eval_temperature)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def step(self, step: int) -> dict[str, float]:
        """One pass of Generate -> Filter -> Control -> Replay, then train and sync."""
        assert self.engine.version == self.trainer.version, "engine holds stale weights"
        t0 = time.time()
        self.current_step, ledger, m = step, Ledger(), {}
        replayed = self.take_replay(m)  # Replay: groups reused from the buffer, kept stale
        decoded0 = self.engine.tokens_generated
        groups, scored = self.collect(step, ledger, m,
                                      self.cfg.control.prompts_per_step - len(replayed))
        # decoded this step; differs from the scored samples' tokens under APRIL, whose groups
        # carry tokens decoded in earlier steps and leave some of this step's in flight
        n_decoded = self.engine.tokens_generated - decoded0
        m["perf/gen_seconds"] = time.time() - t0
        self.persist(step, scored, {"step_gen_seconds": m["perf/gen_seconds"]})
        # every scored sample is on disk before training
        # Train, then sync the new weights into the engine
        self.progress.phase("train")
        t1 = time.time()
        groups = groups + replayed
        m.update(self.trainer.update(groups))
        m["perf/train_seconds"] = time.time() - t1
        self.progress.phase("sync")
        m.update(self.sync.push())
        # Control learns from every scored group, kept or not
        outcomes = {g.prompt_id: (sum(r >= 1.0 for r in g.rewards), len(g.samples))
                    for g in scored}
        self.selector.observe(outcomes, step)
        if self.curriculum is not None:
            self.curriculum.observe(outcomes, step)
        if self.replay is not None:
            self.replay.put(scored)  # fresh groups with a signal; replayed ones stay as they are
        samples = [s for g in scored for s in g.samples]
        n_gen = sum(s.num_tokens for s in samples)
        # trained tokens of this step's generation (replayed ones are counted under replay/)
        ledger.tokens_to("trained", int(m.get("train/tokens", 0) - m.get("replay/tokens", 0)))
        self.totals["rollouts"] += len(samples)
        self.totals["tokens_generated"] += n_gen
        self.totals["tokens_trained"] += int(m.get("train/tokens", 0))
        m.update(ledger.metrics())
        m.update({
            "step": step, "reward/mean": sum(s.reward for s in samples) / len(samples),
            "groups/mixed_share": sum(g.is_mixed for g in scored) / len(scored),
            "groups/scored": len(scored), "groups/trained": len(groups),
            "tokens/batch": sum(s.num_tokens for g in groups for s in g.samples),
            "tokens/stale": sum(v < self.trainer.version - 1 for g in groups for s in g.samples
                                for v in s.versions),
            "tokens/generated": n_gen, "tokens/decoded": n_decoded,
            "response/length_mean": n_gen / len(samples),
            "samples/total": len(samples),
            "samples/truncated": sum(s.status == Status.TRUNCATED for s in samples),
            "perf/gen_tokens_per_s": n_decoded / max(m["perf/gen_seconds"], 1e-9),
            "perf/step_seconds": time.time() - t0, "policy/version": self.trainer.version,
        })
        return m

    def take_replay(self, m: dict) -> list[Group]:
        """replay.share of the batch from the buffer, none beyond replay.max_staleness."""
        if self.replay is None:
            return []
        batch, version = self.cfg.control.prompts_per_step, self.trainer.version
        n = replay_quota(self.cfg.replay.share, batch, self.replay.eligible(version))
        replayed = self.replay.take(n, version, self.rng)
        m.update(replay_metrics(replayed, batch, version, self.replay))
        return replayed

    def collect(self, step: int, ledger: Ledger, m: dict,
                want: int | None = None) -> tuple[list[Group], list[Group]]:
        """Control picks prompts, Generate samples groups, Filter scores and keeps them. With
        control.dynamic_sampling, refill until `want` (default prompts_per_step) groups carry a
        signal (DAPO); control.refill=full generates a whole batch every round, as verl does."""
        cfg = self.cfg
        want = cfg.control.prompts_per_step if want is None else want
        kept, scored = [], []
        for _ in range(cfg.control.max_rounds if cfg.control.dynamic_sampling else 1):
            self.progress.phase("generate")
            n = want if cfg.control.refill == "full" else want - len(kept)
            groups = self.generate(n, step, ledger)
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

    def generate(self, n: int, step: int, ledger: Ledger) -> list[Group]:
        """n groups: Control selects prompts, the generator samples them."""
        def select(k: int):
            ledger.decide("control", "select", self.cfg.control.selector, k)
            pool = self.task.train if self.curriculum is None \
                else self.curriculum.pool(self.task.train, step)
            return self.selector.select(pool, k, self.rng)
        if isinstance(self.generator, PartialRolloutGenerator):
            return self.generator.generate(self.engine, select, n, step, ledger)
        return self.generator.generate(self.engine, select(n), step)

    def score(self, groups: list[Group], m: dict) -> None:
        """Filter: reward every sample (a failing verifier marks its sample failed)."""
        samples = [s for g in groups for s in g.samples]
        problems = [g.problem for g in groups for _ in g.samples]
        texts = [self.decode(s.response_ids) for s in samples]
        for k, v in self.filter.score(samples, problems, texts).items():
            m[k] = m.get(k, 0.0) + v

    def persist(self, step: int, groups: list[Group], timings: dict | None = None) -> None:
        samples = [s for g in groups for s in g.samples]
        prompts = [g.problem.prompt for g in groups for _ in g.samples]
        self.store.append(step, samples, prompts, [self.decode(s.response_ids) for s in samples],
                          {**(timings or {}), "written_at": time.time()})

    # ------------------------------------------------------------------ checkpoint and resume
    def parts(self) -> dict:
        """The stateful parts beside the trainer: their state_dict goes into checkpoints."""
        return {"selector": self.selector, "generator": self.generator, "replay": self.replay,
                "curriculum": self.curriculum, "filter": self.filter}

    def state_dict(self) -> dict:
        """Everything a resume needs to continue exactly as an uninterrupted run would: model,
        optimizer, scheduler and version; every RNG (the run's, python, numpy, torch, the
        engine's seed stream); selector, generator (paused partial rollouts), replay buffer and
        per-prompt statistics; totals."""
        return {"trainer": ckpt.trainer_state(self.trainer), "rng": ckpt.rng_state(self.rng),
                "engine": ckpt.engine_state(self.engine), "totals": dict(self.totals),
                **{k: p.state_dict() for k, p in self.parts().items()
                   if hasattr(p, "state_dict")}}

    def load_state_dict(self, state: dict) -> None:
        ckpt.set_trainer_state(self.trainer, state["trainer"])
        self.sync.push()  # the engine takes the restored weights and version
        if not ckpt.set_engine_state(self.engine, state["engine"]):
            self.progress.log("this engine's seed stream cannot be restored: sampling after "
                              "the resume differs from an uninterrupted run")
        ckpt.set_rng_state(state["rng"], self.rng)
        self.totals = dict(state["totals"])
        for k, p in self.parts().items():
            if k in state and hasattr(p, "load_state_dict"):
                p.load_state_dict(state[k])

    def checkpoint(self, step: int, loop: dict) -> None:
        ckpt.save(self.dir, step, {"step": step, "loop": loop, **self.state_dict()},
                  self.cfg.run.keep_checkpoints)
        self.store.checkpointed(step)

    def restore(self, checkpoint: ckpt.Checkpoint) -> dict:
        """Load a checkpoint and drop what came after it (rollouts, later checkpoints), so the
        steps after it are generated again exactly once; returns the loop's saved state."""
        state = checkpoint.load()
        self.load_state_dict(state)
        ckpt.clean(self.dir, checkpoint.step)
        self.store.truncate(checkpoint.step)
        self.current_step = checkpoint.step
        return state["loop"]


def train(cfg: Config, progress: Progress | None = None, resume: bool = False) -> dict:
    """Train; with resume, continue the run in run.root/run.name from its newest intact
    checkpoint (starting over when it has none)."""
    progress = progress or Progress(cfg.run.log, cfg.train.steps)
    wall0 = time.time()
    found = ckpt.latest(Path(cfg.run.root) / cfg.run.name, progress.log) if resume else None
    if resume and found is None:
        progress.log("no intact checkpoint to resume from: starting the run over")
    run = Run(cfg, progress, resume=found is not None)
    progress.log(f"run directory: {run.dir}  ({models.num_params(run.trainer.model) / 1e6:.2f}M "
                 f"parameters, {cfg.train.steps} steps of {cfg.control.prompts_per_step} prompts "
                 f"x {cfg.generate.group_size})")
    if found is None:
        start = last_eval = run.evaluate()
        progress.log("held-out pass@1 at start: " + _fmt(start))
        progress.step(0, start)
        sinks = build_sinks(cfg, run.dir, log=progress.log)
        sinks.write(0, {**start, "wall_seconds": time.time() - wall0})
    else:
        loop = run.restore(found)
        start, last_eval, wall0 = loop["start_eval"], loop["last_eval"], wall0 - loop["wall"]
        progress.log(f"resumed from {found.path} (step {found.step})")
        sinks = build_sinks(cfg, run.dir, log=progress.log, resume_step=found.step)
    progress.take_phase_seconds()  # warm start and first eval are not step 1's phases
    every, stopped = cfg.run.checkpoint_every, None
    with ckpt.StopOnInterrupt(progress.log) as stop:
        for step in range(run.current_step + 1, cfg.train.steps + 1):
            m = run.step(step)
            if step % cfg.run.eval_every == 0 or step == cfg.train.steps:
                progress.phase("eval")
                last_eval = run.evaluate()
                m.update(last_eval)
            m.update(progress.take_phase_seconds())
            m["wall_seconds"] = time.time() - wall0
            sinks.write(step, m)
            progress.step(step, m)
            if stop.requested or step == cfg.train.steps or (every and step % every == 0):
                run.checkpoint(step, {"start_eval": start, "last_eval": last_eval,
                                      "wall": m["wall_seconds"]})
            if stop.requested and step < cfg.train.steps:
                stopped = step
                break
    sinks.close()
    progress.close()
    if stopped is not None:
        getattr(run.engine, "close", lambda: None)()
        progress.log(f"stopped after step {stopped} (checkpoint saved); continue with "
                     f"'rollwise train --resume {run.dir}'")
        return {"stopped_at": stopped, "run_dir": str(run.dir), **run.totals}
    getattr(run.engine, "close", lambda: None)()  # an engine in a child process
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
