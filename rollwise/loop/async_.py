"""The asynchronous loop: a producer thread runs the rollout side of later steps (select,
generate, score, persist: Run.produce) while the trainer updates on earlier ones (Run.consume).

    rollwise train loop.mode=async loop.max_staleness=1

- Admission, not dropping: step k's generation starts only once the trainer has finished step
  k - 1 - max_staleness. The trainer updates step k from version k - 1, so every token step k
  samples (at version >= k - 1 - max_staleness) is trained at most max_staleness versions
  late, as AReaL's and SkyRL's admission bound it.
- Weights mid-rollout: the trainer pushes each new version between two decode steps of the
  engine (WeightGate). Requests in flight go on under the new weights from the K/V the old
  ones computed (loop.carried_kv = keep or auto), or prefill prompt + response again first
  (recompute; the built-in engine); each token keeps the version that sampled it and its
  behaviour log-probability, and the trainer's correction (train.correction: decoupled
  anchor, snapshots, TIS/MIS, VCPO) sees both.
- Idle points: evaluation and checkpoints wait until the producer is between two steps. A
  checkpoint holds the steps produced but not trained yet, so a resume trains each once.
- max_staleness = 0: step k's generation starts after step k - 1 is trained, evaluated and
  checkpointed, the synchronous loop's order, so its numbers are the same bit for bit.
- max_staleness >= 1 is not bit-reproducible, by design: whether a push lands before a step's
  generation or between two of its decode steps depends on how fast each side ran, and that
  decides which version samples each token, its behaviour log-probability and (through the
  new weights) sometimes the token. The record is exact about what happened (every token's
  version and log-probability as sampled); what happened is timing. Measured with
  scripts/async_repeat.py: same-seed runs identical while one side is always the slower,
  and one of two repeats diverging at step 7 of 8 where they were close (BENCHMARKS.md).

Every wait has loop.wait_timeout_s and an error that names what it waited for.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from rollwise.loop.metrics import StepResult


class WeightGate:
    """Keeps a weight push out of the engine while the producer steps it, fair to the push:
    the producer holds the gate for one engine call (Rollout.run: one decode step and its
    events); a waiting push takes it at the next boundary. Re-entrant in the holding thread."""

    def __init__(self):
        self._lock = threading.RLock()
        self._no_push = threading.Event()
        self._no_push.set()
        self._depth = threading.local()

    @contextmanager
    def shared(self):
        depth = getattr(self._depth, "n", 0)
        if depth == 0:
            self._no_push.wait()  # a waiting push goes first
        with self._lock:
            self._depth.n = depth + 1
            try:
                yield
            finally:
                self._depth.n = depth

    @contextmanager
    def exclusive(self, timeout_s: float | None = None):
        """The engine to the push alone, once the producer's engine call in progress ends
        (at most timeout_s: a TimeoutError names the call that does not)."""
        self._no_push.clear()
        try:
            if not self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
                raise TimeoutError(f"waited {timeout_s:.0f}s (loop.wait_timeout_s) for the "
                                   f"producer's engine call to end before pushing weights; "
                                   f"the engine does not answer")
            try:
                yield
            finally:
                self._lock.release()
        finally:
            self._no_push.set()


class GatedEngine:
    """The engine as the producer sees it: every method call under the gate's shared side;
    attributes (version, tokens_generated, model) read through."""

    def __init__(self, engine, gate: WeightGate):
        self.inner, self._gate = engine, gate

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name.startswith("_") or not (inspect.ismethod(attr)
                                        or isinstance(attr, functools.partial)):
            return attr

        def gated(*args, **kwargs):
            with self._gate.shared():
                return attr(*args, **kwargs)
        return gated


class Pipeline:
    """Drives a Run asynchronously: `steps()` yields each trained step in order; the caller
    evaluates and checkpoints inside `idle()`; `queued()` is what a checkpoint must keep."""

    def __init__(self, run, max_staleness: int, timeout_s: float,
                 queued: list[StepResult] = ()):
        self.run, self.eta, self.timeout = run, max_staleness, timeout_s
        self.gate = WeightGate()
        run.engine, run.gate = GatedEngine(run.engine, self.gate), self.gate
        cfg = run.cfg  # None: a bare run (tests)
        self.recompute = cfg is not None and cfg.recomputes_in_flight()
        self.recomputed = 0  # K/V positions dropped at pushes, to be prefilled again
        if cfg is not None and cfg.filter.judge.model is None:  # a judge on the policy's
            run.filter.attach_engine(run.engine, run.tokenizer)  # engine: gated as well
        if cfg is not None and max_staleness > 0 and cfg.train.correction.mode == "none":
            run.progress.log(f"loop.max_staleness = {max_staleness} with train.correction.mode"
                             f" = none: stale tokens are trained as if on-policy; set "
                             f"train.correction.mode=tis train.correction.anchor=version "
                             f"train.correction.snapshots={max_staleness} "
                             f"train.correction.vcpo_lr=true (README: asynchronous training)")
        # a learned controller reads the engine's weights, never the trainer's, which change
        run.control.bind(policy=None)  # under it
        self.cv = threading.Condition()
        self.ready: dict[int, StepResult] = {r.step: r for r in queued}
        self.finished = run.current_step  # trained, evaluated and checkpointed
        self.busy = False  # the producer is inside a step
        self.parks = 0  # idle() calls waiting or running
        self.stopping = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.waited = 0.0  # the trainer's seconds waiting for rollouts

    # ---- the trainer's side ----------------------------------------------------------------
    def steps(self, first: int, last: int) -> Iterator[StepResult]:
        start = max([first - 1, *self.ready]) + 1
        self.thread = threading.Thread(target=self._produce, args=(start, last), daemon=True,
                                       name="rollwise-producer")
        self.thread.start()
        try:
            for step in range(first, last + 1):
                r = self._take(step)
                r.seconds["wait"] = self.waited
                yield self.run.consume(r, push=self._push)
                self._finish(step)  # after the caller's evaluation and checkpoint
        finally:
            self.close()

    def _push(self) -> dict:
        # twice the bound: an engine call that does not answer fails first, naming the engine
        with self.gate.exclusive(2 * self.timeout):
            out = self.run.sync.push()
            if self.recompute:  # loop.carried_kv=recompute: no token on the old weights' K/V
                self.recomputed += self.run.engine.inner.recompute_in_flight()
            return out

    def _take(self, step: int) -> StepResult:
        t0 = time.time()
        with self.cv:
            # twice the bound, as for the push: the producer's own waits (on the engine) end
            # first, so an engine that does not answer is named, not this thread
            ok = self.cv.wait_for(lambda: step in self.ready or self.error is not None
                                  or not self.thread.is_alive(), 2 * self.timeout)
            self.waited = time.time() - t0
            if step in self.ready:
                return self.ready.pop(step)
            if self.error is not None:
                raise RuntimeError(f"the rollout producer failed while generating step "
                                   f"{step}: {self.error}") from self.error
            if not ok:
                raise TimeoutError(f"waited {2 * self.timeout:.0f}s (twice loop.wait_timeout_s) "
                                   f"for the rollouts of step {step} from the producer thread; "
                                   f"it is {'inside a step' if self.busy else 'waiting'}")
            raise RuntimeError(f"the rollout producer ended before step {step}")

    def _finish(self, step: int) -> None:
        with self.cv:
            self.finished = step
            self.cv.notify_all()

    @contextmanager
    def idle(self):
        """The producer between two steps (the engine has nothing in flight) for as long as
        the block runs: evaluation and checkpoints."""
        with self.cv:
            self.parks += 1
            ok = self.cv.wait_for(lambda: not self.busy or self.error is not None,
                                  2 * self.timeout)  # (twice: as in _take)
        try:
            if not ok:
                raise TimeoutError(f"waited {2 * self.timeout:.0f}s (twice loop.wait_timeout_s) "
                                   f"for the producer to finish its step (to evaluate or "
                                   f"checkpoint)")
            yield
        finally:
            with self.cv:
                self.parks -= 1
                self.cv.notify_all()

    def queued(self) -> list[StepResult]:
        """Steps produced (persisted) but not yet trained, oldest first; call inside idle()."""
        return [self.ready[k] for k in sorted(self.ready)]

    def close(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(self.timeout)  # a step in progress finishes first
        if isinstance(self.run.engine, GatedEngine):
            self.run.engine = self.run.engine.inner

    # ---- the producer's side ---------------------------------------------------------------
    def _produce(self, first: int, last: int) -> None:
        try:
            for step in range(first, last + 1):
                if not self._admit(step):
                    return
                try:
                    r = self.run.produce(step)
                finally:
                    with self.cv:
                        self.busy = False
                        self.cv.notify_all()
                with self.cv:
                    self.ready[step] = r
                    self.cv.notify_all()
        except BaseException as e:  # handed to the trainer's thread, which raises it
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def _admit(self, step: int) -> bool:
        """Wait until step `step` may start: the trainer has finished step - 1 - eta and no
        idle() is pending. False when the pipeline is closing."""
        need = step - 1 - self.eta
        with self.cv:
            ok = self.cv.wait_for(lambda: self.stopping or (self.parks == 0
                                                            and self.finished >= need),
                                  self.timeout)
            if self.stopping:
                return False
            if not ok:
                raise TimeoutError(f"the producer waited {self.timeout:.0f}s "
                                   f"(loop.wait_timeout_s) for the trainer to finish step "
                                   f"{need} before generating step {step} "
                                   f"(loop.max_staleness = {self.eta})")
            self.busy = True
            return True
