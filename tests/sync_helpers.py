"""Shared by tests/test_sync_*.py: one round of real rollouts from an engine, as groups."""

import pickle
import time

import numpy as np
import torch
from transformers import Qwen2ForCausalLM

from rollwise.engine import Request, SamplingParams
from rollwise.sync import payload as P
from rollwise.sync.receiver import Receiver
from rollwise.sync.sender import Sender
from rollwise.sync.transport import GrowingBuffer
from rollwise.types import Group, Sample

PROMPTS = ["12+34=", "7-5=", "101+9=", "3+3="]


def rl_groups(engine, tok, seed: int | None = None, group_size: int = 4) -> list[Group]:
    """Reward 1 when the response starts with an even token id: a verifier a random tiny model
    satisfies sometimes, so groups have mixed rewards. `seed` fixes every request's stream
    (else the engine's own seeded stream decides)."""
    reqs = [Request(tok(p)["input_ids"],
                    SamplingParams(max_new_tokens=5,
                                   seed=None if seed is None else seed + i * group_size + j),
                    i)
            for i, p in enumerate(PROMPTS) for j in range(group_size)]
    groups: dict[int, list[Sample]] = {}
    for r, c in zip(reqs, engine.generate(reqs)):
        s = Sample(prompt_id=str(r.id), prompt_ids=r.prompt_ids, response_ids=c.token_ids,
                   logprobs=c.logprobs, versions=c.versions, loss_mask=[1] * len(c.token_ids))
        s.reward = float(c.token_ids[0] % 2 == 0)
        groups.setdefault(r.id, []).append(s)
    return [Group(str(k), v) for k, v in groups.items()]


class HangingModel(Qwen2ForCausalLM):
    """A model whose construction never finishes: an engine child that is alive but never
    says it is up (module level, so a spawned child can unpickle it)."""

    def __init__(self, config):
        time.sleep(3600)


class Holder:
    """The smallest engine: a module holding `p.<name>` tensors, and a version."""

    def __init__(self, tensors: dict[str, torch.Tensor], version: int = 0):
        self.model = torch.nn.Module()
        self.model.p = torch.nn.ParameterDict(
            {n.removeprefix("p."): torch.nn.Parameter(t.clone(), requires_grad=False)
             for n, t in tensors.items()})
        self.version = version

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def weights_written(self, version: int) -> None:
        self.version = version

def named(holder: Holder) -> dict[str, torch.Tensor]:
    return {k: v for k, v in holder.model.state_dict().items()}

def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(P.bits(a.contiguous()), P.bits(b.contiguous()))

def new_sync(tensors, *, bucket_bytes=2**20, checksum=True, coding="delta"):
    engine = Holder(tensors)
    receiver = Receiver(engine)
    spec = receiver.state().spec
    sender = Sender(spec, keep_mirror=True, with_checksum=checksum, bucket_bytes=bucket_bytes,
                    coding=coding)
    return engine, receiver, sender

def push(sender, receiver, weights, version, full=False, buf=None):
    buf = buf or GrowingBuffer()
    meta, arena = sender.encode(weights, version, buf.take, full=full)
    meta = pickle.loads(pickle.dumps(meta))  # what crosses a process boundary
    receiver.apply(meta, arena)
    return meta, arena

def change(t: torch.Tensor, mask: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """New values at the masked positions: small relative nudges (the RL case, many of which
    round back to the same stored value), sign flips, -0.0, and fresh random values."""
    out = t.clone().reshape(-1)
    idx = torch.from_numpy(np.flatnonzero(mask))
    kind = torch.from_numpy(rng.integers(0, 4, size=len(idx)))
    old = out[idx].float()
    nudged = old * (1 + torch.from_numpy(rng.normal(0, 1e-3, len(idx))).float())
    fresh = torch.from_numpy(rng.normal(0, 1, len(idx))).float()
    new = torch.where(kind == 0, nudged, torch.where(kind == 1, -old, torch.where(
        kind == 2, torch.full_like(old, -0.0), fresh)))
    out[idx] = new.to(t.dtype)
    return out.reshape(t.shape)

def random_bits_change(dtype, n: int, density: float, seed: int):
    """(old, new) integer views of n random elements of dtype: a share `density` changed, 70 %
    of those by -1, 0 or +1 unit in the last place, the rest to random bits (any difference:
    sign flips, NaNs); at one random element, sometimes nothing changes at all."""
    rng = np.random.default_rng(seed)
    width = torch.tensor([], dtype=dtype).element_size()
    def raw():
        return torch.from_numpy(rng.integers(0, 256, n * width, dtype=np.uint8)).view(dtype)
    old = P.bits(raw())
    new = old.clone()
    mask = torch.from_numpy(rng.random(n) < density)
    mask[rng.integers(0, n)] = bool(rng.integers(0, 2))
    nudge = torch.from_numpy(rng.integers(-1, 2, n)).to(old.dtype)
    new[mask] = torch.where(torch.from_numpy(rng.random(n) < 0.7)[mask], old[mask] + nudge[mask],
                            P.bits(raw())[mask])
    return old, new
