"""The built-in engine: continuous batching for any Hugging Face causal LM, token in, token out.

    engine = BuiltinEngine(model, max_batch=64)
    completions = engine.generate([Request(ids, SamplingParams(max_new_tokens=32), i) ...])

or, step by step (what trees, partial rollouts and pruning use):

    sid = engine.add(Request(ids, params))
    for event in engine.stream():          # every `segment` tokens and at each end
        if should_branch(event): engine.fork(event.seq_id, 2)
        if should_stop(event): engine.pause(event.seq_id)   # later: engine.resume(sid)

Every token carries its behaviour log-probability (under the distribution actually sampled from,
after temperature, top-k and top-p), that distribution's entropy, and the policy version of the
weights that produced it. `load_weights` writes new weights (full tensors or sparse
(indices, values) updates) into the model in place; tokens sampled after it carry the new version.
Sequences already running keep the K/V computed under older weights, as in vLLM;
`recompute_in_flight()` prefills them again, and so do pause and resume. `pause(keep=True)`
holds a paused sequence's slot and K/V (through weight syncs too) so its resume needs no
prefill; the scheduler evicts kept sequences for room (rollwise/engine/scheduler.py).

`graph` picks how the passes run: "off", the Hugging Face model's own forward (runner.py, any
causal LM); "eager" or "compile", the decode graph (decode_graph.py: the Llama family's
forward over the same slot cache, decode windows sampled on the device; compiled on a CPU,
captured as CUDA graphs on a GPU); "auto", the graph where it reproduces the model (compiled
from AUTO_COMPILE_PARAMS up), else the runner. Every path samples from the same per-request
streams and gives the same tokens up to float rounding.

With `prefix_cache_tokens` > 0 the engine keeps the K/V of finished sequences (up to that many
positions, least recently used dropped first) and a new request whose ids start with one's
prefills only the rest: an agent's next turn (the episode so far + the environment's tokens)
costs the new tokens only. Each request's first event says how many positions it reused
(`Event.cached_tokens`). New weights, or `reset_prefix_cache()`, empty the cache: K/V is never
reused across versions.

With `share_prefix` a request that starts with the same ids as a running one copies those K/V
positions from its slot (rollwise.engine.prefix.LivePrefixes): APRIL's resumed answers prefill
their group's prompt once. Only K/V computed under the current weights is shared.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Iterator, Mapping

import torch

from rollwise.devices import release_freed_memory
from rollwise.engine import compile_cache
from rollwise.engine.adapters import AdapterSpec, MergedAdapters
from rollwise.engine.base import Completion, Engine, Request, SparseUpdate
from rollwise.engine.decode_graph import DecodeGraph
from rollwise.engine.graph_model import unsupported
from rollwise.engine.runner import Runner
from rollwise.engine.sampling import SamplingParams, SeedStream, sample
from rollwise.engine.scheduler import Event, Scheduler, SeqStatus, Sequence, StepOutput, StepPlan

log = logging.getLogger(__name__)

# graph="auto" compiles models from this size up. Measured on a 2-core CPU: the default run's
# 1 M-parameter model ran 37 s with the runner, 35 s on the uncompiled graph and 44 s compiled
# (tracing and compiling cost more than its passes save in a run); SmolLM2 (135 M) earns its
# compile back within its first RL step.
AUTO_COMPILE_PARAMS = 10_000_000
COMPILE_TIME_NOTE = "once per model and torch version: 1-3 min on a 2-core CPU"


def completion_of(seq: Sequence) -> Completion:
    return Completion(seq.request_id, list(seq.tokens), list(seq.logprobs), list(seq.entropies),
                      list(seq.versions), seq.finish_reason or "length", seq.seq_id, seq.parent,
                      seq.branch_point, list(seq.top_logprobs) if seq.top_logprobs else None,
                      seq.hidden)


class BuiltinEngine(Engine):
    """Continuous batching over `max_batch` KV slots; see the module docstring."""

    def __init__(self, model, *, max_batch: int = 1024, seed: int = 0,
                 version: int = 0, copy_model: bool = True, segment: int = 16,
                 kv_budget_tokens: int | None = None, max_prefill_tokens: int = 8192,
                 prefix_cache_tokens: int = 0, graph: str = "auto",
                 share_prefix: bool = False):
        if copy_model:
            model = copy.deepcopy(model)
            model.eval().requires_grad_(False)
        self.runner = Runner(model)
        self.graph: DecodeGraph | None = None
        self._graph_mode = graph
        self.max_batch = max_batch
        self.version = version
        self.tokens_generated = 0
        self.prefill_tokens = 0  # prompt (and resumed) tokens run through the model
        self.forward_passes = 0  # model forward passes (decode ticks), windows counted per pass
        self.scheduler = Scheduler(max_batch, kv_budget_tokens=kv_budget_tokens,
                                   max_prefill_tokens=max_prefill_tokens, segment=segment,
                                   prefix_cache_tokens=prefix_cache_tokens,
                                   share_prefix=share_prefix)
        self._seeds = random.Random(seed)
        self._next_id = 0
        self._vocab = model.get_input_embeddings().num_embeddings
        self._last_logp = None  # the latest step's sampled distributions: [row] -> log p
        self._last_seqs: list[Sequence] = []  # the sequences of _last_logp's rows
        self._ready: list[Event] = []  # events of forks that ended at birth
        self.adapters: MergedAdapters | None = None  # LoRA: what weight sync writes
        self.graph_note: str | None = None  # why graph="auto" kept the runner's path
        self.graph_compile_seconds = 0.0  # the decode graph's compile (or cache load) time
        self.busy_with = ""  # what a step is doing besides generating (a compile), for progress

    @property
    def prefix_tokens_saved(self) -> int:
        """Prompt and response tokens forked children, and requests sharing a running one's
        prefix (share_prefix), did not prefill again (K/V copied)."""
        return self.scheduler.fork_tokens_saved + self.scheduler.shared_prefix_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        """Prompt positions new requests loaded from the prefix cache instead of prefilling."""
        return self.scheduler.prefix_hit_tokens

    def reset_prefix_cache(self) -> None:
        """Drop every kept prefix (vLLM's reset_prefix_cache)."""
        self.scheduler.reset_prefix_cache()
        self._keep_prefixes()

    def _keep_prefixes(self) -> None:
        """Copy finished sequences' K/V into the prefix cache before their slots are reused."""
        saves, drops = self.scheduler.take_saves()
        if saves or drops:
            self.runner.keep_prefixes(saves, drops)

    @property
    def model(self):
        """The live model: its parameters are the weights generation uses."""
        return self.runner.model

    # ---- requests ---------------------------------------------------------------------------
    def add(self, request: Request) -> int:
        """Queue a request; returns its seq_id for events, fork, abort, pause and resume."""
        ids = list(request.prompt_ids)
        if not ids:
            raise ValueError(f"request {request.id!r} has an empty prompt; give at least one "
                             f"token")
        if min(ids) < 0 or max(ids) >= self._vocab:
            raise ValueError(f"request {request.id!r}: prompt token ids must lie in "
                             f"[0, {self._vocab}) (the model's vocabulary)")
        seq = Sequence(self._new_id(), request.id, ids, request.params,
                       rng=self._stream(request.params.seed))
        self.scheduler.add(seq)
        return seq.seq_id

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def state_dict(self) -> dict:
        """The request-seed stream and id counter: requests without a seed draw from it, so a
        restored engine samples what an uninterrupted one would."""
        return {"seeds": self._seeds.getstate(), "next_id": self._next_id}

    def load_state_dict(self, state: dict) -> None:
        self._seeds.setstate(state["seeds"])
        self._next_id = state["next_id"]

    def _stream(self, seed: int | None) -> SeedStream:
        return SeedStream(seed if seed is not None else self._seeds.getrandbits(63))

    @property
    def answers_finished(self) -> int:
        return self.scheduler.finished

    def release_idle_memory(self) -> bool:
        """On a CPU, between steps: the K/V cache and the decode windows' buffers are freed
        and their pages handed back to the OS (a GPU's are kept: its graphs are captured on
        them). Nothing is freed while a sequence is waiting, running or kept (paused with its
        K/V); a sequence paused without it holds none."""
        s = self.scheduler
        if (self.runner.device.type != "cpu" or s.has_work() or s.kept or self._ready
                or not self.runner.cache.k):
            return False
        self.runner.cache.resize(0, 0)
        if self.graph is not None:
            self.graph.release()
        release_freed_memory()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._ready)

    def step(self) -> list[Event]:
        """One forward pass: every running sequence gets a token, waiting ones are admitted.
        When nobody can be admitted and no sequence is due an event, the passes up to the next
        event (a segment boundary, a length limit or a stop id) run in this one call: events
        come at the same tokens, with less bookkeeping per token."""
        events, self._ready = self._ready, []
        plan = self.scheduler.schedule()
        if not plan.sequences:
            self.runner.cache.resize(plan.cache_rows, plan.cache_len)
            return events
        seqs = plan.sequences
        want_hidden = any(s.params.return_hidden for s in seqs)
        graph = self._decode_graph()
        if graph is not None and not plan.prefill:
            return events + self._graph_window(graph, plan, self.scheduler.decode_window(plan))
        if graph is None and not want_hidden and not any(s.params.top_logprobs for s in seqs):
            steps = self.scheduler.decode_window(plan)
            if steps > 1:
                return events + self._window(plan, steps)
        logits, hidden = (graph or self.runner).forward(plan, want_hidden)
        out = self._sample(seqs, logits, hidden)
        self.tokens_generated += len(seqs)
        self.prefill_tokens += plan.num_tokens - len(plan.decode)
        self.forward_passes += 1
        events += self.scheduler.update(plan, out)
        self._keep_prefixes()
        return events

    def _decode_graph(self) -> DecodeGraph | None:
        """The fast path, built at the first step (the model has its final dtype and device
        by then): graph="compile" or "eager" ask for it, "auto" takes it where it runs and
        reproduces the model, compiled from AUTO_COMPILE_PARAMS parameters up, "off" keeps
        the runner's path."""
        mode = self._graph_mode
        if mode == "off" or self.graph is not None:
            return self.graph
        model = self.runner.model
        reason = unsupported(model)
        if reason is None:
            compile = mode == "compile" or (mode == "auto" and sum(
                p.numel() for p in model.parameters()) >= AUTO_COMPILE_PARAMS)
            graph = DecodeGraph(self.runner, compile=compile, segment=self.scheduler.segment,
                                batch=self.scheduler.max_slots)
            err = graph.model.check()
            tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
            if err > tolerance:
                reason = (f"its logits differ from the model's own forward by {err:.2g} of "
                          f"their scale")
        if reason is not None:
            if mode != "auto":
                raise ValueError(f"engine graph={mode!r}: the decode graph cannot run "
                                 f"{type(model).__name__} ({reason}); use graph='off'")
            self.graph_note = reason
            self._graph_mode = "off"
            log.warning("engine.graph=auto: %s runs on the runner's path, not the decode graph "
                        "(%s)", type(model).__name__, reason)
            return None
        if graph.compiled:
            graph = self._compiled_or_eager(graph)
        self.graph = graph
        return graph

    def _compiled_or_eager(self, graph: DecodeGraph) -> DecodeGraph:
        """The compiled graph, warmed up (compiled, or loaded from torch's cache); where that
        fails, the uncompiled graph, said once with the cache to clear."""
        removed = compile_cache.repair()
        if removed:
            log.warning("engine: removed %d damaged file(s) an interrupted compile left in "
                        "torch's compile cache (%s); they compile again", len(removed),
                        compile_cache.cache_dir())
        log.warning("engine: compiling the decode graph (%s); later starts load it from "
                    "torch's compile cache", COMPILE_TIME_NOTE)
        self.busy_with = f"compiling the decode graph ({COMPILE_TIME_NOTE})"
        try:
            self.graph_compile_seconds = graph.warm_up()
            return graph
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self.graph_note = f"the compiled decode graph failed ({type(e).__name__}: {first})"
            log.warning("engine: %s; running the uncompiled decode graph instead (same tokens, "
                        "slower). If an interrupted start damaged torch's compile cache, clear "
                        "it (rm -rf %s) and the next start compiles again", self.graph_note,
                        compile_cache.cache_dir())
            return DecodeGraph(self.runner, compile=False, segment=self.scheduler.segment,
                               batch=self.scheduler.max_slots)
        finally:
            self.busy_with = ""

    def _graph_window(self, graph: DecodeGraph, plan: StepPlan, steps: int) -> list[Event]:
        """Up to `steps` decode passes on the decode graph, sampled on the device."""
        seqs = plan.decode
        out = graph.window(plan, steps)
        self._last_logp, self._last_seqs = out.last_logp, seqs
        before = sum(len(s.tokens) for s in seqs)
        events = self.scheduler.update_window(plan, out.tokens, out.logprobs, out.entropies,
                                              self.version, out.top_logprobs, out.hidden)
        self._keep_prefixes()
        self.tokens_generated += sum(len(s.tokens) for s in seqs) - before
        self.forward_passes += out.passes
        return events

    def _window(self, plan: StepPlan, steps: int) -> list[Event]:
        """Up to `steps` decode passes back to back (Scheduler.decode_window): the same sampling
        per pass, the results kept as tensors and turned into lists once at the end. A pass that
        samples a stop id ends the window, so finish events come at the same step as step by
        step (callers such as APRIL react to them)."""
        seqs = plan.decode
        params = [s.params for s in seqs]
        stops = _stop_table(params, self.runner.device)
        picked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def choose(logits: torch.Tensor) -> torch.Tensor | None:
            tokens, tok_logp, ent, logp = sample(logits, params, [s.rng.next() for s in seqs])
            picked.append((tokens, tok_logp, ent))
            self._last_logp = logp
            if stops is not None and bool((tokens[:, None] == stops).any()):
                return None
            return tokens

        self.runner.decode_window(plan, steps, choose)
        self._last_seqs = seqs
        tokens, logps, ents = (torch.stack(x, dim=1).tolist() for x in zip(*picked))
        before = sum(len(s.tokens) for s in seqs)
        events = self.scheduler.update_window(plan, tokens, logps, ents, self.version)
        self._keep_prefixes()
        self.tokens_generated += sum(len(s.tokens) for s in seqs) - before
        self.forward_passes += len(picked)
        return events

    def stream(self) -> Iterator[Event]:
        """Step until nothing is waiting or running, yielding events as they come."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run `requests` to the end; completions in request order (a blocking convenience)."""
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine, but sequences added with add() "
                               "are in flight; drive those with step()/stream()")
        seqs = []
        try:
            for r in requests:
                seqs.append(self.scheduler.get(self.add(r)))
        except Exception:
            for s in seqs:
                self.scheduler.abort(s.seq_id)
            raise
        for _ in self.stream():
            pass
        return [completion_of(s) for s in seqs]

    # ---- sampling -------------------------------------------------------------------------------
    def _sample(self, seqs: list[Sequence], logits: torch.Tensor,
                hidden: torch.Tensor | None) -> StepOutput:
        params = [s.params for s in seqs]
        # one draw per sampled token and sequence (greedy ones too): a stream's position is
        # its token count, on every path
        k = max(p.top_logprobs for p in params)
        if self.graph is not None and not k:
            tokens, tok_logp, ent, logp = self.graph.sample(seqs, logits)
        else:
            tokens, tok_logp, ent, logp = sample(logits, params, [s.rng.next() for s in seqs])
        self._last_logp, self._last_seqs = logp, seqs
        top = None
        if k:
            vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
            vals, idx = vals.tolist(), idx.tolist()
            top = [list(zip(idx[i][:p.top_logprobs], vals[i][:p.top_logprobs]))
                   for i, p in enumerate(params)]
        rows = None
        if hidden is not None:
            rows = [hidden[i].float().cpu() if p.return_hidden else None
                    for i, p in enumerate(params)]
        return StepOutput(tokens.tolist(), tok_logp.tolist(), ent.tolist(), self.version, top,
                          rows)

    # ---- control between steps --------------------------------------------------------------
    def fork(self, seq_id: int, n: int, *, seeds: list[int] | None = None,
             params: SamplingParams | None = None,
             last_tokens: list[int] | None = None) -> list[int]:
        """n children continuing from the sequence's current state; returns their seq_ids.

        Children share the parent's prefix: its K/V rows are copied, with no re-prefill, when
        slots are free (else they wait first in the queue and re-prefill). Each child draws from
        its own stream (`seeds`), so a child with seed s continues exactly as a fresh request
        with prompt + the parent's tokens and seed s would. `last_tokens` replaces the parent's
        latest token in each child (branch on an alternative, as LATR and ECHO do); its
        log-probability is read from the same distribution the parent's token came from.
        """
        parent = self.scheduler.get(seq_id)
        if parent.status not in (SeqStatus.RUNNING, SeqStatus.WAITING):
            raise ValueError(f"sequence {seq_id} is {parent.status.value}; fork a waiting or "
                             f"running one (resume a paused one first)")
        for name, given in (("seeds", seeds), ("last_tokens", last_tokens)):
            if given is not None and len(given) != n:
                raise ValueError(f"fork(n={n}) got {len(given)} {name}; give one per child")
        children = [self._child(parent, i, seeds, params, last_tokens) for i in range(n)]
        ended = [c for c in children if c.done_reason() is not None]
        live = [c for c in children if c.done_reason() is None]
        self.scheduler.finished += len(ended)
        for c in ended:  # branched onto a stop token or the length limit: done at birth
            c.status, c.finish_reason = SeqStatus.FINISHED, c.done_reason()
            self._ready.append(self.scheduler.event(c))
        if live:
            self.scheduler.fork(parent, live)
        return [c.seq_id for c in children]

    def _child(self, parent: Sequence, i: int, seeds, params, last_tokens) -> Sequence:
        n = len(parent.tokens)
        child = Sequence(self._new_id(), parent.request_id, list(parent.prompt),
                         params or parent.params,
                         rng=self._stream(seeds[i] if seeds is not None else None),
                         tokens=list(parent.tokens), logprobs=list(parent.logprobs),
                         entropies=list(parent.entropies), versions=list(parent.versions),
                         top_logprobs=list(parent.top_logprobs), hidden=parent.hidden,
                         parent=parent.seq_id, branch_point=n, emitted=n)
        if last_tokens is not None:
            row = next((i for i, s in enumerate(self._last_seqs) if s is parent), None)
            if not n or row is None:
                raise ValueError(f"fork(last_tokens=...) of sequence {parent.seq_id}: it has "
                                 f"sampled no token in the latest step; fork it right after "
                                 f"one of its events")
            tok = int(last_tokens[i])
            child.tokens[-1] = tok
            child.logprobs[-1] = self._last_logp[row][tok].item()  # type: ignore[index]
            child.branch_point = child.emitted = n - 1
        return child

    def abort(self, seq_id: int) -> Completion:
        """Stop a sequence and free its slot; returns what it had (finish_reason "abort")."""
        return completion_of(self.scheduler.abort(seq_id))

    can_keep_paused = True

    def pause(self, seq_id: int, keep: bool = False) -> Completion:
        """Stop a sequence, keeping it for `resume`; returns the partial completion
        (finish_reason "paused"). keep=False frees its slot and memory; keep=True holds its
        slot and K/V, across weight syncs too, until it is resumed (or evicted for room:
        then its resume prefills again; rollwise/engine/scheduler.py)."""
        return completion_of(self.scheduler.pause(seq_id, keep=keep))

    def resume(self, seq_id: int) -> None:
        """Continue a paused sequence with its own random stream: a kept one from its K/V at
        the next pass, another queued ahead of new requests to re-prefill prompt + partial
        response under the current weights."""
        self.scheduler.resume(seq_id)

    def recompute_in_flight(self) -> int:
        """After a weight sync: every running sequence prefills prompt + tokens again under
        the new weights before its next token (loop.carried_kv=recompute in the async loop);
        returns the K/V positions dropped."""
        return self.scheduler.recompute_running()

    def find_paused(self, request_id, ids: list[int]) -> tuple[int, int] | None:
        """(seq_id, its response tokens) of a paused sequence of this request whose prompt +
        tokens are `ids`, kept ones first; None if there is none."""
        s = self.scheduler
        for seq in (*s.kept.values(), *s.paused.values()):
            if seq.request_id == request_id and seq.prompt + seq.tokens == list(ids):
                return seq.seq_id, len(seq.tokens)
        return None

    def kept_metrics(self) -> dict[str, int]:
        """Kept pauses so far: positions resumed from kept K/V (not prefilled) and kept
        sequences evicted for room, and those kept now."""
        s = self.scheduler
        return {"kept_resumed_tokens": s.kept_resumed_tokens, "kept_evicted": s.evicted_kept,
                "kept_now": len(s.kept)}

    def metrics(self) -> dict[str, float]:
        """The kept pauses' counts (engine/kept_*, totals over the run), once any was made."""
        kept = self.kept_metrics()
        return {f"engine/{k}": float(v) for k, v in kept.items()} if any(kept.values()) \
            else {}

    # ---- weights ------------------------------------------------------------------------------
    def use_adapters(self, spec: AdapterSpec) -> None:
        """From now on weight sync writes LoRA adapters (rollwise/engine/adapters.py), merged
        into the model's weights as each sync ends; the current weights are the base."""
        self.adapters = MergedAdapters(spec, self.model.state_dict())

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The live model's tensors (tied weights under each name, one storage), or the
        adapters once use_adapters was called."""
        if self.adapters is not None:
            return self.adapters.tensors
        return self.model.state_dict()

    def weights_written(self, version: int) -> None:
        """Generation reads the model's tensors directly (adapters are merged into them
        first): the version changes, and prefixes kept under the old weights are dropped."""
        if self.adapters is not None:
            self.adapters.merge()
        if self.graph is not None:  # packed copies follow (in-place writes are seen anyway)
            self.graph.refresh(force=True)
        self.version = version
        self.reset_prefix_cache()

    def load_weights(self, weights: Mapping[str, torch.Tensor | SparseUpdate | tuple],
                     version: int) -> None:
        """Write new weights in place: a tensor replaces the named tensor, a SparseUpdate (or an
        (indices, values) pair) replaces the values at those flat indices. Names not given keep
        their values. Tokens sampled after this carry `version`."""
        own = self.weight_tensors()  # tied weights appear under each name; writes are shared
        unknown = [k for k in weights if k not in own]
        if unknown:
            raise KeyError(f"load_weights: tensors not in the engine's model: {unknown[:5]}")
        with torch.no_grad():
            for name, value in weights.items():
                target = own[name]
                if isinstance(value, torch.Tensor):
                    if value.shape != target.shape:
                        raise ValueError(f"load_weights: {name} has shape {tuple(value.shape)}, "
                                         f"the model's is {tuple(target.shape)}")
                    target.copy_(value)
                else:
                    _scatter(name, target, *value)
        self.weights_written(version)


def _stop_table(params: list[SamplingParams], device: torch.device) -> torch.Tensor | None:
    """(rows, most stop ids) of each row's stop ids, padded with -1; None if no row has any."""
    width = max(len(p.stop_ids) for p in params)
    if not width:
        return None
    return torch.tensor([list(p.stop_ids) + [-1] * (width - len(p.stop_ids)) for p in params],
                        device=device)


def _scatter(name: str, target: torch.Tensor, indices: torch.Tensor,
             values: torch.Tensor) -> None:
    if indices.shape != values.shape or indices.dim() != 1:
        raise ValueError(f"load_weights: sparse update of {name} needs 1-D indices and values "
                         f"of one length, got {tuple(indices.shape)} and {tuple(values.shape)}")
    if not target.is_contiguous():
        raise ValueError(f"load_weights: {name} is not contiguous; send it whole")
    if len(indices) and int(indices.max()) >= target.numel():
        raise ValueError(f"load_weights: sparse update of {name} has index {int(indices.max())}"
                         f" past its {target.numel()} elements")
    target.view(-1)[indices.to(target.device, torch.long)] = values.to(target.device,
                                                                      target.dtype)
