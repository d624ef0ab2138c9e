"""Capturing a decode pass as a CUDA graph, checked before it is trusted.

A captured graph replays the kernels it recorded, reading and writing the window's tensors
where they live; a capture can fail (an operation that cannot be captured, memory, a driver)
or record something that does not compute what the eager pass does. Both are found at the
first pass of a bucket: the pass runs eagerly, the window's state goes back to before it, the
graph replays it, and its tokens must equal the eager pass's (log-probabilities within
REPLAY_LOGP_TOLERANCE). Where either fails the window's state is put back to the eager pass's
result and the caller decodes on without graphs (decode_graph.py).

`CudaGraphs` is the one place that touches torch.cuda's graph API; a test replaces it with a
capturer that fails or corrupts, on the CPU.
"""

from __future__ import annotations

from typing import Callable

import torch

REPLAY_LOGP_TOLERANCE = 1e-3  # the same kernels on the same inputs: only ordering noise

# What a decode pass changes in a window's state (decode_graph.WindowState).
PASS_WRITES = ("ids", "positions", "counts", "done", "step", "tokens", "logprobs",
               "entropies", "top_ids", "top_values", "hidden")


class CaptureFailed(RuntimeError):
    """The captured path cannot be used: it failed to capture, or replays other tokens."""


class CudaGraphs:
    """Runs a pass on a side stream (the warm-up a capture needs) and records it as a CUDA
    graph in one memory pool shared by every bucket."""

    def __init__(self):
        self._pool = None

    def warm(self, run_pass: Callable[[], None]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_pass()
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self, run_pass: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):  # records, runs nothing
            run_pass()
        return graph.replay


def snapshot(state) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n in PASS_WRITES if (t := getattr(state, n)) is not None}


def restore(state, saved: dict[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        getattr(state, name).copy_(value)  # in place: a captured graph holds these addresses


def capture_checked(capturer, run_pass: Callable[[], None], state) -> Callable[[], None]:
    """One pass of `state`'s window, eagerly, then its capture, replayed and checked against
    it. Returns the replay; raises CaptureFailed with the reason. Either way the state ends as
    after one correct pass (the K/V it wrote included: a failed replay's are written again)."""
    before = snapshot(state)
    capturer.warm(run_pass)
    step = int(before["step"][0])
    live = state.live
    tokens = state.tokens[step, :live].clone()
    logprobs = state.logprobs[step, :live].clone()
    try:
        replay = capturer.capture(run_pass)
        restore(state, before)
        replay()
        reason = _disagreement(tokens, logprobs, state.tokens[step, :live],
                               state.logprobs[step, :live])
    except Exception as e:  # any capture error: the eager path is still right
        first = (str(e).strip().splitlines() or [""])[0][:300]
        reason = f"its capture failed ({type(e).__name__}: {first})"
    if reason is None:
        return replay
    restore(state, before)
    run_pass()
    raise CaptureFailed(reason)


def _disagreement(tokens: torch.Tensor, logprobs: torch.Tensor, got_tokens: torch.Tensor,
                  got_logprobs: torch.Tensor) -> str | None:
    wrong = int((tokens != got_tokens).sum())
    if wrong:
        return (f"its replay sampled other tokens than the eager pass in {wrong} of "
                f"{len(tokens)} rows")
    gap = float((logprobs - got_logprobs).abs().max()) if len(tokens) else 0.0
    if not gap <= REPLAY_LOGP_TOLERANCE:
        return (f"its replay's log-probabilities differ from the eager pass's by {gap:.2g} "
                f"(over {REPLAY_LOGP_TOLERANCE:g})")
    return None
