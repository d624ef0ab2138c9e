"""Per-token log-probabilities and entropies straight from the last hidden state, without the
full logits.

The plain path runs the LM head over every position and takes a full-vocabulary log-softmax:
(tokens x vocabulary) floats, 49k per token for SmolLM2 and 152k for Qwen2.5, kept for the
backward pass. That tensor, not the model, sets the trainer's peak memory. Here the head runs
over the positions that have a target only, a chunk of tokens at a time, inside one autograd
function: each chunk's logits live only while that chunk is reduced to (log p(target),
entropy), and the backward pass recomputes them chunk by chunk (one more head matmul) to form
the logits' gradient, (one-hot - p) for the log-probability and -p (log p + H) for the
entropy, and from it the hidden states' and the head's gradients.

The model itself runs as usual; only its output-embedding module is swapped, for the duration
of the call, for one that hands its input here. So the decoder, its attention masks, FSDP2's
hooks and peft's adapters all work as before.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

# fp32 logits held per chunk; the token count is this over the vocabulary size. On a CPU the
# chunk's elementwise passes (log-softmax, exp, the gradient) then stay in cache: 128 tokens of
# a 49k vocabulary ran at the full logits' speed where 341 took 1.3x as long. On a GPU larger
# chunks keep the kernels few.
CHUNK_ELEMENTS = {"cpu": 6 << 20, "cuda": 1 << 26}
WEIGHT_TOKENS = 1024  # tokens of logit gradients per product into the head's gradient
# configs whose logits are not the plain head's output (transformed after it)
POST_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def chunk_tokens(vocab: int, setting: int | None = None, device: str = "cpu") -> int:
    """Tokens per chunk: the setting, or what keeps one chunk's fp32 logits at the device's
    CHUNK_ELEMENTS."""
    elements = CHUNK_ELEMENTS.get(device, CHUNK_ELEMENTS["cuda"])
    return setting or max(16, elements // max(vocab, 1))


def fusable(model) -> str | None:
    """Why this model's head cannot be fused, or None when it can: its output embedding is a
    plain Linear and the config names no transformation of the logits after it."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear:  # a peft-wrapped head, a custom module, no head
        return f"the output embedding is {type(head).__name__}, not a plain torch.nn.Linear"
    config = getattr(model, "config", None)
    for name in POST_HEAD:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0, False):
            return f"config.{name} = {value} transforms the logits after the head"
    return None


class _ChunkedHead(torch.autograd.Function):
    """(hidden (N, H), weight (V, H), bias (V,) or None, target (N,)) -> (log p(target),
    entropy), both (N,) float32, a chunk of tokens at a time. The backward pass recomputes
    each chunk's log-probabilities exactly as the forward pass did (the same products, so the
    saved entropies agree with them to the last bit: the entropy's gradient cancels over the
    vocabulary, and any disagreement would not), and gathers the logits' gradients of several
    chunks, WEIGHT_TOKENS in all, for each product into the head's gradient: one (V, H)
    accumulation per chunk would cost more than the chunk itself."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, chunk):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent, top, lse = torch.empty_like(logp), torch.empty_like(logp), torch.empty_like(logp)
        for s in range(0, n, chunk):
            lp = _logsoftmax(hidden[s:s + chunk], weight, bias, top[s:s + chunk],
                             lse[s:s + chunk], fresh=True)
            logp[s:s + chunk] = lp.gather(-1, target[s:s + chunk, None]).squeeze(-1)
            ent[s:s + chunk] = -torch.linalg.vecdot(lp.exp(), lp)  # one pass, no p * lp
        ctx.save_for_backward(hidden, weight, bias, target, ent, top, lse)
        ctx.chunk, ctx.cast = chunk, _autocast_dtype(hidden.device.type)
        ctx.set_materialize_grads(False)  # an unused output sends None: no work for it
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        # the recomputed logits must be the forward's to the bit: under the forward's autocast
        with torch.autocast(ctx.saved_tensors[0].device.type, dtype=ctx.cast or torch.float32,
                            enabled=ctx.cast is not None):
            return _ChunkedHead._backward(ctx, g_logp, g_ent)

    @staticmethod
    def _backward(ctx, g_logp, g_ent):
        hidden, weight, bias, target, ent, top, lse = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        n, chunk = hidden.shape[0], ctx.chunk
        d_hidden = torch.empty_like(hidden) if want_h else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if want_w else None
        d_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if want_b and bias is not None else None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
        per_product = max(chunk, WEIGHT_TOKENS // chunk * chunk)
        pending = torch.empty((min(per_product, n), weight.shape[0]), dtype=weight.dtype,
                              device=weight.device) if want_w else None
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            lp = _logsoftmax(hidden[s:e], weight, bias, top[s:e], lse[s:e], fresh=False)
            # dlog p(t)/dz = one-hot(t) - p and dH/dz = -p (log p + H), so
            # dz = one-hot(t) g_lp - p (g_lp + g_ent (log p + H))
            if g_ent is None:
                coef = -g_logp[s:e, None]
            else:
                coef = (lp + ent[s:e, None]).mul_(-g_ent[s:e, None]).sub_(g_logp[s:e, None])
            dz = lp.exp_().mul_(coef)
            dz.scatter_add_(-1, target[s:e, None], g_logp[s:e, None])
            if want_w:  # into the buffer of the next product, in the weight's dtype
                at = s % per_product  # rows s - at .. e of hidden are in the buffer
                dz = pending[at:at + e - s].copy_(dz)
                if e == n or at + e - s == per_product:
                    d_weight.add_(pending[:at + e - s].t() @ hidden[s - at:e])
            else:
                dz = dz.to(weight.dtype)
            if want_h:
                d_hidden[s:e] = dz @ weight
            if d_bias is not None:
                d_bias.add_(dz.sum(0, dtype=torch.float32))
        return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None)


def _autocast_dtype(device: str) -> torch.dtype | None:
    """The dtype autocast runs products in on this device, or None when it is off."""
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _logsoftmax(h, weight, bias, top, lse, fresh: bool):
    """log p over the vocabulary for hidden rows h: (z - max) - log sum exp(z - max) from the
    logits z. fresh: compute the max and the log-sum into top and lse; else use theirs."""
    z = _logits(h, weight, bias)
    if fresh:
        top.copy_(z.amax(-1))
    z.sub_(top[:, None])
    if fresh:
        lse.copy_(torch.logsumexp(z, -1))
    return z.sub_(lse[:, None])


def _logits(h, weight, bias):
    # in the model's dtype, as its head computes them, then fp32 as the plain path
    return F.linear(h, weight, bias).float()


def head_logprobs(hidden, weight, bias, target, chunk: int, entropy_grad: bool = False):
    """(log p(target), entropy) per row of hidden (N, H); the entropy carries a gradient only
    when entropy_grad."""
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty + hidden.sum() * 0, empty
    logp, ent = _ChunkedHead.apply(hidden, weight, bias, target, chunk)
    return logp, ent if entropy_grad and torch.is_grad_enabled() else ent.detach()


@contextmanager
def captured_head(model, pick, target: torch.Tensor, chunk: int,
                  entropy_grad: bool = False, keep_logits: bool = False):
    """Within the block, a forward pass of `model` computes (log p, entropy) of `target` at
    the positions `pick(last_hidden_state)` selects (N, H), instead of the logits; they are in
    the yielded dict under "out" after the pass. The model's logits output is then a
    placeholder of one entry per position, or with keep_logits the logits as usual (to
    compare the two)."""
    head = model.get_output_embeddings()
    own_forward = head.forward
    result: dict = {}

    def fused(hidden):
        picked = pick(hidden)
        result["out"] = head_logprobs(picked, head.weight, head.bias, target.to(picked.device),
                                      chunk, entropy_grad)
        return own_forward(hidden) if keep_logits else hidden.new_zeros((*hidden.shape[:-1], 1))

    head.forward = fused  # an instance attribute shadows the class's forward
    try:
        yield result
    finally:
        del head.forward
