"""A decoder's forward pass over the slot cache as plain tensor code, for the decode graph.

The runner (runner.py) drives the unmodified Hugging Face model through its attention interface,
which works for any model but issues ~40 small operations per layer from Python. Here the same
arithmetic is written out for the Llama family (Llama, Qwen2, Qwen3, Mistral and any model with
their module layout: pre-norm residual blocks, rotary attention with grouped K/V heads, a gated
MLP), so that `torch.compile` can fuse each layer's elementwise work and a CUDA graph can
replay a whole decode step. `GraphModel.check` compares it with the Hugging Face forward on the
live weights before it is used; a model it does not reproduce keeps the runner's path.

A pass takes flat rows, as the runner's does: first B decode rows, one per running sequence in
slots 0..B-1, then the tokens of m prefills (`Rows`). Every row's K/V is written into its slot
at its position first; a decode row then attends over keys 0..its position of its own slot (one
slice of the cache, a per-row length mask), a prefill's rows over their slot's keys causally.

Weights: the module's own tensors, so a weight written in place is used by the next pass with
nothing rebuilt. On a CPU with oneDNN, bfloat16 Linear weights are used as oneDNN's packed
copies instead (Q/K/V and gate/up fused into one product each), which halves a 64-row decode
step's matrix time on AMX; the copies are rebuilt when a source tensor's version counter moves
(any in-place write: weight sync, a LoRA merge, an optimizer step on a shared model) and on
`GraphWeights.refresh(force=True)`, which the engine calls whenever it is told of new weights.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch._dynamo.config as dynamo_config
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F


@torch.library.custom_op("rollwise::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """x @ weight.T + bias with a weight oneDNN packed (torch.ops.mkldnn._reorder_linear_weight):
    an opaque call to the compiler, which cannot lower the packed layout itself."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


class Linear(NamedTuple):
    """One matrix product: a weight (dense, or oneDNN-packed), its bias, and the widths its
    output splits into (several for a fused Q/K/V or gate/up product)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    widths: tuple[int, ...]
    packed: bool  # a plain flag: a traced graph sees weights as fake tensors, not their layout


def project(x: torch.Tensor, linears: tuple[Linear, ...]) -> list[torch.Tensor]:
    """The outputs of a group of products (fused or not), split into their parts."""
    out: list[torch.Tensor] = []
    for lin in linears:
        if lin.packed:
            y = packed_linear(x, lin.weight, lin.bias)
        else:
            y = F.linear(x, lin.weight, lin.bias)
        out += list(y.split(list(lin.widths), -1)) if len(lin.widths) > 1 else [y]
    return out


class LayerWeights(NamedTuple):
    input_norm: torch.Tensor
    qkv: tuple[Linear, ...]
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm of each head's query and key before rotary
    k_norm: torch.Tensor | None
    o: tuple[Linear, ...]
    post_norm: torch.Tensor
    gate_up: tuple[Linear, ...]
    down: tuple[Linear, ...]


class Prefill(NamedTuple):
    """A prefill pass's layout as device tensors: m sequences' rows laid end to end (Np
    rows), each written at its slot and position and attending over keys 0..Lp-1 of its slot
    up to its own position. Sizes are carried by shapes: one compiled graph serves them all."""

    row_slots: torch.Tensor  # (Np,) each row's slot
    row_positions: torch.Tensor  # (Np,) each row's position: where its K/V goes
    slots: torch.Tensor  # (m,) each prefill's slot
    index: torch.Tensor  # (m, P) each prefill's rows (padded with its first row)
    take: torch.Tensor  # (Np,) the real rows of the padded (m * P) layout
    positions: torch.Tensor  # (m, P) each padded query's position (past the end: padding)
    keys: torch.Tensor  # (Lp,) arange


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scaling: float

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.heads // self.kv_heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: normalised in float32, scaled in the input's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _attention_inputs(h: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                      shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows h (N, hidden) -> q (N, heads, d), k and v (N, kv_heads, d), rotated."""
    n, d = h.shape[0], shape.head_dim
    q, k, v = project(rms_norm(h, w.input_norm, shape.eps), w.qkv)
    q, k, v = q.view(n, shape.heads, d), k.view(n, shape.kv_heads, d), v.view(n, shape.kv_heads, d)
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, shape.eps), rms_norm(k, w.k_norm, shape.eps)
    return _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None]), v


def _finish_layer(h: torch.Tensor, attn: torch.Tensor, w: LayerWeights, act,
                  shape: Shape) -> torch.Tensor:
    """The output projection, the residual, and the gated MLP block."""
    h = h + project(attn, w.o)[0]
    gate, up = project(rms_norm(h, w.post_norm, shape.eps), w.gate_up)
    return h + project(act(gate) * up, w.down)[0]


def make_layers(shape: Shape, act):
    """A model's decode and prefill layer functions; its sizes and activation are constants
    of the functions (a compiled graph specialises on them, not on the batch)."""
    def decode_layer(h: torch.Tensor, w: LayerWeights, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """B decode rows, row i in slot i at positions[i]: its K/V written there, then its
        query over keys 0..its position of the slot (the cache's first B rows as one slice,
        a per-row length mask; a K/V head's query heads as one query block, no repeat)."""
        b, lb = h.shape[0], keys.shape[0]
        q, k, v = _attention_inputs(h, w, cos, sin, shape)
        rows = torch.arange(b, device=h.device)
        k_cache[rows, :, positions] = k
        v_cache[rows, :, positions] = v
        visible = keys[None, :] <= positions[:, None]
        attn = F.scaled_dot_product_attention(
            q.reshape(b, shape.kv_heads, shape.group, shape.head_dim), k_cache[:b, :, :lb],
            v_cache[:b, :, :lb], attn_mask=visible[:, None, None, :], scale=shape.scaling)
        return _finish_layer(h, attn.reshape(b, shape.heads * shape.head_dim), w, act, shape)

    def prefill_layer(h: torch.Tensor, w: LayerWeights, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      pre: Prefill) -> torch.Tensor:
        """m prefills' rows: K/V written at their slots and positions, then each prefill's
        queries (padded to P) over its slot's keys, causally by position."""
        q, k, v = _attention_inputs(h, w, cos, sin, shape)
        k_cache[pre.row_slots, :, pre.row_positions] = k
        v_cache[pre.row_slots, :, pre.row_positions] = v
        m, p = pre.index.shape
        lp = pre.keys.shape[0]
        kp = k_cache.index_select(0, pre.slots)[:, :, :lp]
        vp = v_cache.index_select(0, pre.slots)[:, :, :lp]
        if shape.group > 1:  # each K/V head repeated for its query heads (m is small)
            kp, vp = kp.repeat_interleave(shape.group, 1), vp.repeat_interleave(shape.group, 1)
        visible = pre.keys[None, None, :] <= pre.positions[:, :, None]
        attn = F.scaled_dot_product_attention(q[pre.index].transpose(1, 2), kp, vp,
                                              attn_mask=visible[:, None], scale=shape.scaling)
        attn = attn.transpose(1, 2).reshape(m * p, shape.heads * shape.head_dim)
        return _finish_layer(h, attn.index_select(0, pre.take), w, act, shape)
    return decode_layer, prefill_layer


def embed_rows(ids: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, rotary
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows' embeddings and their rotary cos and sin (the model's own rotary module: its
    scaling variants included)."""
    h = F.embedding(ids, table)
    cos, sin = rotary(h[None], positions[None])
    return h, cos[0].to(h.dtype), sin[0].to(h.dtype)


def head_rows(h: torch.Tensor, norm: torch.Tensor, head: tuple[Linear, ...], eps: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, last hidden states) of rows, in the model's dtype (the sampler reads them in
    float32)."""
    hidden = rms_norm(h, norm, eps)
    return project(hidden, head)[0], hidden


def unsupported(model) -> str | None:
    """Why the graph forward cannot run this model (None: it has the Llama family's layout;
    `GraphModel.check` then compares the arithmetic itself)."""
    cfg = model.config
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if decoder is None or any(not hasattr(decoder, name) for name in needed):
        return f"{type(model).__name__} is not laid out as a Llama-family decoder"
    layer = decoder.layers[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    parts = [(attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
             (mlp, ("gate_proj", "up_proj", "down_proj", "act_fn")),
             (layer, ("input_layernorm", "post_attention_layernorm"))]
    if any(owner is None or not all(hasattr(owner, n) for n in names) for owner, names in parts):
        return f"{type(layer).__name__} is not a Llama-family block (q/k/v/o, gate/up/down)"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None):
            return name
    if model.get_output_embeddings() is None:
        return "no output embeddings"
    return None


class GraphWeights:
    """Each layer's weights for the layer functions: the live tensors, or packed copies kept
    in step with them (see the module docstring)."""

    def __init__(self, model, pack: bool, batch: int = 64):
        self.model = model
        self.pack = pack
        # the rows oneDNN lays the packed weights out for. Measured on AMX (SmolLM2's 121
        # products per pass): packed for 64 rows, 38 ms at 64 rows but 272 ms at 512 (plain
        # products 65 and 225); packed for 512 rows, 38 and 203 ms.
        self.batch_hint = 64 if batch <= 256 else 512
        self._params = list(model.parameters())
        self.decoder = model.get_decoder()
        self.layers: list[LayerWeights] = []
        self.head: tuple[Linear, ...] = ()
        self._versions: list[tuple[int, int]] = []
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> bool:
        """Rebuild the packed copies if any weight was written since (the live tensors need
        nothing); True if a weight moved to new memory (model.to), which a captured graph
        must follow."""
        versions = [(p._version, p.data_ptr()) for p in self._params]
        moved = [v[1] for v in versions] != [v[1] for v in self._versions]
        if force or moved or (self.pack and versions != self._versions):
            with torch.inference_mode():  # as every pass runs: compiled code sees one kind
                self.layers = [self._layer(layer) for layer in self.decoder.layers]
                self.head = self._group([self.model.get_output_embeddings()])
        self._versions = versions
        return moved

    def _group(self, modules: list) -> tuple[Linear, ...]:
        """Linears fed the same input: one packed product of their concatenated weights, or
        each module's live weight."""
        if not self.pack:
            return tuple(Linear(m.weight, m.bias, (m.weight.shape[0],), False) for m in modules)
        weight = torch.cat([m.weight for m in modules]) if len(modules) > 1 else modules[0].weight
        biases = [m.bias for m in modules]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else m.weight.new_zeros(m.weight.shape[0])
                              for b, m in zip(biases, modules)])
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.batch_hint)
        return (Linear(packed, bias, tuple(m.weight.shape[0] for m in modules), True),)

    def _layer(self, layer) -> LayerWeights:
        a, m = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return LayerWeights(
            layer.input_layernorm.weight, self._group([a.q_proj, a.k_proj, a.v_proj]),
            None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
            self._group([a.o_proj]), layer.post_attention_layernorm.weight,
            self._group([m.gate_proj, m.up_proj]), self._group([m.down_proj]))


def can_pack(model) -> bool:
    """oneDNN-packed products pay on a CPU in bfloat16 (measured on AMX: SmolLM2's 64-row
    decode products 1.5-2x faster); in float32 they gain nothing measurable. Only where
    oneDNN packs bf16 on this CPU at all (it needs AVX512 BW/VL/DQ or AVX-NE-CONVERT)."""
    p = next(model.parameters())
    return p.device.type == "cpu" and p.dtype == torch.bfloat16 and bf16_packing_works()


@functools.cache
def bf16_packing_works() -> bool:
    """Whether oneDNN packs and multiplies a bf16 weight on this CPU: tried once on a small
    one, since the instruction sets it wants are its own to name (a CPU without them raises
    'bf16 path needs the cpu support avx_ne_convert or avx512bw, ...')."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 16, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 4)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(4, 16, dtype=torch.bfloat16),
                                                 packed, None, "none", [None], "")
        return bool((out == 16).all())
    except RuntimeError:
        return False


def build_prefill(prefills: list[tuple[int, int, int]], device) -> Prefill:
    """The layout of prefills given as (slot, first position, length), in that order."""
    slots, positions = [], []
    for slot, start, n in prefills:
        slots += [slot] * n
        positions += range(start, start + n)
    p = max(n for _, _, n in prefills)
    lengths = torch.tensor([n for _, _, n in prefills], dtype=torch.long)
    starts = torch.tensor([s for _, s, _ in prefills], dtype=torch.long)
    offsets = lengths.cumsum(0) - lengths
    ar = torch.arange(p)
    real = ar[None, :] < lengths[:, None]  # (m, P)
    keys = max(s + n for _, s, n in prefills)

    def t(x):
        return torch.as_tensor(x, dtype=torch.long).to(device, non_blocking=True)
    return Prefill(t(slots), t(positions), t([s for s, _, _ in prefills]),
                   t((offsets[:, None] + ar[None, :]).where(real, offsets[:, None])),
                   t(real.flatten().nonzero().flatten()), t(starts[:, None] + ar[None, :]),
                   t(torch.arange(keys)))


def varying(t: torch.Tensor, *dims: int) -> torch.Tensor:
    """Mark the sizes that change from pass to pass (the batch, keys, cache shape; dim 0 when
    none is named) so the first compilation is already general in them; the rest (hidden
    size, vocabulary, heads) stay constants of the compiled code."""
    for d in dims or (0,):
        torch._dynamo.maybe_mark_dynamic(t, d)
    return t


@contextlib.contextmanager
def compile_settings():
    """How the decode graph's functions are traced: sizes that happen to be equal are not
    assumed equal (a batch of 16 rows over 16 keys is not a special case), so each function
    compiles once per structure (torch still specialises sizes 0 and 1), not per batch; and
    each may hold the compilations of several models (one process with engines on several
    models, or in two dtypes) before torch stops compiling it."""
    with fx_config.patch(use_duck_shape=False), dynamo_config.patch(recompile_limit=64):
        yield


def _import_inductor_helpers() -> None:
    """Import what inductor's CPU passes import at their first compile, with torch's own
    deprecation notice about its mkldnn helpers silenced: the notice concerns torch's code,
    not the user's, and would otherwise land in the user's run."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.jit.script_method.*deprecated",
                                category=DeprecationWarning)
        import torch.utils.mkldnn  # noqa: F401


class GraphModel:
    """The graph forward of one model over a slot cache's K/V tensors."""

    def __init__(self, model, compile: bool, batch: int = 64):
        self.model = model
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        attn = model.get_decoder().layers[0].self_attn
        self.shape = Shape(heads, cfg.num_key_value_heads, head_dim,
                           float(getattr(cfg, "rms_norm_eps", 1e-6)),
                           float(getattr(attn, "scaling", head_dim ** -0.5)))
        self.weights = GraphWeights(model, pack=can_pack(model), batch=batch)
        decoder = self.weights.decoder
        self.act = decoder.layers[0].mlp.act_fn
        decode, prefill = make_layers(self.shape, self.act)
        fns = (decode, prefill, embed_rows, head_rows)
        self._eager = fns  # what check() runs: the same arithmetic
        if compile:
            _import_inductor_helpers()
            fns = tuple(torch.compile(f, fullgraph=True) for f in fns)
        self._compiled = fns

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               k: dict[int, torch.Tensor], v: dict[int, torch.Tensor], eager: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """B decode rows (row i in slot i, fed ids[i] at positions[i], attending over keys
        0..len(keys)-1): (logits (B, vocab), last hidden states (B, hidden)), in the
        model's dtype."""
        decode_layer, _, embed, head = self._eager if eager else self._compiled
        decoder = self.weights.decoder
        h, cos, sin = embed(varying(ids), varying(positions), decoder.embed_tokens.weight,
                            decoder.rotary_emb)
        for i, w in enumerate(self.weights.layers):
            h = decode_layer(varying(h), w, varying(k[i], 0, 2), varying(v[i], 0, 2),
                             varying(cos), varying(sin), positions, varying(keys))
        return head(varying(h), decoder.norm.weight, self.weights.head, self.shape.eps)

    def prefill(self, ids: torch.Tensor, pre: Prefill, out_rows: torch.Tensor,
                k: dict[int, torch.Tensor], v: dict[int, torch.Tensor], eager: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill rows (their K/V written), and the logits and hidden states of `out_rows`."""
        _, prefill_layer, embed, head = self._eager if eager else self._compiled
        pre = Prefill(*(varying(t, *range(t.dim())) for t in pre))
        decoder = self.weights.decoder
        h, cos, sin = embed(varying(ids), pre.row_positions, decoder.embed_tokens.weight,
                            decoder.rotary_emb)
        for i, w in enumerate(self.weights.layers):
            h = prefill_layer(varying(h), w, varying(k[i], 0, 2), varying(v[i], 0, 2),
                              varying(cos), varying(sin), pre)
        return head(varying(h.index_select(0, out_rows)), decoder.norm.weight,
                    self.weights.head, self.shape.eps)

    @torch.inference_mode()
    def check(self) -> float:
        """How far this forward is from the Hugging Face forward on the live weights: the
        largest logit difference over the largest logit, for two prompts of different lengths
        prefilled together and then one decode step of each. Rounding gives ~1e-6 in float32
        and ~1e-2 in bfloat16; different arithmetic (another norm, embedding scale or rotary
        layout) gives differences of the logits' own size."""
        p = next(self.model.parameters())
        dev = p.device
        vocab = self.model.get_input_embeddings().num_embeddings
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (9, 5)]
        shape = (len(prompts), self.shape.kv_heads, 16, self.shape.head_dim)
        k, v = ({i: torch.zeros(shape, dtype=p.dtype, device=dev)
                 for i in range(len(self.weights.layers))} for _ in range(2))
        ends = torch.tensor([len(x) - 1 for x in prompts]).cumsum(0) - 1
        ids = torch.tensor(sum((x[:-1] for x in prompts), []), device=dev)
        pre = build_prefill([(i, 0, len(x) - 1) for i, x in enumerate(prompts)], dev)
        first, _ = self.prefill(ids, pre, ends.to(dev), k, v, eager=True)
        positions = torch.tensor([len(x) - 1 for x in prompts], device=dev)
        last_ids = torch.tensor([x[-1] for x in prompts], device=dev)
        second, _ = self.decode(last_ids, positions, torch.arange(16, device=dev), k, v,
                                eager=True)
        worst = 0.0
        for i, x in enumerate(prompts):
            ref = self.model(torch.tensor([x], device=dev)).logits[0, -2:].float()
            got = torch.stack([first[i], second[i]])
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
        return worst
