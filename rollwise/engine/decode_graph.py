"""The engine's fast path: steps through the graph forward (graph_model.py), and decode windows
whose every pass samples on the device, so the host touches the window once at each end.

    graph = DecodeGraph(runner, compile=True)
    logits, hidden = graph.forward(plan, want_hidden)      # any plan: prefills join decodes
    out = graph.window(plan, steps)                          # decode-only: `steps` passes

A window's state lives in device tensors (`WindowState`): each row's next input token, position,
seed and draw count (its uniforms come from sampling.stream_uniforms, the same numbers the host
draws), sampling settings and stop ids, and (W, B) buffers for the tokens, behaviour
log-probabilities and entropies of each pass. A pass reads and advances that state in place and
writes its row of the buffers, so a pass is the same operations every time: on CUDA it is
captured once per (batch bucket, key bucket, variant) as a CUDA graph and replayed, with no
host synchronisation inside the window; on a CPU the layer, head and sampler are compiled
(`torch.compile`, dynamic shapes: one compilation serves every batch) and the host checks after
each pass whether a row stopped, which costs nothing there, so a finished sequence frees its
slot at the same step as on the runner's path. On CUDA rows that stop run on, masked, to the
window's end (at most `segment` passes), and the events come then.

The captured graphs read the model's weights where they live, so weights written in place take
effect at the next pass; the slot cache and any reallocated weight invalidate them (they are
captured again). See graph_model.py for the CPU's packed weights.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rollwise.engine.capture import CaptureFailed, CudaGraphs, capture_checked
from rollwise.engine.graph_model import (
    GraphModel,
    build_prefill,
    compile_settings,
    unsupported,
    varying,
)
from rollwise.engine.runner import SPARE_POSITIONS
from rollwise.engine.sampling import logprobs_in_graph, sample_in_graph, stream_uniforms
from rollwise.engine.scheduler import StepPlan

log = logging.getLogger(__name__)

KEY_ALIGN = 16  # a window attends over keys rounded up to this (CPU) ...
CUDA_KEY_ALIGN = 128  # ... or this on CUDA, where each key bucket is a captured graph
CUDA_ROW_ALIGN = 8  # batch buckets on CUDA: rows padded up to a multiple of this


@dataclass(frozen=True)
class Variant:
    """What a window's pass is specialised for, fixed for the window."""

    filtered: bool  # some row has top-k or top-p: the sampler sorts the vocabulary
    greedy_rows: bool  # some row is greedy: the sampler takes an argmax
    top_logprobs: int  # report this many top log-probabilities per token (0: none)
    hidden: bool  # keep each row's last hidden state


@dataclass
class WindowOut:
    """A window's results for plan.decode, row by row, cut to the passes that ran."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    entropies: list[list[float]]
    top_logprobs: list[list[list[tuple[int, float]]]] | None
    hidden: list[torch.Tensor] | None
    last_logp: LastDistributions  # the last pass's sampled distributions, row by row
    passes: int


@dataclass
class LastDistributions:
    """A window's last sampled distributions, computed on demand (only a fork onto another
    token reads them): `last[row]` is that row's log-probabilities over the vocabulary."""

    logits: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    filtered: bool

    def __getitem__(self, row: int) -> torch.Tensor:
        r = slice(row, row + 1)
        return logprobs_in_graph(self.logits[r], self.temperature[r], self.top_k[r],
                                 self.top_p[r], self.filtered)[0]


class WindowState:
    """Device tensors for a window of B rows (B may include padding rows on CUDA)."""

    def __init__(self, rows: int, passes: int, keys: int, stops: int, variant: Variant,
                 hidden_size: int, device: torch.device, dtype: torch.dtype):
        def z(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)
        self.ids, self.positions, self.seeds, self.counts = z(rows), z(rows), z(rows), z(rows)
        self.keys = torch.arange(keys, device=device)
        self.temperature, self.top_p = z(rows, dtype=torch.float32), z(rows, dtype=torch.float32)
        self.top_k = z(rows)
        self.stops = z(rows, max(stops, 1))
        self.done = z(rows, dtype=torch.bool)
        self.step = z(1)
        self.tokens, self.logprobs = z(passes, rows), z(passes, rows, dtype=torch.float32)
        self.entropies = z(passes, rows, dtype=torch.float32)
        k = variant.top_logprobs
        self.top_ids = z(passes, rows, k) if k else None
        self.top_values = z(passes, rows, k, dtype=torch.float32) if k else None
        self.hidden = z(rows, hidden_size, dtype=dtype) if variant.hidden else None
        self.last_logits: torch.Tensor | None = None  # the last pass's, for its distributions

    def fill(self, plan: StepPlan) -> None:
        """Load the window's starting values (rows past plan.decode stay idle: greedy, done)."""
        seqs = plan.decode
        n, dev = len(seqs), self.ids.device
        self.live = n  # rows past it pad a bucket
        params = [s.params for s in seqs]
        pad = self.ids.shape[0] - n
        width = self.stops.shape[1]

        def put(dst: torch.Tensor, values: list, fill=0) -> None:
            dst.copy_(torch.tensor(values + [fill] * pad, dtype=dst.dtype).to(dev))
        put(self.ids, [s.tokens[-1] for s in seqs])
        put(self.positions, [s.cached for s in seqs])
        put(self.seeds, [s.rng.seed for s in seqs])
        put(self.counts, [s.rng.count for s in seqs])
        put(self.temperature, [float(p.temperature) for p in params])
        put(self.top_k, [p.top_k for p in params])
        put(self.top_p, [float(p.top_p) for p in params], 1.0)
        put(self.done, [False] * n, True)
        stops = [list(p.stop_ids) + [-1] * (width - len(p.stop_ids)) for p in params]
        self.stops.copy_(torch.tensor(stops + [[-1] * width] * pad).to(dev))
        self.step.zero_()


def _longs(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def variant_filtered(plan: StepPlan) -> bool:
    return any(s.params.top_k > 0 or s.params.top_p < 1 for s in plan.decode)


def variant_of(plan: StepPlan) -> Variant:
    params = [s.params for s in plan.decode]
    return Variant(variant_filtered(plan), any(p.temperature == 0 for p in params),
                   max(p.top_logprobs for p in params), any(p.return_hidden for p in params))


class DecodeGraph:
    """The runner's cache and model through the graph forward; see the module docstring."""

    def __init__(self, runner, compile: bool, segment: int = 16, batch: int = 64):
        reason = unsupported(runner.model)
        if reason is not None:
            raise ValueError(f"the decode graph cannot run {type(runner.model).__name__}: "
                             f"{reason}")
        self.runner = runner
        self.model = GraphModel(runner.model, compile=compile, batch=batch)
        self.device = runner.device
        self.cuda = self.device.type == "cuda"
        self.compiled = compile
        self._sample, self._logprobs = sample_in_graph, logprobs_in_graph
        if compile:
            self._sample, self._logprobs = (torch.compile(f, fullgraph=True)
                                            for f in (sample_in_graph, logprobs_in_graph))
        self._states: dict[tuple, WindowState] = {}
        self._graphs: dict[tuple, Callable[[], None]] = {}  # bucket: its captured replay
        self.capturer = CudaGraphs() if self.cuda else None  # None: passes run uncaptured
        self.capture_note: str | None = None  # why captured graphs were given up, if they were
        self._cache_id: tuple | None = None
        self.captures = 0  # CUDA graphs captured so far (each bucket once per cache)
        self.segment = segment  # most passes in a window (the window buffers' length)
        self.pad_rows = CUDA_ROW_ALIGN if self.cuda else 0  # window rows padded to a multiple

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile, on a scratch cache, every structure a run meets: decode batches of one row
        and of several, one prefill and several (and a one-token extension), greedy and
        sampled windows; so no pass of the run stops to compile. Returns its seconds."""
        t = time.perf_counter()
        s, p = self.model.shape, next(self.runner.model.parameters())
        shape = (3, s.kv_heads, 32 + SPARE_POSITIONS, s.head_dim)
        k, v = ({i: torch.zeros(shape, dtype=p.dtype, device=p.device)
                 for i in range(len(self.model.weights.layers))} for _ in range(2))
        dev = self.device
        with compile_settings():
            for parts in ([(0, 0, 4), (1, 0, 3)], [(2, 0, 5)], [(2, 5, 1)]):
                ids = torch.zeros(sum(n for _, _, n in parts), dtype=torch.long, device=dev)
                self.model.prefill(ids, build_prefill(parts, dev),
                                   torch.arange(len(parts), device=dev), k, v)
            for b in (2, 1):
                rows = torch.arange(b, device=dev)
                logits, _ = self.model.decode(rows, rows + 4, torch.arange(8, device=dev), k, v)
                for greedy in (False, True):
                    self._sample(varying(logits), varying(torch.full((b,), float(not greedy),
                                                                     device=dev)),
                                 varying(torch.zeros(b, dtype=torch.long, device=dev)),
                                 varying(torch.ones(b, device=dev)),
                                 varying(torch.zeros(b, device=dev)), False, greedy)
        return time.perf_counter() - t

    # ---- any step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, plan: StepPlan, want_hidden: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (n, vocab) for plan.sequences, in order, and their last hidden states (the
        runner's forward): the decode rows in one pass, the prefills in another. Two passes
        read the weights twice, which on a CPU costs about what one pass over all the rows
        saves (matrix time grows with the rows), and keeps one compiled decode graph."""
        self._prepare(plan)
        cache, dev = self.runner.cache, self.device
        logits, hidden = [], []
        with compile_settings():
            if plan.decode:
                positions = [s.cached for s in plan.decode]
                out = self.model.decode(_longs([s.tokens[-1] for s in plan.decode], dev),
                                        _longs(positions, dev),
                                        torch.arange(max(positions) + 1, device=dev),
                                        cache.k, cache.v)
                logits.append(out[0]), hidden.append(out[1])
            if plan.prefill:
                out = self._prefill(plan)
                logits.append(out[0]), hidden.append(out[1])
        cache.copy_many(plan.after_copies)
        return torch.cat(logits), torch.cat(hidden) if want_hidden else None

    @torch.inference_mode()
    def sample(self, seqs: list, logits: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LastDistributions]:
        """One token per row of a step's logits (a step with prefills), by the compiled
        sampler, each row drawing the next uniform of its stream: (tokens, their
        log-probabilities, entropies, the distributions)."""
        params = [s.params for s in seqs]
        dev = logits.device
        seeds = _longs([s.rng.seed for s in seqs], dev)
        counts = _longs([s.rng.count for s in seqs], dev)
        for s in seqs:
            s.rng.advance(1)
        temperature = torch.tensor([float(p.temperature) for p in params], device=dev)
        top_k = _longs([p.top_k for p in params], dev)
        top_p = torch.tensor([float(p.top_p) for p in params], device=dev)
        filtered = any(p.top_k > 0 or p.top_p < 1 for p in params)
        with compile_settings():
            tokens, token_logp, ent = self._sample(
                varying(logits), varying(temperature), varying(top_k), varying(top_p),
                varying(stream_uniforms(seeds, counts)), filtered,
                any(p.temperature == 0 for p in params))
        return tokens, token_logp, ent, LastDistributions(logits, temperature, top_k, top_p,
                                                          filtered)

    def _prefill(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefills' pass: logits of each one's last row, then of each follower's leader."""
        cache, ids, last, row = self.runner.cache, [], {}, 0
        parts = []
        for s in plan.prefill:
            fed = s.prefill_ids[s.cached:]
            parts.append((s.slot, s.cached, len(fed)))
            ids += fed
            row += len(fed)
            last[id(s)] = row - 1
        out_rows = [last[id(s)] for s in plan.prefill] + [last[id(lead)]
                                                          for _, lead in plan.shared]
        dev = self.device
        return self.model.prefill(_longs(ids, dev), build_prefill(parts, dev),
                                  _longs(out_rows, dev), cache.k, cache.v)

    def _prepare(self, plan: StepPlan) -> None:
        self.refresh()
        self.runner.prepare(plan)
        s = self.model.shape
        p = next(self.runner.model.parameters())
        self.runner.cache.allocate(len(self.model.weights.layers), s.kv_heads, s.head_dim,
                                   p.dtype, p.device)

    def release(self) -> None:
        """Forget the windows' buffers and captured graphs (the cache they used is gone)."""
        self._states.clear()
        self._graphs.clear()
        self._cache_id = None

    def refresh(self, force: bool = False) -> None:
        """Bring the weights up to date (packed copies of any weight written since, or all
        with `force`); drop captured graphs if a weight moved to new memory (model.to)."""
        if self.model.weights.refresh(force):
            self._graphs.clear()  # recaptured on first use: a few passes' time

    # ---- decode windows ---------------------------------------------------------------------
    @torch.inference_mode()
    def window(self, plan: StepPlan, steps: int) -> WindowOut:
        """Up to `steps` decode passes of a decode-only plan (rows in slots 0..B-1)."""
        self._prepare(plan)
        variant = variant_of(plan)
        state = self._state(plan, steps, variant)
        state.fill(plan)
        passes = self._run(state, variant, steps)
        return self._collect(state, plan, passes)

    def _state(self, plan: StepPlan, steps: int, variant: Variant) -> WindowState:
        cache = self.runner.cache
        b = len(plan.decode)
        reach = max(s.cached for s in plan.decode) + steps  # keys the last pass reads
        align = CUDA_KEY_ALIGN if self.cuda else KEY_ALIGN
        keys = min(-(-reach // align) * align, cache.length)
        rows = b
        if self.pad_rows:  # a bucket of rows that the cache holds (padding rows idle in free
            rows = min(-(-b // self.pad_rows) * self.pad_rows, cache.rows)  # slots)
        passes = max(steps, self.segment)
        stops = max(len(s.params.stop_ids) for s in plan.decode)
        key = (rows, keys, passes, max(stops, 1), variant)
        state = self._states.get(key)
        if state is None:
            if self.capturer is None:  # nothing holds a state's addresses: one at a time
                self._states.clear()
            state = WindowState(rows, passes, keys, stops, variant, self._hidden_size(),
                                self.device, next(self.runner.model.parameters()).dtype)
            self._states[key] = state
        return state

    def _hidden_size(self) -> int:
        return self.runner.model.config.hidden_size

    def _pass(self, st: WindowState, variant: Variant) -> None:
        """One decode pass over the window's state, in place (what a CUDA graph captures)."""
        cache = self.runner.cache
        logits, hidden = self.model.decode(st.ids, st.positions, st.keys, cache.k, cache.v)
        uniforms = stream_uniforms(st.seeds, st.counts)
        settings = (varying(st.temperature), varying(st.top_k), varying(st.top_p))
        tokens, token_logp, ent = self._sample(varying(logits), *settings, varying(uniforms),
                                               variant.filtered, variant.greedy_rows)
        st.tokens.index_copy_(0, st.step, tokens[None])
        st.logprobs.index_copy_(0, st.step, token_logp[None])
        st.entropies.index_copy_(0, st.step, ent[None])
        if variant.top_logprobs:
            logp = self._logprobs(logits, *settings, variant.filtered)
            values, ids = logp.topk(variant.top_logprobs, dim=-1)
            st.top_values.index_copy_(0, st.step, values[None])
            st.top_ids.index_copy_(0, st.step, ids[None])
        if variant.hidden:  # a row's hidden state stays at its stop token
            st.hidden.copy_(torch.where(st.done[:, None], st.hidden, hidden))
        st.done |= (tokens[:, None] == st.stops).any(-1)
        st.ids.copy_(tokens)
        st.positions.add_(1)
        st.counts.add_(1)
        st.step.add_(1)
        st.last_logits = logits

    def _run(self, st: WindowState, variant: Variant, steps: int) -> int:
        with compile_settings():
            if self.capturer is not None and self.capture_note is None:
                return self._replay(st, variant, steps)
            return self._passes(st, variant, steps)

    def _passes(self, st: WindowState, variant: Variant, steps: int, done: int = 0) -> int:
        """Passes `done`..`steps` uncaptured, the host checking after each whether a row
        stopped (free on a CPU; on CUDA a sync a pass, where captured graphs were given up)."""
        while done < steps:
            if done and bool(st.done[:st.live].any()):  # a stop ends the window there, as
                break  # on the runner's path (no check before a window's first pass)
            self._pass(st, variant)
            done += 1
        return done

    def _replay(self, st: WindowState, variant: Variant, steps: int) -> int:
        """CUDA: the first pass of a new bucket runs eagerly (it compiles and warms up), then
        is captured and checked (capture.py); every other pass is one graph replay, with no
        sync. A capture that fails or disagrees gives up graphs for the run, said once."""
        cache = self.runner.cache
        cache_id = (cache.rows, cache.length, next(iter(cache.k.values())).data_ptr())
        if cache_id != self._cache_id:
            self._graphs.clear()
            self._cache_id = cache_id
        key = (id(st), variant)
        done = 0
        replay = self._graphs.get(key)
        if replay is None:
            try:
                replay = capture_checked(self.capturer, lambda: self._pass(st, variant), st)
            except CaptureFailed as e:
                self._give_up_capture(str(e))
                return self._passes(st, variant, steps, done=1)
            done = 1
            self._graphs[key] = replay
            self.captures += 1
        for _ in range(done, steps):
            replay()
        return steps

    def _give_up_capture(self, reason: str) -> None:
        self.capture_note = f"the CUDA graph of a decode pass: {reason}"
        self._graphs.clear()
        log.warning("engine: %s; decoding on without captured graphs (the same tokens, one "
                    "host launch per kernel and a sync per pass)", self.capture_note)

    def _collect(self, st: WindowState, plan: StepPlan, passes: int) -> WindowOut:
        b = len(plan.decode)
        tokens = st.tokens[:passes, :b].T.tolist()
        logprobs = st.logprobs[:passes, :b].T.tolist()
        entropies = st.entropies[:passes, :b].T.tolist()
        top = None
        if st.top_ids is not None:
            ids = st.top_ids[:passes, :b].transpose(0, 1).tolist()
            values = st.top_values[:passes, :b].transpose(0, 1).tolist()
            top = [[[(i, v) for i, v in zip(ri[:s.params.top_logprobs],
                                             rv[:s.params.top_logprobs])]
                    for ri, rv in zip(ids[r], values[r])] for r, s in enumerate(plan.decode)]
        hidden = None
        if st.hidden is not None:
            h = st.hidden[:b].float().cpu()
            hidden = [h[i] if s.params.return_hidden else None
                      for i, s in enumerate(plan.decode)]
        for s in plan.decode:
            s.rng.advance(passes)
        last = LastDistributions(st.last_logits[:b], st.temperature[:b], st.top_k[:b],
                                 st.top_p[:b], variant_filtered(plan))
        return WindowOut(tokens, logprobs, entropies, top, hidden, last, passes)
