"""The synchronous, on-policy RL loop: Generate -> Filter -> Control -> Replay, persist, train,
sync, over the stage objects of rollwise.stages (each a Protocol, chosen by name).

    rollwise train                      # the default embedded CPU run
    rollwise train train.steps=100 run.name=longer

Every step writes one line to runs/<name>/metrics.jsonl; the run ends with summary.json, the
final model as a Hugging Face folder and the rollouts as Parquet.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollwise import models
from rollwise.config import Config, ConfigError, dump_config
from rollwise.devices import release_freed_memory, resolve_device
from rollwise.engine.backends import build_engine
from rollwise.evaluate import scoring_bounded
from rollwise.loop.async_ import Pipeline
from rollwise.loop.metrics import StepResult, step_metrics
from rollwise.memory_budget import sized_for_memory
from rollwise.numerics import reproducibility_note
from rollwise.report.memory import GIB, high_water_bytes
from rollwise.report.progress import Progress
from rollwise.report.sinks import build_sinks
from rollwise.run_inputs import PYTHON_INPUTS, resume_hint
from rollwise.stages.control.stage import Control
from rollwise.stages.filter import eval_scorer
from rollwise.stages.filter.groups import build_group_filter, keep, scored_part
from rollwise.stages.generate import (
    build_generator,
    check_generator,
    extend_groups,
    generate_round,
    run_to_end,
    scope,
)
from rollwise.stages.generate.group import new_sample, sampling_params
from rollwise.stages.ledger import Ledger
from rollwise.stages.replay import build_replay
from rollwise.store import checkpoint as ckpt
from rollwise.store import killpoint
from rollwise.store.rollouts import RolloutStore
from rollwise.sync import build_sync
from rollwise.tasks import load_task
from rollwise.tasks.prompts import Prompter
from rollwise.training.sft import warm_start, warm_start_path
from rollwise.training.sharded import ShardedTrainer
from rollwise.training.trainer import Trainer
from rollwise.types import Group


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Inputs:
    """Python objects in place of config paths (rollwise.train): a loaded model and its
    tokenizer, and dataset rows (a list of dicts or a datasets.Dataset)."""
    model: Any = None
    tokenizer: Any = None
    rows: Any = None
    eval_rows: Any = None
    given: dict[str, str] = field(default_factory=dict)  # rollwise.train's objects, described


def build_trainer(cfg: Config, model, pad_id: int):
    """One Trainer, or train.world_size FSDP2 ranks behind the same interface."""
    if cfg.train.world_size == 1:
        return Trainer(model, cfg.train, pad_id=pad_id, seed=cfg.run.seed)
    ranks = None
    if cfg.loop.backend == "ray":  # ranks as Ray actors, placed by the cluster
        from rollwise import ray_cluster  # Ray: imported only when used
        from rollwise.training.ray_ranks import RayRanks
        ray_cluster.start(cfg)
        ranks = RayRanks
    return ShardedTrainer(model, cfg.train, pad_id=pad_id, seed=cfg.run.seed,
                          world_size=cfg.train.world_size, timeout_s=cfg.loop.wait_timeout_s,
                          ranks=ranks)


def initial_model(cfg: Config, task, progress: Progress, inputs: Inputs | None = None):
    if inputs is not None and inputs.model is not None:
        progress.log(f"initial model: {type(inputs.model).__name__} given in Python")
        return (models.to_dtype(inputs.model, cfg.model.dtype, for_training=True),
                inputs.tokenizer)
    if cfg.run.init:
        progress.log(f"initial model: {cfg.run.init}")
        return models.load_model(cfg.run.init, cfg.model.dtype, for_training=True)
    if cfg.model.path and not cfg.sft.from_path:
        progress.log(f"initial model: {cfg.model.path}")
        return models.load_model(cfg.model.path, cfg.model.dtype, for_training=True)
    progress.phase("warm_start")
    return warm_start(cfg, task, log=progress.log)


def model_source(cfg: Config, task, inputs: Inputs) -> str | None:
    """The folder the initial model is loaded from (None: given in Python): a LoRA run's
    saved adapter records it as its base."""
    if inputs.model is not None:
        return None
    path = cfg.run.init or (None if cfg.sft.from_path else cfg.model.path)
    if path:
        where = models.resolve_path(path)
        return str(Path(where).resolve()) if Path(where).is_dir() else where
    return str(warm_start_path(cfg, task).resolve())


def preflight(cfg: Config, inputs: Inputs):
    """Checks that need more than the config, made before any work (no warm start, no run
    directory touched): the device exists; the model folder (or catalog model) is there; a
    required chat template is there. The device."""
    device = resolve_device(cfg.run.device)
    for key, path in (("model.path", cfg.model.path), ("run.init", cfg.run.init)):
        if path and inputs.model is None:
            try:
                models.resolve_path(path)
            except FileNotFoundError as e:
                raise ConfigError(f"{key}: {e}") from None
    if cfg.task.chat_template == "on":  # raises, naming the fix, when there is no template
        Prompter(cfg.task, tokenizer_for(cfg, inputs))
    return device


def tokenizer_for(cfg: Config, inputs: Inputs):
    """The tokenizer the run's model will have, before the model is loaded or built."""
    if inputs.tokenizer is not None:
        return inputs.tokenizer
    path = cfg.run.init or cfg.model.path
    return models.load_tokenizer(path) if path else models.char_tokenizer()


def torch_threads(cfg: Config, device) -> int:
    """The torch threads a run sets (0: keep the caller's). run.threads where given; where it
    is 0, half the cores for the asynchronous loop (max_staleness > 0) on CPU with the
    built-in engine, whose generation and training run side by side: two pools of every core
    each spin against the other (0.13x the synchronous loop on 2 cores, BENCHMARKS.md). At
    max_staleness 0 nothing overlaps, and the threads stay the synchronous loop's."""
    if (cfg.run.threads or cfg.loop.mode != "async" or cfg.loop.max_staleness == 0
            or cfg.loop.backend != "local"):
        return cfg.run.threads
    if cfg.engine.backend != "builtin" or torch.device(device).type != "cpu":
        return 0
    return max(1, (os.cpu_count() or 2) // 2)


class Run:
    """Holds the stages and parts of one training run; `step()` is one pass of the loop."""

    keep_kv = False  # loop.carried_kv=keep: paused answers keep their K/V between rounds

    def __init__(self, cfg: Config, progress: Progress, resume: bool = False,
                 inputs: Inputs | None = None):
        self.progress, self.closed = progress, False
        inputs = inputs or Inputs()
        self.device = preflight(cfg, inputs)
        # the memory budget's sizes, in the config the run records (before any work)
        self.cfg = cfg = sized_for_memory(cfg, self.device, progress.log, inputs.model)
        self.task = load_task(cfg.task, inputs.rows, inputs.eval_rows)  # bad rows: before work
        check_generator(build_generator(cfg, tokenizer_for(cfg, inputs)), self.task, cfg)
        seed_everything(cfg.run.seed)
        threads = torch_threads(cfg, self.device)
        if threads:
            torch.set_num_threads(threads)
            if not cfg.run.threads:
                progress.log(f"loop.mode=async on CPU: {threads} torch thread(s) each for "
                             f"generation and training, which run side by side (set "
                             f"run.threads to choose)")
        note = reproducibility_note(torch.get_num_threads()) \
            if torch.device(self.device).type == "cpu" else None
        if note:
            progress.log(note)
        self.dir = Path(cfg.run.root) / cfg.run.name
        if self.dir.exists() and not resume:
            progress.log(f"replacing the earlier run in {self.dir}")
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "config.yaml").write_text(dump_config(cfg))
        (self.dir / PYTHON_INPUTS).unlink(missing_ok=True)
        if inputs.given:  # so a stop says how to resume, and the CLI refuses at once
            (self.dir / PYTHON_INPUTS).write_text(json.dumps(inputs.given, indent=2))
        progress.phase("load")
        model, self.tokenizer = initial_model(cfg, self.task, progress, inputs)
        self.model_source = model_source(cfg, self.task, inputs)
        model.to(self.device)
        # the engine first: it copies the weights as they are, and a LoRA trainer wraps the
        # model in place (the engine keeps the base; weight sync brings it the adapters)
        self.engine = build_engine(cfg, model, self.tokenizer, self.dir)
        try:
            self.trainer = build_trainer(cfg, model, self.tokenizer.pad_token_id)
        except BaseException:
            self.engine.close()  # a child process or Ray actors would outlive the error
            raise
        self.keep_kv = cfg.keeps_carried_kv()
        if self.keep_kv and not getattr(self.engine, "can_keep_paused", False):
            self.engine.close()
            raise ConfigError(f"loop.carried_kv = keep: engine.backend={cfg.engine.backend} "
                              f"({type(self.engine).__name__}) cannot keep a paused "
                              f"sequence's K/V (no can_keep_paused); set loop.carried_kv = "
                              f"recompute")
        self.sync = build_sync(cfg.sync, self.trainer, self.engine)
        self.rng = random.Random(cfg.run.seed)
        self.filter = build_group_filter(cfg, self.task, self.tokenizer)
        if cfg.filter.judge.model is None:  # a judge with no model of its own: the policy
            self.filter.attach_engine(self.engine, self.tokenizer)
        self.control = Control(cfg, self.task, self.rng)
        self.generator = build_generator(cfg, self.tokenizer)
        self.scope = scope.Scope(cfg, self.tokenizer) if cfg.generate.scope.verifier else None
        self.prompter = Prompter.for_task(cfg.task, self.tokenizer, self.task, model)
        self.generator.bind(prompter=self.prompter)
        self.say_unknown_characters()
        for key in self.filter.unbounded():
            progress.log(f"reward {key!r} runs in this process with no time limit, so a hang "
                         f"in it hangs the run: it is TRL's batch style, or cannot be "
                         f"serialised to a worker process (it refers to a lock, a socket or a "
                         f"model), or filter.workers=0. To bound it, write it as "
                         f"fn(response, problem) referring only to data it can copy")
        self.params = sampling_params(cfg.generate, self.prompter.stop_ids)
        self.replay = build_replay(cfg)
        self.control.bind(profile=self.profile, policy=self.trainer.model,
                          tokenizer=self.tokenizer, task=self.task, prompter=self.prompter)
        self.eval_scorer = eval_scorer(cfg.filter, self.task)
        self.store = RolloutStore(self.dir / "rollouts", log=progress.log)  # repairs a crash
        self.totals = {"rollouts": 0, "tokens_generated": 0, "tokens_trained": 0,
                       "tokens_decoded": 0}  # decoded: profiled and pruned tokens too
        self.current_step = self.train_step = 0  # the step generating and the step training
        self.gate = None  # the asynchronous loop's WeightGate (rollwise.loop.async_), when it runs
        killpoint.instrument(self)  # crash tests only (ROLLWISE_KILL_AT)

    def say_unknown_characters(self) -> None:
        """Characters of the task the tokenizer maps to its unknown token, said once."""
        n, chars = self.prompter.unknown_characters(self.task.train + self.task.eval)
        if n:
            self.progress.log(
                f"the task's prompts and solutions hold {n} character(s) the tokenizer does not "
                f"know ({len(chars)} distinct: {''.join(chars[:40])!r}); the model sees its "
                f"unknown token {self.tokenizer.unk_token!r} in their place")

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics, played as the generation strategy plays its samples; its scoring
        bounded as a whole, its failures counted (eval/failed) and said."""
        return scoring_bounded(self.eval_scorer, self.cfg.run.eval_scoring_deadline_s,
                               lambda: self.generator.evaluate(
                                   self.engine, self.prompter, self.task.eval, self.cfg,
                                   self.eval_scorer), self.progress.log)

    def step(self, step: int) -> StepResult:
        """Generate -> Filter -> Control -> Replay, persist, train, sync: one pass."""
        assert self.engine.version == self.trainer.version, "engine holds stale weights"
        return self.consume(self.produce(step))

    def produce(self, step: int) -> StepResult:
        """The rollout side of a step: select, generate, score, keep, persist; then Control and
        Replay learn from every scored group. The asynchronous loop runs it ahead of the
        trainer (rollwise.loop.async_); it never reads the trainer's weights."""
        t0, ledger, version = time.time(), Ledger(), self.engine.version
        self.current_step, decoded0 = step, self.engine.tokens_generated
        prefilled0 = self.engine.prefill_tokens  # None: the engine does not count
        want = self.cfg.control.prompts_per_step
        self.control.prepare(step, ledger)  # sGPO's profiling pass, once
        replayed = self.replay.take(want, version, self.rng)                   # Replay
        r = StepResult(step, [], [], ledger, version, 0,
                       replay=self.replay.metrics(replayed, want, version))
        kept, learned, want = [], [], want - len(replayed)  # learned: the scored parts
        for n in self.control.rounds(want, kept):                              # Control
            self.progress.phase("generate", self.tokens_note())
            groups = generate_round(self.engine, self.generator, self.control,  # Generate
                                    self.params, n, step, ledger, self.prompter, self.gate,
                                    self.keep_kv)
            self.progress.phase("score")
            _add(r.filter, self.filter.score(groups))                          # Filter
            self.extend(groups, r, ledger)  # DARS: more samples for hard prompts
            self.rectify(groups, r, ledger)  # SCOPE: failed rollouts corrected at a step
            r.scored += groups  # stored as scored: an unscored sample with its reason
            for g in [scored_part(g, ledger) for g in groups]:  # it is never trained
                (kept if keep(self.filter, g, ledger) else r.dropped).append(g)
                if g.samples:
                    learned.append(g)
        r.trained = self.control.trim(kept, want, ledger) + replayed
        # decoded this step; differs from the scored samples' tokens under APRIL, whose groups
        # carry tokens decoded in earlier steps and leave some of this step's in flight
        r.decoded = self.engine.tokens_generated - decoded0
        if prefilled0 is not None:
            r.prefilled = self.engine.prefill_tokens - prefilled0
        r.engine = self.engine.metrics()  # Ray's pool: worker deaths, re-queued requests
        r.seconds["gen"] = time.time() - t0
        self.persist(step, r.scored + r.aside,  # on disk first
                     {"step_gen_seconds": r.seconds["gen"]})
        # Control and Replay learn from every scored group, never from an unscored sample
        self.control.observe(learned, step)
        r.control = self.control.metrics()
        self.replay.put(learned)
        return r

    def consume(self, r: StepResult, push=None) -> StepResult:
        """The trainer's side of a step: update on the kept groups, then push the new weights
        (`push`: how, when the engine is shared with a running producer)."""
        t1 = time.time()
        self.train_step = r.step
        self.engine.sleep()  # a GPU shared with the trainer (vLLM)
        self.give_back_memory(engine=push is None)  # async: the producer is using the engine
        self.progress.phase("train")
        r.train = self.trainer.update(r.trained, r.dropped)                    # train
        self.give_back_memory()
        r.seconds["train"], r.version = time.time() - t1, self.trainer.version
        self.progress.phase("sync")
        r.sync = (push or self.sync.push)()                                    # sync
        self.count(r)
        # the step's wall time: its generation plus its own training (they overlap with other
        # steps' work in the asynchronous loop)
        r.seconds["step"] = r.seconds["gen"] + time.time() - t1
        return r

    def give_back_memory(self, engine: bool = False) -> None:
        """run.trim_memory: the allocator's free pages back to the OS, and with `engine` (only
        where nothing else is using it) the engine's idle K/V cache first."""
        if not self.cfg.run.trim_memory:
            return
        if engine:
            self.engine.release_idle_memory()  # (in an engine process: that process's pages)
        release_freed_memory()

    def extend(self, groups: list[Group], r: StepResult, ledger: Ledger) -> None:
        """The sizer's extra samples for scored groups (DARS), generated, scored and merged
        into their groups before the keep decision and the advantages."""
        extra = self.control.extra(groups)
        if not any(extra):
            return
        self.progress.phase("generate", self.tokens_note())
        added = extend_groups(self.engine, groups, extra, self.params, ledger, self.gate)
        ledger.decide("control", "extend", self.cfg.control.group_size, sum(extra))
        self.progress.phase("score")
        _add(r.filter, self.filter.score(added))

    def rectify(self, groups: list[Group], r: StepResult, ledger: Ledger) -> None:
        """SCOPE: failed rollouts of mostly-wrong groups continued from their first wrong
        step, corrected, scored, and put in the failed ones' places where they score higher
        (rollwise.stages.generate.scope); the replaced rollouts, and the rectified ones that
        did not score higher, are stored, never trained."""
        if self.scope is None:
            return
        todo = self.scope.propose(groups, self.engine.version)
        if not todo:
            return
        self.progress.phase("generate", self.tokens_note())
        fresh = [Group(t.group.prompt_id, [t.sample], t.group.problem) for t in todo]
        run_to_end(self.engine, fresh, self.params, ledger, self.gate)
        ledger.decide("generate", "rectify", self.cfg.generate.scope.verifier, len(todo))
        self.progress.phase("score")
        scored = self.filter.score(fresh)  # its counts add up; its means are the round's
        _add(r.filter, {k: v for k, v in scored.items() if k.startswith(("filter/failed",
                                                                          "perf/"))})
        aside, counts = scope.merge(todo)
        _add(r.filter, counts)
        r.aside += aside

    def profile(self, problems: list, k: int, ledger: Ledger) -> dict[str, tuple[int, int]]:
        """k samples of each prompt under the current policy, scored (sGPO's profiling pass):
        prompt id -> (successes, k). Its tokens count as tokens/profile in `ledger`."""
        self.progress.log(f"profiling {len(problems)} prompts x {k} samples "
                          f"(control.group_size = {self.cfg.control.group_size})")
        groups = [Group(p.id, [new_sample(p, p.prompt_ids, self.current_step)
                               for _ in range(k)], p)
                  for p in self.prompter.render(problems)]
        run_to_end(self.engine, groups, self.params, ledger, self.gate)
        self.filter.score(groups)
        ledger.tokens_to("profile", sum(s.num_tokens for g in groups for s in g.samples))
        ledger.decide("control", "profile", self.cfg.control.group_size, len(groups))
        return {g.prompt_id: (sum(r >= 1.0 for r in g.rewards), len(g.samples)) for g in groups}

    def count(self, r: StepResult) -> None:
        samples = [s for g in r.scored + r.aside for s in g.samples]  # every stored rollout
        self.totals["rollouts"] += len(samples)
        self.totals["tokens_generated"] += sum(s.num_tokens for s in samples)
        self.totals["tokens_trained"] += int(r.train.get("train/tokens", 0))
        self.totals["tokens_decoded"] = self.totals.get("tokens_decoded", 0) + r.decoded

    def eval_note(self):
        """A progress note for an evaluation: its answers generated and scored out of the
        total (the held-out prompts times run.eval_samples)."""
        start, scorer = self.engine.answers_finished, self.eval_scorer
        total = len(self.task.eval) * self.cfg.run.eval_samples
        scorer.scoring = (0, 0)

        def note() -> str:
            busy = getattr(self.engine, "busy_with", "")  # the first start's compile
            made = min(total, max(0, self.engine.answers_finished - start))
            scored = scorer.scoring[0]
            return busy or (f"held-out answers: {made:,}/{total:,} generated, "
                            f"{scored:,}/{total:,} scored")
        return note

    def tokens_note(self):
        """A progress note: the tokens the engine has generated since this call."""
        start = self.engine.tokens_generated

        def note() -> str:
            busy = getattr(self.engine, "busy_with", "")  # e.g. the first start's compile
            return busy or f"{self.engine.tokens_generated - start:,} tokens"
        return note

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def persist(self, step: int, groups: list[Group], timings: dict | None = None) -> None:
        samples = [s for g in groups for s in g.samples]
        prompts = [self.prompter.text(g.problem) for g in groups for _ in g.samples]
        self.store.append(step, samples, prompts, [self.decode(s.response_ids) for s in samples],
                          {**(timings or {}), "written_at": time.time()})

    # ------------------------------------------------------------------ checkpoint and resume
    def parts(self) -> dict:
        """The stateful parts beside the trainer: their state_dict goes into checkpoints."""
        parts = {**self.control.parts(), "generator": self.generator, "replay": self.replay}
        return {k: p for k, p in parts.items() if p is not None}  # no curriculum: None

    def state_dict(self) -> dict:
        """Everything a resume needs to continue exactly as an uninterrupted run would: model,
        optimizer, scheduler and version; every RNG (the run's, python, numpy, torch, the
        engine's seed stream); selector, in-flight controller (paused partial rollouts),
        generator, replay buffer and per-prompt statistics; totals."""
        return {"trainer": ckpt.trainer_state(self.trainer), "rng": ckpt.rng_state(self.rng),
                "engine": ckpt.engine_state(self.engine), "totals": dict(self.totals),
                **{k: p.state_dict() for k, p in self.parts().items()}}

    def load_state_dict(self, state: dict) -> None:
        ckpt.set_trainer_state(self.trainer, state["trainer"])
        self.sync.push()  # the engine takes the restored weights and version
        if not ckpt.set_engine_state(self.engine, state["engine"]):
            self.progress.log("this engine's seed stream cannot be restored: sampling after "
                              "the resume differs from an uninterrupted run")
        ckpt.set_rng_state(state["rng"], self.rng)
        self.totals = dict(state["totals"])
        for k, p in self.parts().items():
            if k in state:
                p.load_state_dict(state[k])

    def close(self) -> None:
        """Release what runs beside this process: a generator's server, an engine or trainer
        ranks in child processes or Ray actors, verifier workers. Every way out of a run calls
        it (`with Run(...) as run`); a second call does nothing."""
        if self.closed:
            return
        self.closed = True
        for part in (self.generator, self.engine, self.trainer, self.filter, self.eval_scorer):
            part.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def checkpoint(self, step: int, loop: dict) -> None:
        ckpt.save(self.dir, step, {"step": step, "loop": loop, **self.state_dict()},
                  self.cfg.run.keep_checkpoints)
        self.store.checkpointed(step)

    def restore(self, checkpoint: ckpt.Checkpoint) -> dict:
        """Load a checkpoint and drop what came after it (rollouts, later checkpoints), so the
        steps after it are generated again exactly once; returns the loop's saved state."""
        state = checkpoint.load()
        self.load_state_dict(state)
        ckpt.clean(self.dir, checkpoint.step, self.progress.log)
        # an asynchronous run's checkpoint holds steps generated (and stored) but not trained
        queued = [r.step for r in state["loop"].get("queued", [])]
        self.store.truncate(max([checkpoint.step, *queued]))
        self.current_step = checkpoint.step
        return state["loop"]


def train(cfg: Config, progress: Progress | None = None, resume: bool = False,
          inputs: Inputs | None = None) -> dict:
    """Train; with resume, continue the run in run.root/run.name from its newest intact
    checkpoint (starting over when it has none). inputs: Python objects (rollwise.train).
    run.threads holds for this run only: a later run in the same process (a benchmark's next
    arm) with run.threads=0 gets the torch threads the caller had, not this run's."""
    threads = torch.get_num_threads()
    try:
        return _train(cfg, progress, resume, inputs)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        run_dir = Path(cfg.run.root) / cfg.run.name
        raise DiskFullError(f"no space left on the device holding {run_dir} "
                            f"({shutil.disk_usage(run_dir.parent).free / 2**20:.0f} MiB free; "
                            f"{e.filename or 'writing'}): free some, then continue with "
                            f"{resume_hint(run_dir)}. Nothing is lost: the last "
                            f"checkpoint and every stored rollout are intact") from e
    finally:
        torch.set_num_threads(threads)


class DiskFullError(OSError):
    """The disk filled during a run: said with the run's directory and the resume command."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.args[1]


def _train(cfg: Config, progress: Progress | None, resume: bool,
           inputs: Inputs | None) -> dict:
    progress = progress or Progress(cfg.run.log, cfg.train.steps)
    wall0 = time.time()
    found = ckpt.latest(Path(cfg.run.root) / cfg.run.name, progress.log) if resume else None
    if resume and found is None:
        progress.log("no intact checkpoint to resume from: starting the run over")
    with Run(cfg, progress, resume=found is not None, inputs=inputs) as run:
        return _run_loop(run, cfg, progress, found, wall0)


def _run_loop(run: Run, cfg: Config, progress: Progress, found, wall0: float) -> dict:
    progress.log(f"run directory: {run.dir}  ({models.num_params(run.trainer.model) / 1e6:.2f}M "
                 f"parameters, {cfg.train.steps} steps of {cfg.control.prompts_per_step} prompts "
                 f"x {cfg.generate.group_size})")
    if found is None:
        progress.phase("eval", run.eval_note())
        start = last_eval = run.evaluate()
        run.give_back_memory(engine=True)
        progress.log("held-out pass@1 at start: " + _fmt(start))
        loading = progress.take_phase_metrics()  # loading, warm start and first evaluation
        progress.step(0, start)
        sinks = build_sinks(cfg, run.dir, log=progress.log)
        sinks.write(0, {**start, **loading, "wall_seconds": time.time() - wall0})
    else:
        loop = run.restore(found)
        start, last_eval, wall0 = loop["start_eval"], loop["last_eval"], wall0 - loop["wall"]
        progress.log(f"resumed from {found.path} (step {found.step})")
        sinks = build_sinks(cfg, run.dir, log=progress.log, resume_step=found.step)
    progress.take_phase_metrics()  # what came before step 1 is not its phases
    every, stopped = cfg.run.checkpoint_every, None
    queued = [] if found is None else loop.get("queued", [])
    pipeline = None
    if cfg.loop.mode == "async":
        pipeline = Pipeline(run, cfg.loop.max_staleness, cfg.loop.wait_timeout_s, queued)
        steps, idle = pipeline.steps(run.current_step + 1, cfg.train.steps), pipeline.idle
    else:
        steps, idle = sync_steps(run, run.current_step + 1, cfg.train.steps, queued), nullcontext
    # a stop signal in the loop or the final save finishes what is in progress, then acts
    with ckpt.StopOnInterrupt(progress.log) as stop:
        try:
            for r in steps:
                step, m = r.step, step_metrics(r)
                if step % cfg.run.eval_every == 0 or step == cfg.train.steps:
                    progress.phase("eval", run.eval_note())
                    t_eval = time.time()
                    with idle():  # the producer, if any, is parked between its steps
                        last_eval = run.evaluate()
                        run.give_back_memory(engine=True)
                    m.update(last_eval)
                    m["perf/eval_seconds"] = time.time() - t_eval
                m.update(progress.take_phase_metrics())
                m["wall_seconds"] = time.time() - wall0
                sinks.write(step, m)
                progress.step(step, m)
                if stop.requested or step == cfg.train.steps or (every and step % every == 0):
                    sinks.sync()  # the metrics up to this step outlive a power loss, as it will
                    with idle():
                        run.checkpoint(step, {"start_eval": start, "last_eval": last_eval,
                                              "wall": m["wall_seconds"],
                                              "queued": pipeline.queued() if pipeline else []})
                if stop.requested and step < cfg.train.steps:
                    stopped = step
                    break
        finally:  # every way out: the producer stopped, the metrics file closed
            if pipeline is not None:
                pipeline.close()
            sinks.close()
            progress.close()
        if stopped is not None:
            return _stopped(run, progress, stopped, stop.signum)
        return _finished(run, cfg, progress, start, last_eval, wall0)


def _stopped(run: Run, progress: Progress, step: int, signum: int) -> dict:
    run.close()
    if run.cfg.run.report:
        write_report_safely(run.dir, progress.log)
    progress.log(f"stopped after step {step} (checkpoint saved); continue with "
                 f"{resume_hint(run.dir)}")
    return {"stopped_at": step, "stopped_by": signum, "run_dir": str(run.dir), **run.totals}


def _finished(run: Run, cfg: Config, progress: Progress, start: dict, last_eval: dict,
              wall0: float) -> dict:
    """The final model, summary.json and report of a run that did all its steps."""
    run.close()
    models.save(run.trainer.model, run.tokenizer, run.dir / "model", base=run.model_source)
    if run.trainer.adapters:
        progress.log(f"the LoRA adapter is in {run.dir / 'model'} (it loads as the merged model "
                     f"where a model folder is asked for); a full model folder: 'rollwise "
                     f"export {run.dir / 'model'} --merge --out DIR'")
    summary = {"eval_pass1_start": start["eval/pass1"], "eval_pass1_end": last_eval["eval/pass1"],
               "eval_start": start, "eval_end": last_eval, "steps": cfg.train.steps,
               **run.totals, "wall_seconds": time.time() - wall0, "run_dir": str(run.dir),
               "memory_peak_gib": high_water_bytes() / GIB}  # the final save's included
    (run.dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.run.report:
        write_report_safely(run.dir, progress.log)
    progress.log("held-out pass@1 at end:   " + _fmt(last_eval))
    progress.log(f"done in {summary['wall_seconds']:.0f}s: pass@1 "
                 f"{summary['eval_pass1_start']:.3f} -> {summary['eval_pass1_end']:.3f}; "
                 f"summary in {run.dir / 'summary.json'}")
    return summary


def sync_steps(run: Run, first: int, last: int, queued: list[StepResult]):
    """The synchronous loop's steps; steps an asynchronous run produced before its checkpoint
    (`queued`) are trained as they were generated."""
    ready = {r.step: r for r in queued}
    for step in range(first, last + 1):
        yield run.consume(ready.pop(step)) if step in ready else run.step(step)


def write_report_safely(run_dir: Path, log) -> None:
    """report.html for the finished run; a plotting failure is logged, never fatal."""
    try:
        # the report's plotting loads only at the end of a run
        from rollwise.report.report import write_report
        log(f"report: {write_report([run_dir])}")
    except Exception as e:  # the run's results are already on disk
        log(f"report.html not written ({type(e).__name__}: {e}); "
            f"retry with 'rollwise report {run_dir}'")


def _add(into: dict[str, float], metrics: dict[str, float]) -> None:
    for k, v in metrics.items():
        into[k] = into.get(k, 0.0) + v


def _fmt(metrics: dict[str, float]) -> str:
    return "  ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items())
