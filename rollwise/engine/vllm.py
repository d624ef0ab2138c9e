"""The engine protocol over vLLM (optional extra `rollwise[vllm]`; the only module importing vLLM).

    engine = VLLMEngine("path/to/hf_model", max_batch=64, segment=16)
    completions = engine.generate(requests)        # same Request/Completion/Event as Engine

It drives vLLM's `LLMEngine` step by step, in process (VLLM_ENABLE_V1_MULTIPROCESSING=0), with
token-id prompts, streamed deltas and `logprobs_mode="processed_logprobs"`, so each token's
log-probability is under the distribution actually sampled from. Where it differs from the
built-in engine:

- entropy comes from the returned log-probabilities: exact with `entropy_logprobs=-1` (the whole
  vocabulary, the default), the top-k part of the sum otherwise (a lower bound; the training
  loop asks for the top 20 where the vocabulary is large: rollwise.engine.backends);
- fork and resume submit a new request with prompt + tokens so far; vLLM's prefix cache reuses
  the shared K/V (full blocks), as it does for an agent's next turn; each request's first event
  says how many prompt tokens it reused (`Event.cached_tokens`, vLLM's num_cached_tokens).
  A child with seed s is by construction a fresh request with seed s.
  A resumed sequence draws from a new stream (seed derived from its seed and length), because a
  vLLM request cannot restart mid-stream;
- `load_weights` keeps a copy of the weights in Hugging Face layout (vLLM's CPU kernels repack
  them), applies full or sparse updates to it and reloads the whole set in place with
  `reload_weights`, then resets the prefix cache so no stale K/V is reused;
- hidden states are not exposed by vLLM's API: `return_hidden` raises.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from rollwise.engine.adapters import MergedAdapters, save_peft_adapter, uniform, zero_adapters
from rollwise.engine.base import Completion, Engine, Request, SparseUpdate
from rollwise.engine.builtin import _scatter, completion_of
from rollwise.engine.sampling import SamplingParams, derived_seed
from rollwise.engine.scheduler import Event, SeqStatus, Sequence
from rollwise.sync.payload import to_dtype

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMEngine(Engine):
    adapters: MergedAdapters | None = None  # LoRA merged into the mirror
    _native = None  # LoRA applied by vLLM: (AdapterSpec, the adapter tensors)
    _lora = None  # the LoRARequest every request carries once adapters are loaded

    def __init__(self, model_path: str | Path, *, seed: int = 0, version: int = 0,
                 max_batch: int = 64, segment: int = 16, dtype: str = "float32",
                 entropy_logprobs: int = -1, sleep_level: int = 0, lora_rank: int = 0,
                 **engine_kwargs):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM (an optional dependency) loads with the first engine
        from vllm import EngineArgs, LLMEngine
        self.model_path = Path(model_path)
        config = json.loads((self.model_path / "config.json").read_text())
        self._tied = bool(config.get("tie_word_embeddings", False))
        self._vocab = int(config["vocab_size"])
        # no chunked prefill: a chunked request's sampled token is discarded, and vLLM cannot
        # rewind a seeded CPU generator for it (RuntimeError: CPU Generator does not use offset)
        kwargs = dict(enforce_eager=True, enable_prefix_caching=True, enable_chunked_prefill=False,
                      generation_config="vllm") | engine_kwargs
        self.lora_rank = lora_rank  # > 0: vLLM's LoRA layers, for use_adapters
        self.dtype = dtype  # of its weights, and of the adapters it is sent
        if lora_rank:
            kwargs |= dict(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(lora_rank))
        args = EngineArgs(model=str(model_path), skip_tokenizer_init=True, dtype=dtype,
                          seed=seed, max_num_seqs=max_batch, max_logprobs=-1,
                          logprobs_mode="processed_logprobs", **kwargs)
        with _hidden_from_vllm_scan():
            self.llm = LLMEngine.from_engine_args(args)
        self.model = None  # weights live inside vLLM: update them with load_weights
        self.version = version
        self.tokens_generated = 0
        self.segment = segment
        self.max_batch = max_batch
        self.entropy_logprobs = entropy_logprobs
        self._seeds = random.Random(seed)
        self._next_id = 0
        self._live: dict[int, Sequence] = {}
        self._unanswered: set[int] = set()  # submitted, no output yet (cached tokens to read)
        self._paused: dict[int, Sequence] = {}
        self._last_dist: dict[int, dict[int, float]] = {}
        self._ready: list[Event] = []
        self._mirror: dict[str, torch.Tensor] | None = None
        self.sleep_level, self.sleeping = sleep_level, False

    # ---- requests ---------------------------------------------------------------------------
    def add(self, request: Request) -> int:
        self.wake()
        ids = list(request.prompt_ids)
        if not ids or min(ids) < 0 or max(ids) >= self._vocab:
            raise ValueError(f"request {request.id!r}: give a non-empty prompt of token ids in "
                             f"[0, {self._vocab})")
        if request.params.return_hidden:
            raise NotImplementedError("return_hidden: vLLM's API does not expose hidden states;"
                                      " use the built-in engine")
        seed = request.params.seed
        seq = Sequence(self._new_id(), request.id, ids, request.params,
                       rng=seed if seed is not None else self._seeds.getrandbits(63))
        self._submit(seq, seq.rng)
        return seq.seq_id

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def state_dict(self) -> dict:
        """The request-seed stream and id counter (as the built-in engine's)."""
        return {"seeds": self._seeds.getstate(), "next_id": self._next_id}

    def load_state_dict(self, state: dict) -> None:
        self._seeds.setstate(state["seeds"])
        self._next_id = state["next_id"]

    def _submit(self, seq: Sequence, seed: int) -> None:
        # vLLM: loaded by now; imported here with its first use
        from vllm import SamplingParams as VParams
        from vllm.sampling_params import RequestOutputKind
        p: SamplingParams = seq.params
        k = -1 if self.entropy_logprobs < 0 else max(p.top_logprobs, self.entropy_logprobs, 1)
        vp = VParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                     max_tokens=p.max_new_tokens - len(seq.tokens),
                     stop_token_ids=list(p.stop_ids), ignore_eos=True, seed=seed,
                     logprobs=k,
                     output_kind=RequestOutputKind.DELTA, detokenize=False)
        seq.status, seq.finish_reason = SeqStatus.RUNNING, None
        self._live[seq.seq_id] = seq
        self._unanswered.add(seq.seq_id)
        self.llm.add_request(str(seq.seq_id), {"prompt_token_ids": seq.prefill_ids}, vp,
                             lora_request=self._lora)

    def has_unfinished(self) -> bool:
        return bool(self._live) or bool(self._ready)

    def step(self) -> list[Event]:
        events, self._ready = self._ready, []
        if not self._live:
            return events
        for out in self.llm.step():
            seq = self._live.get(int(out.request_id))
            if seq is None:
                continue
            o = out.outputs[0]
            if seq.seq_id in self._unanswered:
                self._unanswered.discard(seq.seq_id)
                seq.prefix_hit = out.num_cached_tokens or 0
            for j, tok in enumerate(o.token_ids):
                self._append(seq, tok, o.logprobs[j] if o.logprobs else None)
            self.tokens_generated += len(o.token_ids)
            if out.finished:
                del self._live[seq.seq_id]
                seq.status = SeqStatus.FINISHED
                seq.finish_reason = _FINISH.get(o.finish_reason or "", "length")
            every = seq.params.event_every or self.segment
            if out.finished or len(seq.tokens) - seq.emitted >= every:
                events.append(_event(seq))
        return events

    def _append(self, seq: Sequence, tok: int, dist) -> None:
        if dist is None:
            raise RuntimeError("vLLM returned no log-probabilities; the engine asks for them")
        lps = {t: lp.logprob for t, lp in dist.items()}
        ent = -sum(math.exp(v) * v for v in lps.values() if v > -math.inf)
        seq.tokens.append(tok)
        seq.logprobs.append(lps[tok])
        seq.entropies.append(ent)
        seq.versions.append(self.version)
        if seq.params.top_logprobs:
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:seq.params.top_logprobs]
            seq.top_logprobs.append(top)
        self._last_dist[seq.seq_id] = lps

    def stream(self) -> Iterator[Event]:
        while self.has_unfinished():
            yield from self.step()

    def generate(self, requests: list[Request]) -> list[Completion]:
        if self.has_unfinished():
            raise RuntimeError("generate() needs an idle engine, but sequences added with add() "
                               "are in flight; drive those with step()/stream()")
        ids = [self.add(r) for r in requests]
        seqs = [self._live[i] for i in ids]
        for _ in self.stream():
            pass
        return [completion_of(s) for s in seqs]

    # ---- control between steps --------------------------------------------------------------
    def _get_live(self, seq_id: int) -> Sequence:
        if seq_id not in self._live:
            raise KeyError(f"sequence {seq_id} is not running (finished, aborted, paused or "
                           f"never added)")
        return self._live[seq_id]

    def abort(self, seq_id: int) -> Completion:
        seq = self._paused.pop(seq_id, None) or self._get_live(seq_id)
        if seq.seq_id in self._live:
            self.llm.abort_request([str(seq_id)])
            del self._live[seq_id]
            self._unanswered.discard(seq_id)
        seq.status, seq.finish_reason = SeqStatus.ABORTED, "abort"
        seq.emitted = len(seq.tokens)
        return completion_of(seq)

    def pause(self, seq_id: int) -> Completion:
        seq = self._get_live(seq_id)
        self.llm.abort_request([str(seq_id)])
        del self._live[seq_id]
        self._unanswered.discard(seq_id)
        seq.status, seq.finish_reason = SeqStatus.PAUSED, "paused"
        seq.emitted = len(seq.tokens)
        self._paused[seq_id] = seq
        return completion_of(seq)

    def resume(self, seq_id: int) -> None:
        seq = self._paused.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not paused; pause it before resume")
        self._submit(seq, derived_seed(seq.rng, len(seq.tokens)))

    def fork(self, seq_id: int, n: int, *, seeds: list[int] | None = None,
             params: SamplingParams | None = None,
             last_tokens: list[int] | None = None) -> list[int]:
        parent = self._get_live(seq_id)
        for name, given in (("seeds", seeds), ("last_tokens", last_tokens)):
            if given is not None and len(given) != n:
                raise ValueError(f"fork(n={n}) got {len(given)} {name}; give one per child")
        out = []
        for i in range(n):
            seed = seeds[i] if seeds is not None else self._seeds.getrandbits(63)
            m = len(parent.tokens)
            child = Sequence(self._new_id(), parent.request_id, list(parent.prompt),
                             params or parent.params, rng=seed, tokens=list(parent.tokens),
                             logprobs=list(parent.logprobs), entropies=list(parent.entropies),
                             versions=list(parent.versions),
                             top_logprobs=list(parent.top_logprobs), parent=parent.seq_id,
                             branch_point=m, emitted=m)
            if last_tokens is not None:
                dist = self._last_dist.get(parent.seq_id)
                if not m or dist is None or (self.entropy_logprobs >= 0
                                             and last_tokens[i] not in dist):
                    raise ValueError(f"fork(last_tokens=...) of sequence {seq_id} needs the "
                                     f"full distribution of its latest token "
                                     f"(entropy_logprobs=-1)")
                child.tokens[-1] = int(last_tokens[i])
                child.logprobs[-1] = dist.get(int(last_tokens[i]), -math.inf)
                child.branch_point = child.emitted = m - 1
            out.append(child.seq_id)
            reason = child.done_reason()
            if reason is not None:
                child.status, child.finish_reason = SeqStatus.FINISHED, reason
                self._ready.append(_event(child))
            else:
                self._submit(child, seed)
        return out

    def reset_prefix_cache(self) -> None:
        if not self.sleeping:  # a sleeping engine emptied its cache when it went to sleep
            self.llm.reset_prefix_cache()

    # ---- sharing a GPU with the trainer ------------------------------------------------------
    def sleep(self) -> None:
        """Free the GPU for the trainer (engine.sleep_level): no request may be in flight.
        Paused sequences stay (they are resubmitted with their tokens on resume)."""
        if not self.sleep_level or self.sleeping:
            return
        if self._live:
            raise RuntimeError(f"sleep: {len(self._live)} sequence(s) still running; pause or "
                               "finish them first")
        self.llm.reset_prefix_cache()
        self.llm.sleep(level=self.sleep_level)
        self.sleeping = True

    def wake(self, tags: list[str] | None = None) -> None:
        """Take the GPU back: tags=['weights'] first when new weights are to be written."""
        if not self.sleeping:
            return
        self.llm.wake_up(tags)
        self.sleeping = tags is not None and "kv_cache" not in tags

    # ---- weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, torch.Tensor | SparseUpdate | tuple],
                     version: int) -> None:
        """Apply full or sparse updates to the Hugging Face-layout copy, reload all weights into
        vLLM in place, and drop cached prefixes computed with the old weights."""
        mirror = self.weight_tensors()
        for name, value in weights.items():
            key = "model.embed_tokens.weight" if name == "lm_head.weight" and self._tied \
                and name not in mirror else name
            if key not in mirror:
                raise KeyError(f"load_weights: {name} is not a weight of {self.model_path}")
            if isinstance(value, torch.Tensor):
                if value.shape != mirror[key].shape:
                    raise ValueError(f"load_weights: {name} has shape {tuple(value.shape)}, the "
                                     f"model's is {tuple(mirror[key].shape)}")
                mirror[key].copy_(value)
            else:
                _scatter(name, mirror[key], *value)
        self.weights_written(version)

    def use_adapters(self, spec) -> None:
        """LoRA: weight sync writes the adapters. Built with lora_rank, vLLM applies them
        itself (its LoRA layers, one adapter reloaded in place at each sync: the base weights
        are never reloaded); otherwise they are merged into the Hugging Face-layout copy,
        which is reloaded whole (rollwise/engine/adapters.py)."""
        if not self.lora_rank:
            self.adapters = MergedAdapters(spec, self.hf_weights())
            return
        rank, _ = uniform(spec)
        if rank > self.lora_rank:
            raise ValueError(f"adapters of rank {rank}, but this vLLM engine was built for "
                             f"rank <= {self.lora_rank}")
        self._native = (spec, zero_adapters(spec, to_dtype(self.dtype)))
        self._lora_dir = tempfile.TemporaryDirectory(prefix="rollwise-lora-")

    def _load_adapters(self) -> None:
        """Write the adapters where vLLM reads them and reload them in place: every request,
        running ones too, computes with them from the next token on."""
        from vllm.lora.request import LoRARequest  # vLLM: loaded by now
        spec, tensors = self._native
        save_peft_adapter(spec, tensors, self._lora_dir.name)
        self._lora = LoRARequest("policy", 1, self._lora_dir.name)
        self.llm.add_lora(LoRARequest("policy", 1, self._lora_dir.name, load_inplace=True))

    def weights_written(self, version: int) -> None:
        """Reload the whole mirror into vLLM in place (its CPU kernels repack weights, so they
        cannot be written directly), or only the adapters where vLLM applies them, and drop
        cached prefixes computed with the old weights. A sleeping engine wakes its weights
        first, so the update is never lost to a sleep."""
        if self.adapters is not None:
            self.adapters.merge()
        if self.sleeping:
            self.wake(["weights"])
        if self._native is not None:
            self._load_adapters()
        else:
            self.llm.collective_rpc("reload_weights", kwargs=dict(
                weights_iterator=list(self.hf_weights().items()), is_checkpoint_format=True))
        if self._tied and self._native is None:
            self.llm.apply_model(_retie_lm_head)
        if self.sleeping:
            self.wake(["kv_cache"])
        self.llm.reset_prefix_cache()
        self.version = version

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """Where weight sync writes before it calls weights_written: the Hugging Face-layout
        weights (hf_weights), or the adapters once use_adapters was called."""
        if self.adapters is not None:
            return self.adapters.tensors
        if self._native is not None:
            return self._native[1]
        return self.hf_weights()

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The weights in Hugging Face layout, as loaded from the model folder and updated
        since."""
        if self._mirror is None:
            # safetensors: only to read a saved folder back
            from safetensors.torch import load_file
            files = sorted(self.model_path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.model_path}: no *.safetensors weights to mirror")
            self._mirror = {}
            for f in files:
                self._mirror.update(load_file(f))
        return self._mirror


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM's max_lora_rank takes


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"train.lora.rank={rank}: vLLM takes adapters up to rank "
                     f"{VLLM_LORA_RANKS[-1]}")


def _event(seq: Sequence) -> Event:
    a = seq.emitted
    seq.emitted = len(seq.tokens)
    hit, seq.prefix_hit = seq.prefix_hit, 0
    return Event(seq.seq_id, seq.request_id, seq.tokens[a:], seq.logprobs[a:],
                 seq.entropies[a:], seq.versions[a:], seq.status is not SeqStatus.RUNNING,
                 seq.finish_reason, seq.top_logprobs[a:] if seq.top_logprobs else None,
                 cached_tokens=hit)


@contextlib.contextmanager
def _hidden_from_vllm_scan():
    """vLLM's start-up rebinds Triton kernels by scanning every loaded module and reading
    vars(attr) of each attribute; an object whose __dict__ is not a dict (llvmlite's ffi.lib,
    loaded with numba by sparse weight sync) breaks that scan (AttributeError:
    '_lib_fn_wrapper' object has no attribute 'get'). Such modules leave sys.modules while vLLM
    starts and come back after; nothing in them is a vLLM kernel."""
    hidden = {name: m for name, m in list(sys.modules.items()) if not _scannable(m)}
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)


def _scannable(module) -> bool:
    """Whether vLLM's scan (vllm/triton_utils/dispatcher.py) reads this module without error."""
    for value in list((getattr(module, "__dict__", None) or {}).values()):
        try:
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")
        except Exception:
            return False
    return True


def _retie_lm_head(model) -> None:
    """vLLM reloads only modules whose weights arrived: a tied lm_head (its name is skipped on
    load) would keep the old embedding and, on CPU, its old prepacked GEMM weight."""
    head, embed = model.lm_head, model.model.embed_tokens
    head.weight = embed.weight
    head.quant_method.process_weights_after_loading(head)
