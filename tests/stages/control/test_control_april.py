"""APRIL partial rollouts, an in-flight controller over the i.i.d. group generator: exact
token-level carry-over across pause/resume and weight updates, exactly `want` groups per
step, and no sample lost or returned twice."""

import copy
import dataclasses

import torch

from rollwise.config import Config, GenerateConfig
from rollwise.engine import BuiltinEngine
from rollwise.stages.control.april import April
from rollwise.stages.generate import generate_round
from rollwise.stages.generate.group import GroupGenerator, sampling_params
from rollwise.stages.ledger import Ledger
from rollwise.tasks.prompts import Prompter
from rollwise.types import Problem, Status


class Rounds:
    """APRIL over GroupGenerator with a fixed prompt stream, as the loop drives them."""

    def __init__(self, tok, cfg: Config, april: April):
        self.cfg, self.april = cfg, april
        self.gen = GroupGenerator(cfg, tok)
        self.prompter = Prompter.plain(tok)
        # several stop ids so a random model's responses have very different lengths
        self.params = dataclasses.replace(sampling_params(cfg.generate, (tok.eos_token_id,)),
                                          stop_ids=tuple(range(1, 14)))
        problems = iter([Problem(id=f"p{i}", prompt=f"{i}+{i}=", answer=str(2 * i))
                         for i in range(1000)])
        self.inflight = april
        self.select = lambda n, step, ledger: [next(problems) for _ in range(n)]  # noqa: E731
        self.sized = lambda problems, step, ledger: problems  # noqa: E731

    @property
    def carry(self):
        return self.april.carry

    def generate(self, engine, select, want, step, ledger, keep_kv=False):
        return generate_round(engine, self.gen, self, self.params, want, step, ledger,
                              self.prompter, keep_kv=keep_kv)


def make(tiny, want=2, group_size=4, max_new=14):
    model, tok = tiny
    cfg = Config(generate=GenerateConfig(group_size=group_size, max_new_tokens=max_new))
    gen = Rounds(tok, cfg, April(over_provision=2.0))
    engine = BuiltinEngine(model, seed=0, max_batch=64)
    return gen, engine, None


def full_forward_logprobs(model, sample):
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    p = len(sample.prompt_ids)
    return logp[p - 1:, :].gather(-1, ids[0, p:, None]).squeeze(-1)


def test_carried_samples_keep_exact_tokens_logprobs_and_versions(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    gen, engine, select = make((model, tok))
    done = gen.generate(engine, select, 2, step=1, ledger=Ledger())
    assert len(done) == 2 and all(s.finished for g in done for s in g.samples)
    paused = [s for g in gen.carry for s in g.samples if s.status == Status.PAUSED]
    assert paused and any(s.num_tokens for s in paused)
    snapshot = {s.uid: (list(s.response_ids), list(s.logprobs), list(s.versions))
                for s in paused}
    old_model = copy.deepcopy(engine.model)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    engine.load_weights(new, version=1)
    later = gen.generate(engine, select, 2, step=2, ledger=Ledger())
    resumed = {s.uid: s for g in later + gen.carry for s in g.samples if s.uid in snapshot}
    assert len(resumed) == len(snapshot)
    checked = 0
    for uid, (tokens, logprobs, versions) in snapshot.items():
        s = resumed[uid]
        n = len(tokens)
        assert s.response_ids[:n] == tokens and s.logprobs[:n] == logprobs
        assert s.versions[:n] == versions == [0] * n
        assert all(v == 1 for v in s.versions[n:]) and len(s.response_ids) <= 14
        if s.finished and s.num_tokens > n:
            # every token's logprob matches the weights that sampled it
            ref_old = full_forward_logprobs(old_model, s)[:n]
            ref_new = full_forward_logprobs(engine.model, s)[n:]
            assert torch.allclose(torch.tensor(s.logprobs[:n]), ref_old, atol=1e-4)
            assert torch.allclose(torch.tensor(s.logprobs[n:]), ref_new, atol=1e-4)
            checked += 1
    assert checked > 0


def kept_forward_logprobs(old, new, sample, n):
    """Log-probs of a sample's tokens n.. when the K/V of prompt + its first n - 1 tokens came
    from `old` and `new` fed the rest (loop.carried_kv=keep across a sync)."""
    from transformers import DynamicCache

    from rollwise.engine.runner import cache_kwarg
    p, ids = len(sample.prompt_ids), sample.prompt_ids + sample.response_ids
    kw = {cache_kwarg(old): DynamicCache(), "use_cache": True}
    with torch.no_grad():
        old(input_ids=torch.tensor([ids[:p + n - 1]]), **kw)
        logp = new(input_ids=torch.tensor([ids[p + n - 1:-1]]), **kw).logits[0].float()
    return logp.log_softmax(-1).gather(-1, torch.tensor(ids[p + n:])[:, None]).squeeze(-1)


def test_kept_carried_samples_continue_on_their_k_v_with_no_prefill(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    gen, engine, select = make((model, tok))
    gen.generate(engine, select, 2, step=1, ledger=Ledger(), keep_kv=True)
    paused = [s for g in gen.carry for s in g.samples if s.status == Status.PAUSED]
    assert paused and len(engine.scheduler.kept) == len(paused)
    snapshot = {s.uid: len(s.response_ids) for s in paused}
    old_model = copy.deepcopy(engine.model)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
    engine.load_weights(new, version=1)
    carried = {s.uid for g in gen.carry for s in g.samples}
    prefilled = engine.prefill_tokens
    later = gen.generate(engine, select, 2, step=2, ledger=Ledger(), keep_kv=True)
    fresh = [g for g in later + gen.carry if all(s.uid not in carried for s in g.samples)]
    # only the new groups' prompts were prefilled (once a group: its samples fork from it);
    # every carried answer went on from its K/V
    assert fresh and engine.prefill_tokens - prefilled == sum(len(g.samples[0].prompt_ids)
                                                              for g in fresh)
    checked = 0
    for s in (s for g in later + gen.carry for s in g.samples if s.uid in snapshot):
        n = snapshot[s.uid]
        assert s.versions[:n] == [0] * n and all(v == 1 for v in s.versions[n:])
        if s.finished and s.num_tokens > n:
            ref = kept_forward_logprobs(old_model, engine.model, s, n)
            assert torch.allclose(torch.tensor(s.logprobs[n:]), ref, atol=1e-4)
            checked += 1
    assert checked > 0


def test_without_keep_the_engine_holds_no_paused_sequence_between_rounds(tiny):
    gen, engine, select = make(tiny)
    for step in (1, 2):
        gen.generate(engine, select, 2, step=step, ledger=Ledger())
        assert any(s.status == Status.PAUSED for g in gen.carry for s in g.samples)
        assert not engine.scheduler.paused and not engine.scheduler.kept


def test_exactly_want_groups_and_nothing_lost_or_duplicated(tiny):
    gen, engine, select = make(tiny, want=3)
    seen: set[str] = set()
    generated = returned = 0
    for step in range(1, 8):
        before = {s.uid: s.num_tokens for g in gen.carry for s in g.samples}
        ledger = Ledger()
        done = gen.generate(engine, select, 3, step=step, ledger=ledger)
        assert len(done) == 3
        for g in done:
            assert len(g.samples) == 4 and all(s.finished for s in g.samples)
            for s in g.samples:
                assert s.uid not in seen and s.num_tokens <= 14
                seen.add(s.uid)
        returned += sum(s.num_tokens for g in done for s in g.samples)
        carried = sum(s.num_tokens for g in gen.carry for s in g.samples)
        assert ledger.tokens["paused_carried"] == carried
        generated += sum(s.num_tokens - before.get(s.uid, 0)
                         for g in done + gen.carry for s in g.samples)
        # every token generated so far is either in a returned group or still carried
        assert generated == returned + carried
    assert len(seen) == 7 * 3 * 4


def test_state_dict_round_trip_continues_identically(tiny):
    gen, engine, select = make(tiny)
    gen.generate(engine, select, 2, step=1, ledger=Ledger())
    twin = April(over_provision=2.0)
    twin.load_state_dict(gen.april.state_dict())
    a = [[(s.uid, s.response_ids, s.logprobs, s.versions, s.status) for s in g.samples]
         for g in gen.carry]
    b = [[(s.uid, s.response_ids, s.logprobs, s.versions, s.status) for s in g.samples]
         for g in twin.carry]
    assert a == b and [g.problem for g in gen.carry] == [g.problem for g in twin.carry]


def test_groups_completed_beyond_the_batch_are_carried_and_counted(tiny):
    # one-token budget: every group in flight completes in the first engine step, so twice
    # `want` groups finish at once and the surplus must wait for the next step
    gen, engine, select = make(tiny, want=2, max_new=1)
    ledger = Ledger()
    first = gen.generate(engine, select, 2, step=1, ledger=ledger)
    assert len(first) == 2 and len(gen.carry) == 2
    assert all(s.finished for g in gen.carry for s in g.samples)
    carried = sum(s.num_tokens for g in gen.carry for s in g.samples)
    assert carried == 2 * 4 and ledger.tokens["paused_carried"] == carried
    surplus = [g.prompt_id for g in gen.carry]
    second = gen.generate(engine, select, 2, step=2, ledger=Ledger())
    assert [g.prompt_id for g in second] == surplus  # held-over groups go first
    assert {g.prompt_id for g in first}.isdisjoint(g.prompt_id for g in second)
