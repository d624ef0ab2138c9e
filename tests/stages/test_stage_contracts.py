"""Contract suites for the stage protocols, each run over every registered implementation
(rollwise.registry) plus a minimal reference one written here: Generator x InflightController
(through the rollout driver), Selector, Filter and Replay. The checks are behaviour a loop relies
on, compared with the model itself where tokens are involved (a full forward pass under the
weights of each token's version)."""

from __future__ import annotations

import copy
import dataclasses
import random
import re

import pytest
import torch
from loop_helpers import PROBLEMS, Loop

from rollwise import registry
from rollwise.config import Config, FilterConfig
from rollwise.engine import BuiltinEngine
from rollwise.stages.control.inflight import CONTINUE, Decision
from rollwise.stages.filter.groups import build_group_filter, signal
from rollwise.stages.generate import Generator, generate_round
from rollwise.stages.generate.group import new_sample, sampling_params
from rollwise.stages.ledger import Ledger
from rollwise.tasks.prompts import Prompter
from rollwise.types import Group, Problem, Status

# ---- minimal reference implementations -----------------------------------------------------

class ForkingGenerator:
    """One root sample per prompt; at its first event it forks into the group's other samples
    (exercises the driver's fork: lineage and shared prefixes)."""

    def __init__(self, cfg, tokenizer):
        self.size, self.tok = cfg.generate.group_size, tokenizer

    def generate(self, rollout, problems, step):
        for p in problems:
            rollout.add(Group(p.id, [new_sample(p, self.tok(p.prompt)["input_ids"], step)], p))

        def branch(event, sample, rollout):
            if sample.parent_uid is None and not sample.meta.get("forked"):
                sample.meta["forked"] = True
                return Decision("fork", "grow_group", n=self.size - 1)
        rollout.run(branch)


class CapController:
    """Aborts every sequence at its first event past `cap` tokens; returns every group."""

    def __init__(self, cfg=None, cap: int = 3):
        self.cap = cap

    def begin(self, want, step):
        return [], want

    def on_event(self, event, sample, rollout):
        return Decision("abort", "cap") if sample.num_tokens > self.cap else CONTINUE

    def end(self, rollout, want):
        return list(rollout.groups)

    def state_dict(self):
        return {"cap": self.cap}

    def load_state_dict(self, state):
        self.cap = state["cap"]


class FirstUnseenSelector:
    """The first n pool prompts not drawn yet (then from the start again)."""

    def __init__(self, cfg=None):
        self.seen: list[str] = []

    def select(self, pool, n, rng):
        fresh = [p for p in pool if p.id not in self.seen] or list(pool)
        out = fresh[:n]
        self.seen += [p.id for p in out]
        return out

    def observe(self, outcomes, step):
        pass

    def state_dict(self):
        return {"seen": list(self.seen)}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


class LengthFilter:
    """Reward = response length; keeps groups whose lengths differ."""

    def score(self, groups):
        for g in groups:
            for s in g.samples:
                s.rewards = {"length": float(s.num_tokens)}
                s.reward = float(s.num_tokens)
        return {"filter/length_mean": sum(s.reward for g in groups for s in g.samples)
                / max(sum(len(g.samples) for g in groups), 1)}

    def keep(self, group):
        return signal(group)

    def close(self):
        pass


class LastGroupsReplay:
    """Replays the last groups put, each once."""

    def __init__(self, cfg=None):
        self.queue: list[Group] = []

    def take(self, slots, version, rng):
        n = min(len(self.queue), slots - 1)
        out, self.queue = self.queue[:n], self.queue[n:]
        return out

    def put(self, groups):
        self.queue = [g for g in groups if g.is_mixed] + self.queue

    def metrics(self, taken, slots, version):
        return {"replay/groups": float(len(taken))}

    def state_dict(self):
        return {"queue": [g.to_dict() for g in self.queue]}

    def load_state_dict(self, state):
        self.queue = [Group.from_dict(g) for g in state["queue"]]


def implementations(kind: str, reference) -> list:
    return [*registry.names(kind), reference]


def build(kind: str, impl, *args):
    return (registry.resolve(kind, impl) if isinstance(impl, str) else impl)(*args)


def name(impl) -> str:
    return impl if isinstance(impl, str) else impl.__name__


# ---- Generator x InflightController ----------------------------------------------------------

def full_forward_logprobs(model, sample) -> torch.Tensor:
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    p = len(sample.prompt_ids)
    return logp[p - 1:].gather(-1, ids[0, p:, None]).squeeze(-1)


class DigitTask:
    """The answer marker of a task: the first digit of the response."""

    @staticmethod
    def extract_answer(response):
        m = re.search(r"\d", response)
        return m.group(0) if m else None


class OneTurnEnv:
    """An agent environment that ends every episode after its first turn: the episode
    generator then meets the single-turn contract below."""

    def __init__(self, cfg, problem):
        pass

    def reset(self, problem):
        return None

    def step(self, action):
        return None, 0.0, True, {}


def one_turn_agent(problem, client):
    """An agent written for the OpenAI client that asks once: one sample per episode, whose
    prompt is the problem's (the plain model's opening message is the prompt itself)."""
    client.chat.completions.create(model=client.model,
                                   messages=[{"role": "user", "content": problem.prompt}])
    return 0.0


# Connect-the-Dots writes each episode's prompt from its pack (a hint, then the task), so a
# sample's prompt is not its problem's, and it refuses in-flight control: its contract is in
# tests/agents/test_agent_packs.py
PROMPT_GENERATORS = [g for g in implementations("generator", ForkingGenerator) if g != "cod"]


@pytest.mark.parametrize("controller", implementations("inflight", CapController), ids=name)
@pytest.mark.parametrize("generator", PROMPT_GENERATORS, ids=name)
def test_generator_and_controller_contract(tiny, generator, controller):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    cfg = Config.model_validate({"generate": {"group_size": 3, "max_new_tokens": 10,
                                              "env": "test_stage_contracts:OneTurnEnv",
                                              "agent": "test_stage_contracts:one_turn_agent",
                                              "nudge": {"contexts": ["a", "b"]}},
                                 "control": {"april": {"over_provision": 2.0}}})
    gen = registry.conform(build("generator", generator, cfg, tok), Generator, "generator")
    gen.bind(prompter=Prompter.plain(tok))  # as Run does
    if getattr(gen, "runs_to_end", False) and controller != "none":
        pytest.skip("a run refuses this pair before any work (check_generator)")
    loop = Loop(build("inflight", controller, cfg))
    if hasattr(loop.inflight, "bind"):  # the context Control.bind gives in a run
        loop.inflight.bind(policy=model, tokenizer=tok, task=DigitTask())
    # several stop ids so a random model's responses have very different lengths
    params = dataclasses.replace(sampling_params(cfg.generate, (tok.eos_token_id,)),
                                 stop_ids=tuple(range(1, 12)))
    engine = BuiltinEngine(model, seed=0, max_batch=64, segment=2)
    weights = {0: copy.deepcopy(model)}
    seen, decisions = set(), Ledger()
    for step in range(1, 4):
        ledger = Ledger()
        groups = generate_round(engine, gen, loop, params, 2, step, ledger, Prompter.plain(tok))
        decisions.decisions.update(ledger.decisions)
        assert len(groups) <= 2 and not engine.has_unfinished()
        for g in groups:
            assert g.samples and all(s.finished for s in g.samples)
            for s in g.samples:
                s.check()
                assert s.prompt_id == g.prompt_id and s.uid not in seen, "returned twice"
                seen.add(s.uid)
                prompt = g.problem.prompt if s.meta.get("nudge", -1) < 0 else \
                    gen.nudged(g.problem.prompt, gen.contexts[s.meta["nudge"]])
                assert s.prompt_ids == tok(prompt)["input_ids"]
                assert s.num_tokens <= 10 and s.versions == sorted(s.versions)
                for v in set(s.versions):  # every token under the weights that sampled it
                    at = torch.tensor([x == v for x in s.versions])
                    ref = full_forward_logprobs(weights[v], s)[at]
                    assert torch.allclose(torch.tensor(s.logprobs)[at], ref, atol=1e-4)
                if s.parent_uid is not None:  # a forked child shares its parent's prefix
                    parent = next(x for x in g.samples if x.uid == s.parent_uid)
                    k = s.branch_point
                    assert s.response_ids[:k] == parent.response_ids[:k]
                    assert s.logprobs[:k] == parent.logprobs[:k]
        with torch.no_grad():  # new weights between rounds: carried samples go on under them
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        engine.load_weights(model.state_dict(), step)
        weights[step] = copy.deepcopy(model)
    assert seen, "no sample came back in three rounds"
    twin = build("inflight", controller, cfg)
    twin.load_state_dict(loop.inflight.state_dict())
    assert repr(twin.state_dict()) == repr(loop.inflight.state_dict())
    if controller is CapController:
        assert decisions.decisions["control/abort/cap"] > 0  # counted with its reason
    if generator is ForkingGenerator:
        assert decisions.decisions["control/fork/grow_group"] > 0
    getattr(gen, "close", lambda: None)()


def test_an_everyone_decision_pauses_every_unfinished_request_and_counts_them(tiny):
    model, tok = tiny
    cfg = Config.model_validate({"generate": {"group_size": 4, "max_new_tokens": 12}})

    class StopAtFirstEvent(CapController):
        def on_event(self, event, sample, rollout):
            return Decision("pause", "enough", everyone=True)

        def end(self, rollout, want):
            self.groups = list(rollout.groups)
            return []
    stop = StopAtFirstEvent()
    engine = BuiltinEngine(model, seed=0, segment=2)
    params = sampling_params(cfg.generate, (tok.eos_token_id,))
    ledger = Ledger()
    gen = build("generator", "group", cfg, tok)
    assert generate_round(engine, gen, Loop(stop), params, 3, 1, ledger, Prompter.plain(tok)) == []
    paused = [s for g in stop.groups for s in g.samples if s.status == Status.PAUSED]
    assert paused and not engine.has_unfinished()
    assert ledger.decisions["control/pause/enough"] == len(paused)
    assert all(0 < s.num_tokens <= 12 for s in paused)  # the pause kept every token


@pytest.mark.parametrize("bad", [dict(action="jump", reason="x"), dict(action="pause"),
                                 dict(action="fork", reason="x"),
                                 dict(action="fork", reason="x", n=2, everyone=True)])
def test_malformed_decisions_are_refused_with_the_reason(bad):
    with pytest.raises(ValueError):
        Decision(**bad)


# ---- Selector ---------------------------------------------------------------------------------

@pytest.mark.parametrize("selector", implementations("selector", FirstUnseenSelector), ids=name)
def test_selector_contract(selector):
    cfg = Config()
    a, b = build("selector", selector, cfg), build("selector", selector, cfg)
    pool = PROBLEMS[:50]
    for step in range(1, 4):  # identical state and rng: identical choices
        got = a.select(pool, 8, random.Random(step))
        assert got == b.select(pool, 8, random.Random(step))
        assert len(got) == 8 and len({p.id for p in got}) == 8 and all(p in pool for p in got)
        outcomes = {p.id: (i % 3, 2) for i, p in enumerate(got)}
        a.observe(outcomes, step)
        b.observe(outcomes, step)
    c = build("selector", selector, cfg)
    c.load_state_dict(a.state_dict())
    assert c.select(pool, 8, random.Random(9)) == a.select(pool, 8, random.Random(9))
    assert len(a.select(pool[:3], 8, random.Random(0))) <= 3  # never more than the pool


# ---- Filter -----------------------------------------------------------------------------------

class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i % 10) for i in ids)


FILTERS = [{"reward": "exact"}, {"reward": {"exact": 1.0, "length": 0.5}, "length_max": 4},
           {"reward": "format"}, {"reward": "exact", "drop_equal_reward_groups": False},
           LengthFilter]


@pytest.mark.parametrize("flt", FILTERS, ids=lambda f: name(f) if isinstance(f, type)
                         else str(f))
def test_filter_contract(flt):
    if isinstance(flt, type):
        f = flt()
    else:
        task = type("T", (), {"extract_answer": staticmethod(lambda t: t[:1] or None),
                              "score_fn": None})()
        f = build_group_filter(Config(filter=FilterConfig(workers=0, **flt)), task, _Tok())
    groups = []
    for i in range(4):
        p = PROBLEMS[i]
        samples = [new_sample(p, [1, 2], 1) for _ in range(3)]
        for j, s in enumerate(samples):
            n = 1 + (j if i % 2 else 0)  # odd groups: lengths (and answers) differ
            s.extend([int(p.answer[0]) + 10 * j] * n, [-1.0] * n, [0] * n)
            s.status = Status.COMPLETED
        groups.append(Group(p.id, samples, p))
    m = f.score(groups)
    assert all(isinstance(v, float) for v in m.values())
    for g in groups:
        for s in g.samples:
            assert isinstance(s.reward, float) and s.rewards
        kept, reason = f.keep(g)
        assert isinstance(kept, bool) and (kept or reason)
    if flt is LengthFilter:
        assert [f.keep(g)[0] for g in groups] == [False, True, False, True]
    if not isinstance(flt, type) and flt.get("drop_equal_reward_groups") is False:
        assert all(f.keep(g) == (True, "") for g in groups)
    f.close()


# ---- Replay -----------------------------------------------------------------------------------

@pytest.mark.parametrize("replay", implementations("replay", LastGroupsReplay), ids=name)
def test_replay_contract(replay):
    cfg = Config.model_validate({"replay": {"enabled": True, "share": 0.5,
                                            "max_staleness": 2}})
    r = build("replay", replay, cfg)
    put: dict[str, Group] = {}
    for version in range(5):
        groups = []
        for i in range(4):
            p = PROBLEMS[version * 4 + i]
            samples = [new_sample(p, [1], version) for _ in range(2)]
            for j, s in enumerate(samples):
                s.extend([3], [-1.0], [version])
                s.reward = float(j == i % 2 or i == 0)
            groups.append(Group(p.id, samples, p))
        taken = r.take(4, version, random.Random(version))
        assert len(taken) <= 3  # one slot stays fresh
        for g in taken:
            assert put[g.prompt_id] is g  # only what was put, as it was put
            if replay == "buffer":  # its staleness bound
                assert min(v for s in g.samples for v in s.versions) >= version - 2
        assert all(isinstance(v, float) for v in r.metrics(taken, 4, version).values())
        r.put(groups)
        put.update({g.prompt_id: g for g in groups})
    twin = build("replay", replay, cfg)
    twin.load_state_dict(r.state_dict())
    a, b = r.take(4, 5, random.Random(1)), twin.take(4, 5, random.Random(1))
    assert [g.to_dict() for g in a] == [g.to_dict() for g in b]


# ---- the engine's config ----------------------------------------------------------------------

def test_engine_segment_and_kv_budget_from_the_config_take_effect(tiny):
    from rollwise.engine import Request, SamplingParams
    from rollwise.engine.backends import build_engine
    model, tok = tiny
    cfg = Config.model_validate({"engine": {"segment": 3, "kv_budget_tokens": 40,
                                            "max_batch": 8}})
    engine = build_engine(cfg, model, tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=7, seed=1)
    sid = engine.add(Request([5, 6, 7], params))
    events = [e for e in engine.stream() if e.seq_id == sid]
    assert [len(e.token_ids) for e in events] == [3, 3, 1]  # every 3 tokens and at the end
    # a request whose prompt + budget cannot fit 40 KV positions is refused, naming the budget
    with pytest.raises(ValueError, match="kv_budget_tokens=40"):
        engine.generate([Request(list(range(5, 45)), SamplingParams(max_new_tokens=8))])


# ---- Verifier ---------------------------------------------------------------------------------

class ParityVerifier:
    """Reference verifier: 1 for an even-length response."""

    name, isolated = "parity", False

    def score(self, items):
        from rollwise.stages.filter.base import Verdict
        return [Verdict({self.name: float(len(it.text) % 2 == 0)}, "") for it in items]

    def metrics(self):
        return {}


@pytest.mark.parametrize("verifier", implementations("verifier", ParityVerifier), ids=name)
def test_verifier_contract(tiny, verifier):
    """One verdict per item, in order: its own channel as a finite float, or a failure with a
    cause (a verifier that cannot score a sample fails that sample, never the batch). The
    unchecked output of an in-process verifier already has one verdict per item."""
    import math

    from rollwise.stages.filter.base import Item, Verdict, score_checked
    from rollwise.stages.filter.stage import make_verifier
    task = type("T", (), {"extract_answer": staticmethod(lambda t: t.strip() or None),
                          "score_fn": None})()
    if isinstance(verifier, str):
        v = make_verifier(verifier, FilterConfig(), task)
        v.name = verifier
    else:
        v = verifier()
    if hasattr(v, "attach"):  # the judge grades with an engine: the tiny policy's
        v.attach(BuiltinEngine(tiny[0], seed=0), tiny[1])
    problems = [Problem("a", "1+1=", "2", data={"tests": [{"input": "", "output": "2"}]}),
                Problem("b", "2+2=", "4", data={"tests": [{"input": "", "output": "4"}]})]
    texts = ["2", "print(4)", "", "5", "\\boxed{4}"]
    items = [Item(t, problems[i % 2], t.strip() or None, len(t), i // 2)
             for i, t in enumerate(texts)]
    if not v.isolated:
        assert len(v.score(items)) == len(items)
    # as the Filter stage runs it: a batch in-process, or one item at a time when isolated (where
    # a raise fails that item; the worker pool does the same with a timeout)
    out = score_checked(v, items) if not v.isolated else \
        [score_checked(v, [it])[0] for it in items]
    assert len(out) == len(items)
    for verdict in out:
        assert isinstance(verdict, Verdict)
        assert verdict.failed or (v.name in verdict.rewards
                                  and math.isfinite(float(verdict.rewards[v.name])))
    assert isinstance(v.metrics() or {}, dict)


def test_a_controller_that_releases_paused_samples_is_stopped_with_the_reason(tiny):
    model, tok = tiny
    cfg = Config.model_validate({"generate": {"group_size": 2, "max_new_tokens": 12}})

    class ReleasesPaused(CapController):
        def on_event(self, event, sample, rollout):
            return Decision("pause", "halfway")
    engine = BuiltinEngine(model, seed=0, segment=2)
    params = sampling_params(cfg.generate, (tok.eos_token_id,))
    with pytest.raises(RuntimeError, match="ReleasesPaused released .* unfinished"):
        generate_round(engine, build("generator", "group", cfg, tok), Loop(ReleasesPaused()),
                       params, 2, 1, Ledger(), Prompter.plain(tok))
