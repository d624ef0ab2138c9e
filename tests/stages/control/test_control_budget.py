"""Rollout budgets: groups of unequal size, sGPO's and DARS's group sizes, ARRoL's pruning to
correctness-balanced survivors, DUET's allocation and its unbiased marker-gated abort."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import statistics

import pytest
import torch
from train_helpers import capture_grads, clone, make_groups

from rollwise import registry
from rollwise.config import Config, DARSConfig, SGPOConfig, TrainConfig
from rollwise.engine import BuiltinEngine, Completion, Engine, Event, SamplingParams
from rollwise.stages.control.abort_duet import Duet, allocate_budget, ht_mean, informativeness
from rollwise.stages.control.alloc_dars import DARS, dars_extra
from rollwise.stages.control.alloc_sgpo import SGPO
from rollwise.stages.control.prune_arrol import Arrol, auc, balanced_keep
from rollwise.stages.generate import generate_round
from rollwise.stages.generate.group import GroupGenerator, sampling_params
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger
from rollwise.tasks.prompts import Prompter
from rollwise.training.advantages import AdvantageInputs, get_advantage
from rollwise.training.trainer import Trainer
from rollwise.types import Group, Problem, Sample, Status

# ---- groups of unequal size --------------------------------------------------------------

GROUP_LOCAL = ["grpo", "dr_grpo", "rloo", "mc_grpo", "xrpo", "nudge"]  # a group's own
BATCH_LEVEL = ["reinforce_pp", "reinforce_pp_baseline", "gdpo"]  # whitened over the batch
# baselines keyed by sample meta (CoD: pack, episode type, index, RED over the batch; TRACE:
# the prefix continued, or the tree's node values): groups of repeats, not prompt groups
# (tests/agents/test_agent_credit.py and tests/agents/test_agent_trace_tree.py check them on
# hand examples)
META_KEYED = ["cod", "trace", "trace_tree", "mssr"]  # mssr: each sample's own baseline
# (tests/stages/control/test_baseline_mssr.py)


def test_every_registered_estimator_is_classified_here():
    assert set(registry.names("advantage")) == set(GROUP_LOCAL + BATCH_LEVEL + META_KEYED)


@pytest.mark.parametrize("name", GROUP_LOCAL)
def test_unequal_groups_get_the_advantages_of_each_group_computed_alone(name):
    rng = random.Random(0)
    sizes = [3, 8, 2, 5, 13]
    rewards = [[float(rng.random() < 0.4) for _ in range(n)] for n in sizes]
    rewards[1][0] = 0.5  # a non-binary reward too
    gi = torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])
    logp = torch.tensor([-rng.random() * 2 for _ in range(len(gi))])  # XRPO's likelihoods
    together = get_advantage(name)(AdvantageInputs(torch.tensor(sum(rewards, [])), gi,
                                                   logprob_means=logp))
    at = 0
    for r in rewards:
        alone = get_advantage(name)(AdvantageInputs(
            torch.tensor(r), torch.zeros(len(r), dtype=torch.long),
            logprob_means=logp[at:at + len(r)]))
        assert torch.allclose(together.advantages[at:at + len(r)], alone.advantages, atol=1e-6)
        assert torch.equal(together.keep[at:at + len(r)], alone.keep)
        at += len(r)


@pytest.mark.parametrize("name", BATCH_LEVEL)
def test_batch_level_estimators_on_unequal_groups_match_a_naive_loop(name):
    rng = random.Random(1)
    sizes = [3, 8, 2, 5]
    r = [[float(rng.random() < 0.5) for _ in range(n)] for n in sizes]
    flat = sum(r, [])
    gi = torch.tensor([g for g, n in enumerate(sizes) for _ in range(n)])
    ch = {"a": torch.tensor(flat), "b": torch.tensor([float(i % 3 == 0) for i in range(len(flat))])}
    out = get_advantage(name)(AdvantageInputs(torch.tensor(flat), gi, ch)).advantages

    def whiten(x):
        m = sum(x) / len(x)
        sd = (sum((v - m) ** 2 for v in x) / (len(x) - 1)) ** 0.5
        return [(v - m) / (sd + 1e-6) for v in x]

    def centred(x, std=False, eps=1e-4):
        out, at = [], 0
        for n in sizes:
            g = x[at:at + n]
            m = sum(g) / n
            sd = (sum((v - m) ** 2 for v in g) / max(n - 1, 1)) ** 0.5
            out += [(v - m) / (sd + eps) if std else v - m for v in g]
            at += n
        return out
    if name == "reinforce_pp":
        ref = whiten(flat)
    elif name == "reinforce_pp_baseline":
        ref = whiten(centred(flat))
    else:
        a, b = centred(ch["a"].tolist(), True), centred(ch["b"].tolist(), True)
        total = [x + y for x, y in zip(a, b)]
        m = sum(total) / len(total)
        sd = (sum((v - m) ** 2 for v in total) / (len(total) - 1)) ** 0.5
        ref = [(v - m) / (sd + 1e-4) for v in total]
    assert torch.allclose(out, torch.tensor(ref), atol=1e-5)


def test_an_update_on_unequal_weighted_groups_matches_a_per_sample_loop(tiny):
    """Groups of 3 and 5, one sample weighted 1/q = 4 (DUET's kept tail): the gradient equals
    a plain loop over samples, each group's GRPO advantages computed alone."""
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=2, group_size=5, max_new_tokens=6, seed=3)
    groups[0].samples = groups[0].samples[:3]
    groups[1].samples[2].weight = 4.0
    cfg = TrainConfig(minibatches=1)
    trainer = Trainer(copy.deepcopy(model), cfg, pad_id=tok.pad_token_id, seed=7)
    seen = capture_grads(trainer)
    trainer.update(clone(groups))
    ref = copy.deepcopy(model)
    terms = []
    for g in groups:
        r = [s.reward for s in g.samples]
        mean = sum(r) / len(r)
        std = (sum((x - mean) ** 2 for x in r) / (len(r) - 1)) ** 0.5
        for s, x in zip(g.samples, r):
            adv = (x - mean) / (std + 1e-6)
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = ref(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
            logp = logits.log_softmax(-1).gather(-1, ids[0, len(s.prompt_ids):, None])[:, 0]
            ratio = torch.exp(logp - logp.detach())
            loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
            terms.append(s.weight * loss)
    (sum(terms) / len(terms)).backward()
    naive = torch.cat([p.grad.flatten() for p in ref.parameters()])
    naive = naive * min(1.0, cfg.grad_clip / float(naive.norm()))
    ours = torch.cat([g.flatten() for g in seen[0]])
    assert (naive - ours).abs().max() <= 1e-5 * naive.abs().max()


# ---- sGPO and DARS -----------------------------------------------------------------------

def sized_cfg(group_size: str = "fixed", **method) -> Config:
    """A config whose sGPO and DARS sections hold `method` (each takes the keys it has)."""
    sgpo = {k: v for k, v in method.items() if k in SGPOConfig.model_fields}
    dars = {k: v for k, v in method.items() if k in DARSConfig.model_fields}
    assert len(sgpo) + len(dars) == len(method), method
    return Config.model_validate({"control": {"group_size": group_size, "sgpo": sgpo,
                                              "dars": dars}, "generate": {"group_size": 8}})


def test_sgpo_group_size_is_one_over_p_clipped():
    s = SGPO(sized_cfg(group_min=2, group_max=16))
    got = {p: s.group_size(p) for p in (0.0, 1 / 32, 1 / 16, 1 / 8, 1 / 3, 0.5, 0.9)}
    assert got == {0.0: 16, 1 / 32: 16, 1 / 16: 16, 1 / 8: 8, 1 / 3: 3, 0.5: 2, 0.9: 2}


def test_sgpo_profiles_once_drops_solved_subsamples_unsolvable_and_sizes_by_p():
    pool = [Problem(f"q{i}", "x", "1") for i in range(40)]
    rate = {f"q{i}": (0 if i < 20 else 8 if i < 30 else i % 8) for i in range(40)}
    calls = []

    def profile(problems, k):
        calls.append((len(problems), k))
        return {p.id: (rate[p.id], k) for p in problems}
    s = SGPO(sized_cfg(unsolvable_keep=0.25, profile_samples=8))
    kept = s.pool(pool, profile)
    s.pool(pool, profile)
    assert calls == [(40, 8)]  # one pass, k samples each
    ids = {p.id for p in kept}
    assert not ids & {f"q{i}" for i in range(20, 30)}  # solved every time: gone
    assert len(ids & {f"q{i}" for i in range(20)}) == 5  # a quarter of the unsolvable
    mid = [p for p in pool if 0 < rate[p.id] < 8]
    assert {p.id for p in mid} <= ids
    assert s.sizes(mid, 1) == [min(16, max(2, math.ceil(8 / rate[p.id]))) for p in mid]
    twin = SGPO(sized_cfg(unsolvable_keep=0.25))
    twin.load_state_dict(s.state_dict())
    assert twin.pool(pool, None) == kept  # restored: no second pass


def test_sgpo_says_what_to_change_when_the_profile_leaves_nothing():
    s = SGPO(sized_cfg(unsolvable_keep=0.0))
    with pytest.raises(RuntimeError, match="unsolvable_keep"):
        s.pool([Problem("a", "x", "1")], lambda ps, k: {p.id: (0, k) for p in ps})


@pytest.mark.parametrize("p, et, hw", [(0, 24, 56), (1 / 8, 11, 24), (1 / 4, 3, 8),
                                       (3 / 8, 1, 3), (1 / 2, 0, 0), (7 / 8, 0, 0)])
def test_dars_extra_rollouts_follow_the_paper_table(p, et, hw):
    assert dars_extra(8, p, "et", 32) == et
    assert dars_extra(8, p, "hw", 64) == hw


def test_dars_reads_each_groups_success_rate():
    d = DARS(sized_cfg(group_size="dars", schedule="hw"))
    groups = []
    for wins in (0, 1, 2, 3, 4, 8):
        samples = [Sample("p", [1]) for _ in range(8)]
        for s in samples[:wins]:
            s.reward = 1.0
        groups.append(Group("p", samples))
    assert d.extra(groups) == [56, 24, 8, 3, 0, 0]


# ---- ARRoL -------------------------------------------------------------------------------

def test_balanced_keep_takes_the_top_rho_and_the_bottom_rest():
    q = [0.9, 0.1, 0.8, 0.2, 0.7, 0.3, 0.6, 0.4]
    assert sorted(balanced_keep(q, 4, 0.5)) == [0, 1, 2, 3]  # 0.9 0.8 high, 0.1 0.2 low
    assert sorted(balanced_keep(q, 4, 0.25)) == [0, 1, 3, 5]
    assert sorted(balanced_keep(q, 4, 1.0)) == [0, 2, 4, 6]


def test_auc_against_pairwise_counting():
    assert auc([0.9, 0.8, 0.1], [True, True, False]) == 1.0
    assert auc([0.1, 0.8, 0.9], [True, True, False]) == 0.0
    assert auc([0.5, 0.5], [True, False]) == 0.5
    assert auc([0.3], [True]) is None


class ParityPolicy(torch.nn.Module):
    """A constructed 'policy' whose last hidden state is +1 when the position's token is even
    and -1 when odd: a head w = 10 separates the two exactly."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, **_):
        h = (input_ids % 2 == 0).float() * 2 - 1
        return type("Out", (), {"hidden_states": [h[..., None]]})()


class SizedLoop:
    """Control's part of a round with its allocation (the in-flight controller's over-sample)."""

    def __init__(self, inflight, n_problems=400):
        self.inflight = inflight
        self.stream = iter([Problem(f"p{i}", f"{i}+{i % 7}=", "0") for i in range(n_problems)])

    def select(self, n, step, ledger):
        return [next(self.stream) for _ in range(n)]

    def sized(self, problems, step, ledger):
        sizes = self.inflight.allocate(problems, [8] * len(problems))
        return [dataclasses.replace(p, group_size=n) for p, n in zip(problems, sizes)]


@pytest.mark.parametrize("rho", [0.25, 0.75])
def test_arrol_survivors_positive_share_is_rho_with_a_constructed_head(tiny, rho):
    """Reward = the response token at the checkpoint is even (about half). With a head that
    ranks by it exactly, the survivors' positive share is rho instead of the raw share."""
    model, tok = tiny
    cfg = Config.model_validate({"generate": {"group_size": 8, "max_new_tokens": 12},
                                 "control": {"arrol": {"checkpoint": 4, "keep": 0.5,
                                                       "rho": rho, "explore": 0.0}}})
    arrol = Arrol(cfg)
    arrol.bind(policy=ParityPolicy())
    arrol.head._build(1)
    with torch.no_grad():
        arrol.head.linear.weight.fill_(10.0)
    loop = SizedLoop(arrol)
    engine = BuiltinEngine(model, seed=0, max_batch=256, segment=4)
    params = sampling_params(cfg.generate, (tok.eos_token_id,))
    params = dataclasses.replace(params, stop_ids=())  # every response reaches the checkpoint
    ledger = Ledger()
    groups = generate_round(engine, GroupGenerator(cfg, tok), loop, params, 24, 1, ledger,
                            Prompter.plain(tok))
    assert len(groups) == 24 and all(len(g.samples) == 8 for g in groups)  # 16 pruned to 8
    share = []
    for g in groups:
        for s in g.samples:
            s.reward = float(s.response_ids[3] % 2 == 0)
        share.append(sum(g.rewards) / 8)
    assert statistics.mean(share) == pytest.approx(rho, abs=0.05)
    assert ledger.decisions["control/prune/arrol"] == 24 * 8
    assert ledger.tokens["pruned/arrol"] > 0
    # pruned at the checkpoint: they stopped within a segment of it, not at the end
    assert ledger.tokens["pruned/arrol"] <= 24 * 8 * (4 + 4)
    arrol.observe(groups, 1)
    assert arrol.metrics()["arrol/head_auc"] == 1.0
    assert arrol.metrics()["arrol/survivor_pos_share"] == pytest.approx(rho, abs=0.05)


def test_arrol_head_learns_the_signal_from_rewards():
    cfg = Config()
    arrol = Arrol(cfg)
    rng = torch.Generator().manual_seed(0)
    h = torch.randn(400, 6, generator=rng)
    y = (h[:, 2] > 0).float()
    arrol.head.learn(h, y, steps=300)
    assert auc(arrol.head.score(h).tolist(), y.bool().tolist()) > 0.95
    twin = Arrol(cfg)
    twin.load_state_dict(arrol.state_dict())
    assert torch.equal(twin.head.score(h), arrol.head.score(h))


# ---- DUET --------------------------------------------------------------------------------

def test_duet_allocation_spends_the_budget_in_proportion_to_informativeness():
    scores = [informativeness(s, t) for s, t in [(0, 0), (4, 8), (1, 8), (8, 8), (0, 30)]]
    assert scores[0] == 0.25 and scores[1] > scores[2] > scores[4]
    n = allocate_budget(scores, 40, lo=2, hi=16)
    assert sum(n) == 40 and all(x == 0 or 2 <= x <= 16 for x in n)
    assert n[0] >= n[1] >= n[2] >= n[3]
    assert allocate_budget(scores, 5, lo=2, hi=16) == [3, 2, 0, 0, 0]  # the best two only
    assert sum(allocate_budget([1.0, 1.0], 100, lo=2, hi=16)) == 32  # capped


class StubRollout:
    def __init__(self, groups):
        self.groups, self.ledger = groups, Ledger()


class CharTokens:
    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class MarkerTask:
    @staticmethod
    def extract_answer(text):
        return text[text.index("#") + 1:][:1] or None if "#" in text else None


def stream(rng: random.Random) -> tuple[list[int], float]:
    """A response: filler, then '#' and a digit, or (a tail) a long run of filler with the
    marker at its end; the reward is whether the digit is 7. Tails succeed more often, so
    dropping them without reweighting would bias the mean reward."""
    tail = rng.random() < 0.3
    n = rng.randrange(40, 60) if tail else rng.randrange(1, 10)
    digit = "7" if rng.random() < (0.6 if tail else 0.2) else "3"
    text = "." * n + "#" + digit
    return [ord(c) for c in text], float(digit == "7")


def test_duet_reweighted_mean_reward_is_unbiased_against_the_no_abort_run():
    """Monte Carlo over 400 batches of 32 rollouts: the kept-tail weights 1/q make the
    Horvitz-Thompson mean of the kept rollouts an unbiased estimate of the full run's mean;
    the plain mean of the kept ones is biased (tails succeed more often here)."""
    cfg = Config.model_validate({"control": {"duet": {"horizon": 16, "grace": 4, "keep_prob": 0.2,
                                                      "after_marker": 2}}})
    errors, naive, saved = [], [], []
    for trial in range(400):
        rng = random.Random(trial)
        duet = Duet(cfg)
        duet.bind(tokenizer=CharTokens(), task=MarkerTask())
        full = [stream(rng) for _ in range(32)]
        samples = [Sample("p", [0], uid=f"{trial}-{i}") for i in range(32)]
        rollout = StubRollout([Group("p", samples)])
        duet.begin(1, 1)
        for s, (ids, _) in zip(samples, full):
            while s.num_tokens < len(ids):  # events every 4 tokens, as a segment of 4
                k = min(4, len(ids) - s.num_tokens)
                s.extend(ids[s.num_tokens:s.num_tokens + k], [0.0] * k, [0] * k)
                if s.num_tokens == len(ids):
                    s.status = Status.COMPLETED
                if duet.on_event(None, s, rollout).action == "abort":
                    s.status = Status.ABORTED
                    break
        kept = duet.end(rollout, 1)[0].samples
        reward = {s.uid: r for s, (_, r) in zip(samples, full)}
        for s in kept:  # a stopped-after-marker rollout still holds its answer
            assert MarkerTask.extract_answer(CharTokens.decode(s.response_ids)) is not None
        est = ht_mean([reward[s.uid] for s in kept], [s.weight for s in kept], 32)
        errors.append(est - sum(r for _, r in full) / 32)
        naive.append(sum(reward[s.uid] for s in kept) / len(kept)
                     - sum(r for _, r in full) / 32)
        saved.append(rollout.ledger.tokens["aborted/duet_no_marker"])
    se = statistics.stdev(errors) / math.sqrt(len(errors))
    assert abs(statistics.mean(errors)) < 3 * se + 1e-3  # unbiased (3 standard errors)
    assert statistics.mean(naive) < -5 * se  # without the weights: biased low
    assert statistics.mean(saved) > 0


# ---- in the loop -------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.parametrize("method, extra, token_key, decision_key", [
    ("sgpo", ["control.group_size=sgpo", "control.sgpo.profile_prompts=40",
              "control.sgpo.unsolvable_keep=1.0"], "tokens/profile",
     "decisions/control/profile/sgpo"),
    ("dars", ["control.group_size=dars"], None, "decisions/control/extend/dars"),
    ("arrol", ["control.inflight=arrol", "control.arrol.checkpoint=2", "engine.segment=2"],
     "tokens/pruned/arrol", "decisions/control/prune/arrol"),
    ("duet", ["control.inflight=duet", "control.duet.budget=0.5", "control.duet.horizon=2",
              "control.duet.grace=0", "control.duet.keep_prob=0.5", "engine.segment=1",
              "control.duet.marker=^NEVER"],
     "tokens/aborted/duet_no_marker", "decisions/control/abort/duet_no_marker"),
])
def test_each_budget_method_runs_the_loop_and_accounts_for_its_tokens(
        tmp_path, method, extra, token_key, decision_key):
    import json

    from loop_helpers import SHORT_RUN as SMALL

    from rollwise.config import load_config
    from rollwise.loop.run import train
    from rollwise.store.rollouts import RolloutStore
    cfg = load_config(None, SMALL + [f"run.root={tmp_path}", "run.name=b", "train.steps=2",
                                     "filter.reward=tests.loop_helpers:coin_reward",
                                     "run.report=false", *extra])
    summary = train(cfg)
    lines = [json.loads(x) for x in open(tmp_path / "b" / "metrics.jsonl")][1:]
    stored = RolloutStore(tmp_path / "b" / "rollouts").samples()
    assert len(stored) == sum(m["samples/total"] for m in lines)  # every scored one, once
    assert len({s.uid for s in stored}) == len(stored)
    if token_key:
        assert sum(m.get(token_key, 0) for m in lines) > 0
    assert sum(m.get(decision_key, 0) for m in lines) > 0
    # decoded = generated + what never reached the batch (profiled, pruned, aborted)
    for m in lines:
        gone = sum(v for k, v in m.items() if k.split("/")[:2] in (
            ["tokens", "profile"], ["tokens", "pruned"], ["tokens", "aborted"]))
        assert m["tokens/decoded"] == m["tokens/generated"] + gone
    assert summary["tokens_decoded"] == sum(m["tokens/decoded"] for m in lines)
    from rollwise.report.data import load_run  # the report's "where the tokens went"
    cats = load_run(tmp_path / "b").token_categories()
    assert "unaccounted" not in cats
    if token_key:
        label = token_key.removeprefix("tokens/").replace("/", ": ", 1)
        assert sum(cats[label]) == sum(m.get(token_key, 0) for m in lines)
    sizes = {}
    for s in stored:
        sizes[s.group_id] = sizes.get(s.group_id, 0) + 1
    if method == "sgpo":
        assert all(2 <= n <= 16 for n in sizes.values())
    if method == "dars":
        assert max(sizes.values()) > 4  # hard prompts grew past generate.group_size
    if method == "arrol":
        assert set(sizes.values()) == {4}  # 8 sampled, 4 survive
        assert any("arrol/survivor_pos_share" in m for m in lines)
        from rollwise.cli import main as cli  # the head votes at test time
        assert cli(["eval", "--model", str(tmp_path / "b" / "model"), "--vote", "q",
                    "run.eval_samples=3", "run.eval_temperature=1.0"]) == 0
    if method == "duet":
        assert sum(sizes.values()) <= 2 * 6 * 4 * 0.5  # half the rollouts, fewer once aborted
        assert any(m.get("tokens/aborted/duet_no_marker", 0) > 0 for m in lines)


def test_q_weighted_voting_with_an_oracle_head_solves_every_prompt_any_draw_solves(tiny):
    """vote() against counting by hand: weights of 1 give the plurality answer; an oracle
    head (1 for a right draw, 0 otherwise) solves exactly the prompts some draw solved."""
    from rollwise.evaluate import vote
    model, tok = tiny
    problems = [Problem(f"v{i}", f"{i}+{i}=", str(i % 3)) for i in range(30)]
    prompter = Prompter.plain(tok)
    first = lambda t: t.strip()[:1] or None  # noqa: E731  the answer: the first character
    scorer = lambda text, p: (float(first(text) == p.answer), "")  # noqa: E731
    engine = BuiltinEngine(model, seed=0)
    args = (engine, prompter, problems, scorer, first, 3, 6, 1.5)
    majority = vote(*args)["eval/vote_acc"]
    by_id = {p.id: p for p in problems}
    texts: dict[int, list[str]] = {}

    def oracle(draws):
        i = next(k for k, p in enumerate(problems) if prompter.ids(p) == list(draws[0][0]))
        texts[i] = [tok.decode(r, skip_special_tokens=True) for _, r in draws]
        return [float(first(t) == problems[i].answer) for t in texts[i]]
    q = vote(*args, weigh=oracle)["eval/vote_acc"]
    any_right = sum(any(first(t) == problems[i].answer for t in ts)
                    for i, ts in texts.items()) / len(problems)
    assert q == any_right and q >= majority
    plural = 0
    for i, ts in texts.items():  # the same draws (seeded), counted by hand
        answers = [first(t) for t in ts if first(t) is not None]
        if answers:
            top = max(answers, key=lambda a: (answers.count(a), -answers.index(a)))
            plural += top == by_id[f"v{i}"].answer
    assert majority == plural / len(problems)
    with pytest.raises(ValueError, match="eval_samples"):
        vote(engine, prompter, problems, scorer, first, 3, 1, 1.0)


class SegmentEngine(Engine):
    """Emits each request's script in events of `segment` tokens, as the built-in engine
    reports them; abort returns what was emitted."""

    def __init__(self, script: list[int], segment: int):
        self.script, self.segment, self.live, self.next = script, segment, {}, 0
        self.version = 0

    def add(self, request):
        self.next += 1
        self.live[self.next] = (request, 0)
        return self.next

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        events = []
        for sid, (req, at) in list(self.live.items()):
            new = self.script[at:at + self.segment]
            end = at + len(new) >= len(self.script)
            self.live[sid] = (req, at + len(new))
            events.append(Event(sid, req.id, new, [-1.0] * len(new), [1.0] * len(new),
                                [0] * len(new), end, "length" if end else None))
            if end:
                del self.live[sid]
        return events

    def abort(self, seq_id):
        req, at = self.live.pop(seq_id)
        return Completion(req.id, self.script[:at], [-1.0] * at, [1.0] * at, [0] * at, "abort",
                          seq_id)


def test_duet_stops_a_rollout_at_its_token_limit_not_at_the_next_event():
    """With events every 16 tokens, a marker at token 3 and after_marker 5, the rollout is
    trained on exactly 3 + 5 tokens; the 8 the engine ran past are counted, never trained."""
    tok = CharTokens()
    text = "12=45678" + "9" * 40
    cfg = Config.model_validate({"control": {"inflight": "duet", "duet": {
        "marker": "=", "after_marker": 5, "horizon": 30, "grace": 0}}})
    duet = Duet(cfg)
    duet.bind(tokenizer=tok, task=MarkerTask())
    duet.begin(1, 1)
    ledger = Ledger()
    rollout = Rollout(SegmentEngine([ord(c) for c in text], 16), duet, ledger,
                      SamplingParams(max_new_tokens=64))
    p = Problem("p", "q", "a", prompt_ids=[1])
    rollout.add(Group("p", [Sample(prompt_id="p", prompt_ids=[1], group_id="1:p")], p))
    rollout.run()
    s, = rollout.groups[0].samples
    assert tok.decode(s.response_ids) == "12=45678" and s.meta["duet_marker_at"] == 3
    assert len(s.logprobs) == len(s.versions) == len(s.loss_mask) == 8
    assert ledger.decisions["control/cut_tokens/duet_after_marker"] == 16 - 8
