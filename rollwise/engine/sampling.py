"""Pure sampling math: logits -> the distribution actually sampled from, a token, its
log-probability and the distribution's entropy. No model, no state.

Each request draws from its own seeded stream (one uniform per token, inverse-CDF), so a
request's tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 16
    stop_ids: tuple[int, ...] = ()
    seed: int | None = None  # None: drawn from the engine's seeded stream
    top_logprobs: int = 0  # also report the k most likely tokens of the sampled distribution
    return_hidden: bool = False  # also report the last hidden state at each event
    event_every: int = 0  # report events every this many tokens (0: the engine's segment);
    # a tree that decides at every token (LATR, ECHO) asks for 1

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")
        if self.top_k < 0 or self.max_new_tokens < 1 or self.top_logprobs < 0 or \
                self.event_every < 0:
            raise ValueError(f"top_k = {self.top_k}, top_logprobs = {self.top_logprobs}, "
                             f"max_new_tokens = {self.max_new_tokens}, event_every = "
                             f"{self.event_every}: top_k, top_logprobs and event_every must "
                             f"be >= 0 and max_new_tokens >= 1")


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from, -inf outside its support.

    logits (B, V) float; temperature, top_p (B,) float; top_k (B,) long (0 = off).
    Greedy rows (temperature 0) get the untempered distribution, whose argmax they take.
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits.float() / t[:, None]
    filtered = top_k.gt(0).any() or top_p.lt(1).any()
    if filtered:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
        drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass strictly before each token: keep the first
        drop |= before >= top_p[:, None]  # tokens until top_p is reached
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    return scaled.log_softmax(-1)


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    p = logprobs.exp()
    return -(p * logprobs.masked_fill(p == 0, 0.0)).sum(-1)


def draw(logprobs: torch.Tensor, uniforms: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Tokens by inverse CDF on per-row uniforms (B,), argmax for greedy rows."""
    cdf = logprobs.exp().cumsum(-1)
    u = uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]
    sampled = torch.searchsorted(cdf, u).squeeze(-1).clamp_max(logprobs.shape[-1] - 1)
    # never land on a zero-probability token through rounding at the top of the CDF
    sampled = torch.where(torch.isfinite(logprobs.gather(-1, sampled[:, None]).squeeze(-1)),
                          sampled, logprobs.argmax(-1))
    return torch.where(greedy, logprobs.argmax(-1), sampled)


# rows per sampling pass: float32 temporaries of at most 16 MiB, which glibc hands back from
# freed memory (rollwise.devices.keep_freed_memory); larger ones come from fresh pages at every
# step (512 rows of a 49k vocabulary: 200-290 ms a step, 155 ms in passes of 64 rows)
_PASS_ELEMENTS = 4 << 20


def sample(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row: (tokens, their log-probabilities, entropies, log-probabilities (n, V)),
    all under the distribution sampled from. The same math as sampling_logprobs + draw +
    entropy, with fewer tensor operations when every row shares its sampling settings (the
    common case, where per-call overhead dominates a small model's step). Rows are
    independent, so a large batch is sampled in passes of rows."""
    rows = max(1, _PASS_ELEMENTS // logits.shape[-1])
    if logits.shape[0] <= rows:
        return _sample(logits, params, uniforms)
    parts = [_sample(logits[i:i + rows], params[i:i + rows], uniforms[i:i + rows])
             for i in range(0, logits.shape[0], rows)]
    return tuple(torch.cat(x) for x in zip(*parts))  # type: ignore[return-value]


def _sample(logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    first = (params[0].temperature, params[0].top_k, params[0].top_p)
    if all((p.temperature, p.top_k, p.top_p) == first for p in params):
        logp = _uniform_logprobs(logits, *first)
        greedy: bool | torch.Tensor = first[0] == 0
    else:
        dev = logits.device
        temp = torch.tensor([p.temperature for p in params], device=dev)
        logp = sampling_logprobs(logits, temp, torch.tensor([p.top_k for p in params], device=dev),
                                 torch.tensor([p.top_p for p in params], device=dev))
        greedy = temp == 0
    probs = logp.exp()
    if greedy is True:
        tokens = logp.argmax(-1)
    else:
        tokens = _inverse_cdf(logp, probs, uniforms)
        if greedy is not False:
            tokens = torch.where(greedy, logp.argmax(-1), tokens)
    token_logp = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, token_logp, _entropy(probs, logp), logp


def _entropy(probs: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p per row, without the clamp over the whole table that only rows with
    tokens outside the support need (p = 0, log p = -inf: top-k, top-p, masked logits); those
    rows come out NaN and are summed again with 0 * log 0 = 0."""
    ent = -torch.linalg.vecdot(probs, logp)
    bad = ent.isnan()
    if bool(bad.any()):
        ent[bad] = -(probs[bad] * logp[bad].clamp_min(torch.finfo(logp.dtype).min)).sum(-1)
    return ent


def _uniform_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float
                      ) -> torch.Tensor:
    """sampling_logprobs for settings shared by every row (plain Python numbers)."""
    scaled = logits.float()
    if temperature > 0 and temperature != 1:
        scaled = scaled / temperature
    if top_k > 0 or top_p < 1:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        if top_k > 0:
            sorted_logits[:, top_k:] = float("-inf")
        if top_p < 1:
            probs = sorted_logits.softmax(-1)
            sorted_logits = sorted_logits.masked_fill(probs.cumsum(-1) - probs >= top_p,
                                                      float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    return scaled.log_softmax(-1)


def _inverse_cdf(logp: torch.Tensor, probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    cdf = probs.cumsum(-1)
    u = torch.tensor(uniforms, dtype=torch.float64).to(cdf.device, cdf.dtype)[:, None]
    picked = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1).clamp_max(logp.shape[-1] - 1)
    # never land on a zero-probability token through rounding at the top of the CDF
    ok = probs.gather(-1, picked[:, None]).squeeze(-1) > 0
    return picked if bool(ok.all()) else torch.where(ok, picked, logp.argmax(-1))


CDF_BLOCK = 256  # the graph sampler's inverse CDF: block sums, then a scan of one block


def sample_in_graph(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, uniforms: torch.Tensor, filtered: bool,
                    greedy_rows: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample` as one traceable graph, for decode graphs: per-row settings as device
    tensors, no branch on their values and no host read. Fixed when the graph is built:
    `filtered` (some row has top-k or top-p: a sort of the vocabulary) and `greedy_rows` (some
    row has temperature 0: an argmax pass).

    The same distribution as sampling_logprobs, drawn by inverse CDF on the row's uniform,
    in two passes over the vocabulary instead of a log-softmax, a cumsum and an entropy pass:
    the maximum, then per-block sums of exp(x - max) (and of exp(x - max) * x, for the
    entropy); the token's block is found on the block sums and the token by scanning that
    one block. Returns (tokens, their log-probabilities, entropies)."""
    greedy = temperature == 0
    x = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    if filtered:
        x = _filter(x, top_k, top_p)
    rows, vocab = x.shape
    blocks = -(-vocab // CDF_BLOCK)
    if blocks * CDF_BLOCK != vocab:
        x = F.pad(x, (0, blocks * CDF_BLOCK - vocab), value=float("-inf"))
    top = x.max(-1).values
    e = (x - top[:, None]).exp()  # 0 outside the support
    block_mass = e.view(rows, blocks, CDF_BLOCK).sum(-1)
    mass = block_mass.sum(-1)
    log_z = top + mass.log()
    entropy = log_z - (e * x.clamp_min(torch.finfo(x.dtype).min)).sum(-1) / mass
    # the block where the CDF passes u * mass (right=True: never a block of zero mass), then
    # the token inside it; rounding at the top of the CDF falls back to the last block or
    # token that has mass
    cdf = block_mass.cumsum(-1)
    target = uniforms.to(cdf.dtype) * cdf[:, -1]
    block = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    block = torch.where(block < blocks, block, _last_positive(block_mass))
    before = torch.where(block > 0, cdf.gather(-1, (block[:, None] - 1).clamp_min(0))[:, 0],
                         0.0)
    start = (block * CDF_BLOCK)[:, None] + torch.arange(CDF_BLOCK, device=x.device)[None, :]
    inner = (x.gather(-1, start) - top[:, None]).exp()
    offset = torch.searchsorted(inner.cumsum(-1), (target - before)[:, None], right=True)[:, 0]
    offset = torch.where(offset < CDF_BLOCK, offset, _last_positive(inner))
    tokens = block * CDF_BLOCK + offset
    if greedy_rows:
        tokens = torch.where(greedy, x.argmax(-1), tokens)
    token_logp = x.gather(-1, tokens[:, None])[:, 0] - log_z
    return tokens, token_logp, entropy


def logprobs_in_graph(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, filtered: bool) -> torch.Tensor:
    """sampling_logprobs as a traceable graph (`filtered` fixed when it is built): the whole
    (rows, vocab) table, for top log-probabilities and forks onto another token."""
    x = logits.float() / torch.where(temperature == 0, 1.0, temperature)[:, None]
    return (_filter(x, top_k, top_p) if filtered else x).log_softmax(-1)


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """Per row, the last index whose value is > 0 (rows hold at least one)."""
    index = torch.arange(values.shape[-1], device=values.device)
    return torch.where(values > 0, index, -1).max(-1).values


def _filter(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p per row (k = 0, p = 1: off), as sampling_logprobs does: -inf outside."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    drop = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
    drop = drop | (probs.cumsum(-1) - probs >= top_p[:, None])
    return torch.full_like(x, float("-inf")).scatter(-1, order,
                                                     sorted_x.masked_fill(drop, float("-inf")))


def derived_seed(seed: int, n_tokens: int) -> int:
    """The seed of a sequence's continuation after `n_tokens` tokens, when it is submitted
    again as a new request (vLLM's resume, a Ray worker's re-queue): a fresh stream, so the
    continuation does not replay the uniforms its first tokens used."""
    return (seed * 1_000_003 + n_tokens) % (1 << 63)


# A request's uniforms are a hash of (its seed, how many it drew before): a counter-based stream
# (as Philox is), so the host and the device compute the same values, a decode graph draws them
# with no host work, and a sequence's draws never depend on its batch. The hash works on 32-bit
# halves held in int64 with every product below 2**63, so Python's integers and torch's int64
# tensors (CPU and CUDA, eager or compiled) give identical bits.
_MASK32 = 0xFFFFFFFF
_STREAM_SALT = (0x9E3779B9, 0x7F4A7C15)  # distinct inputs for the counter and the seed's halves
_UNIFORM_BITS = 24  # exactly representable in float32 as in float64


def _mul32(x, c: int):
    """(x * c) mod 2**32 for 0 <= x, c < 2**32, by 16-bit halves of x (no product reaches 2**49)."""
    return ((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c & _MASK32


def _mix32(x):
    """MurmurHash3's 32-bit finaliser on ints or int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _stream_bits(seed, count):
    """24 hashed bits of (seed >= 0, count >= 0): Python ints or int64 tensors alike."""
    h = _mix32((count & _MASK32) ^ _STREAM_SALT[0])
    h = _mix32(h ^ (seed & _MASK32))
    h = _mix32(h ^ ((seed >> 32) & _MASK32) ^ _STREAM_SALT[1])
    return h >> (32 - _UNIFORM_BITS)


def stream_uniform(seed: int, count: int) -> float:
    """The `count`-th uniform in [0, 1) of the stream `seed`."""
    return _stream_bits(seed, count) * 2.0 ** -_UNIFORM_BITS


def stream_uniforms(seeds: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """stream_uniform over int64 tensors (any device), as float32: the same values."""
    return _stream_bits(seeds, counts).to(torch.float32) * 2.0 ** -_UNIFORM_BITS


class SeedStream:
    """A request's uniforms: stream_uniform(seed, 0), (seed, 1), ... `count` says how many
    were drawn, so a decode graph can draw the next ones on the device and `advance` past them."""

    def __init__(self, seed: int):
        self.seed = seed % (1 << 63)  # any integer (a client's negative seed too)
        self.count = 0

    def next(self) -> float:
        self.count += 1
        return stream_uniform(self.seed, self.count - 1)

    def advance(self, n: int) -> None:
        self.count += n
