"""The built-in engine: batched generation with a KV cache for any Hugging Face causal LM.

Requests are (prompt ids, sampling params); a completion carries the new token ids, the
behaviour log-probability of each (under the distribution actually sampled from), its entropy
and the policy version that produced it. Weights arrive through `load_weights`, which stamps a
new version on every token generated after it.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from rollwise.engine.sampling import SamplingParams, SeedStream, draw, entropy, sampling_logprobs


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    id: int = -1


@dataclass
class Completion:
    request_id: int
    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (a stop id, included in token_ids) or "length"


class Engine:
    def __init__(self, model, *, pad_id: int, max_batch: int = 1024, seed: int = 0,
                 version: int = 0, copy_model: bool = True):
        self.model = copy.deepcopy(model) if copy_model else model
        self.model.eval().requires_grad_(False)
        self.pad_id = pad_id
        self.max_batch = max_batch
        self.version = version
        self._seeds = random.Random(seed)
        self.tokens_generated = 0

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy new weights in place; tokens generated after this carry `version`."""
        own = self.model.state_dict()  # tied weights appear under each name; copy_ is idempotent
        unknown = [k for k in state_dict if k not in own]
        if unknown:
            raise KeyError(f"load_weights: tensors not in the engine's model: {unknown[:5]}")
        with torch.no_grad():
            for name, value in state_dict.items():
                own[name].copy_(value)
        self.version = version

    def generate(self, requests: list[Request]) -> list[Completion]:
        out: list[Completion] = []
        for start in range(0, len(requests), self.max_batch):
            out += self._generate_batch(requests[start:start + self.max_batch])
        return out

    @torch.inference_mode()
    def _generate_batch(self, requests: list[Request]) -> list[Completion]:
        B = len(requests)
        if B == 0:
            return []
        device = next(self.model.parameters()).device
        lengths = [len(r.prompt_ids) for r in requests]
        if min(lengths) == 0:
            raise ValueError("a request has an empty prompt; give at least one token")
        P = max(lengths)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for i, r in enumerate(requests):  # left padding keeps every row's last token at -1
            ids[i, P - lengths[i]:] = torch.tensor(r.prompt_ids)
            mask[i, P - lengths[i]:] = 1
        ids, mask = ids.to(device), mask.to(device)
        params = [r.params for r in requests]
        temp = torch.tensor([p.temperature for p in params], device=device)
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        greedy = temp == 0
        streams = [SeedStream(p.seed if p.seed is not None else self._seeds.getrandbits(63))
                   for p in params]
        stops = [set(p.stop_ids) for p in params]
        budget = [p.max_new_tokens for p in params]
        results = [Completion(r.id, [], [], [], [], "length") for r in requests]
        alive = list(range(B))

        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True).logits[:, -1]
        next_pos = positions[:, -1:] + 1
        for _ in range(max(budget)):
            logp = sampling_logprobs(logits, temp, top_k, top_p)
            u = torch.tensor([s.next() for s in streams], device=device)
            tokens = draw(logp, u, greedy)
            tok_logp = logp.gather(-1, tokens[:, None]).squeeze(-1)
            t_list, lp_list, e_list = tokens.tolist(), tok_logp.tolist(), entropy(logp).tolist()
            still = []
            for i in alive:
                res = results[i]
                res.token_ids.append(t_list[i])
                res.logprobs.append(lp_list[i])
                res.entropies.append(e_list[i])
                res.versions.append(self.version)
                if t_list[i] in stops[i]:
                    res.finish_reason = "stop"
                elif len(res.token_ids) < budget[i]:
                    still.append(i)
            alive = still
            if not alive:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=device)], 1)
            logits = self.model(input_ids=tokens[:, None], attention_mask=mask,
                                position_ids=next_pos, past_key_values=cache,
                                use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        self.tokens_generated += sum(len(r.token_ids) for r in results)
        return results
