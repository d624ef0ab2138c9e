"""NudgeRL: the reward split sums to the reward's deviation, the advantage against a naive loop,
the distillation rows answer the plain prompt, and an update's gradient equals the policy term
plus the distillation term computed by hand; the generator's contexts and a run."""

from __future__ import annotations

import copy
import json
import random
from collections import Counter

import pytest
import torch
from train_helpers import capture_grads, clone, make_groups, set_on_policy

from rollwise.config import ConfigError, TrainConfig, load_config
from rollwise.loop.run import train
from rollwise.stages.generate.nudge import NudgeGenerator, load_contexts
from rollwise.store.rollouts import RolloutStore
from rollwise.training.advantages import AdvantageInputs, nudge, nudge_split
from rollwise.training.trainer import Trainer, distillation_rows, token_logprobs
from rollwise.types import Batch, Problem
from tests.loop_helpers import SMALL


def _random_group(rng):
    n = rng.randint(2, 9)
    r = torch.tensor([float(rng.random() < 0.5) for _ in range(n)])
    return r, [rng.choice([-1, 0, 1, 2]) for _ in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_the_split_sums_to_the_rewards_deviation_from_the_group_mean(seed):
    r, ctx = _random_group(random.Random(seed))
    intra, inter = nudge_split(r, ctx)
    assert torch.allclose(intra + inter, r - r.mean(), atol=1e-6)
    for c in set(ctx) - {-1}:  # within a context, the intra parts are centred
        at = torch.tensor([k == c for k in ctx])
        assert abs(float(intra[at].sum())) < 1e-5
    plain = torch.tensor([k == -1 for k in ctx])
    assert torch.equal(inter[plain], torch.zeros(int(plain.sum())))


def _naive(rewards, contexts, lam, eps=1e-5):
    """NudgeRL's advantage written out with plain Python (tally0818/NudgeRL's formula)."""
    n = len(rewards)
    mean = sum(rewards) / n
    ctx_mean = {c: sum(r for r, k in zip(rewards, contexts) if k == c)
                / sum(k == c for k in contexts) for c in set(contexts)}
    a = [r - mean if k == -1 else (r - ctx_mean[k]) + lam * (ctx_mean[k] - mean)
         for r, k in zip(rewards, contexts)]
    m = sum(a) / n
    std = (sum((x - m) ** 2 for x in a) / n) ** 0.5
    return [(x - m) / (std + eps) for x in a]


@pytest.mark.parametrize("lam", [0.0, 1.0, 1.1, 3.0])
def test_the_advantage_against_a_naive_loop(lam):
    rng = random.Random(7)
    groups = [_random_group(rng) for _ in range(6)]
    r = torch.cat([g[0] for g in groups])
    ctx = [c for g in groups for c in g[1]]
    gi = torch.tensor([i for i, g in enumerate(groups) for _ in g[1]])
    out = nudge(AdvantageInputs(r, gi, meta=[{"nudge": c} for c in ctx], nudge_inter=lam))
    want = [a for g in groups for a in _naive(g[0].tolist(), g[1], lam)]
    assert out.advantages.tolist() == pytest.approx(want, abs=1e-5)
    if lam == 1.0:  # the split recombined: GRPO's centring, whitened
        plain = nudge(AdvantageInputs(r, gi, meta=[{} for _ in ctx], nudge_inter=lam))
        assert torch.allclose(out.advantages, plain.advantages, atol=1e-5)


def _nudged_groups(model, tok, plain_prompt="99+1="):
    groups = make_groups(model, tok, n_prompts=2, group_size=4, max_new_tokens=5)
    for g in groups:
        g.problem = Problem(id=g.prompt_id, prompt=plain_prompt, answer="100",
                            prompt_ids=tok(plain_prompt)["input_ids"])
        for j, s in enumerate(g.samples):
            s.meta["nudge"] = [-1, 0, 0, 1][j]
    return groups


def test_the_distillation_rows_answer_the_plain_prompt(tiny):
    model, tok = tiny
    groups = _nudged_groups(model, tok)
    rows = distillation_rows(groups, 0.25)
    assert [i for i, _ in rows] == [1, 2, 3, 5, 6, 7]  # every nudged sample, none plain
    for i, row in rows:
        src = [s for g in groups for s in g.samples][i]
        assert row.prompt_ids == tok("99+1=")["input_ids"] != src.prompt_ids
        assert row.response_ids == src.response_ids and row.weight == 0.25
    assert distillation_rows(groups, 0.0) == []


def test_an_update_is_the_policy_term_plus_the_distillation_term_by_hand(tiny):
    model, tok = tiny
    groups = _nudged_groups(model, tok)
    set_on_policy(groups, model, 0, 0)
    coef = 0.3
    cfg = TrainConfig(minibatches=1, warmup_steps=0, grad_clip=1e9, advantage="nudge",
                      nudge={"distill_coef": coef, "inter_weight": 1.1})
    t = Trainer(copy.deepcopy(model), cfg, pad_id=0)
    seen = capture_grads(t)
    metrics = t.update(clone(groups))
    assert metrics["train/nudge/distill_rows"] == 6
    got = torch.cat([g.flatten() for g in seen[0]])

    # by hand: at ratio 1, -(1/S) [sum_i A_i mean_t log p(y_t | x_i)
    #                              + coef sum_nudged A_i mean_t log p(y_t | plain)]
    samples = [s for g in groups for s in g.samples]
    gi = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    adv = nudge(AdvantageInputs(torch.tensor([s.reward for s in samples]), gi,
                                meta=[s.meta for s in samples], nudge_inter=1.1)).advantages
    ref = copy.deepcopy(model)
    plain = [copy.deepcopy(s) for s in samples]
    for s, g in zip(plain, [g for g in groups for _ in g.samples]):
        s.prompt_ids = list(g.problem.prompt_ids)

    def seq_means(rows):
        batch = Batch.from_samples(rows, [0.0] * len(rows), 0)
        logp, _ = token_logprobs(ref, batch)
        m = batch.loss_mask
        return (logp * m).sum(-1) / m.sum(-1).clamp_min(1)
    nudged = torch.tensor([s.meta["nudge"] >= 0 for s in samples]).float()
    live = torch.tensor([s.num_tokens > 0 for s in samples]).float()
    loss = -((adv * seq_means(samples) * live).sum()
             + coef * (nudged * adv * seq_means(plain) * live).sum()) / live.sum()
    loss.backward()
    want = torch.cat([p.grad.flatten() for p in ref.parameters()])
    assert got.abs().max() > 0
    assert torch.allclose(got, want, atol=1e-5)


def test_contexts_from_config_and_file_and_clear_errors(tmp_path):
    f = tmp_path / "ctx.txt"
    f.write_text("# a comment\nwork from the last digit\n\n  check by subtracting  \n")
    cfg = load_config(None, ["generate.strategy=nudge", "generate.nudge.contexts=[a hint]",
                             f"generate.nudge.contexts_file={f}"])
    assert load_contexts(cfg) == ["a hint", "work from the last digit", "check by subtracting"]
    with pytest.raises(Exception, match="generate.nudge.contexts"):
        load_config(None, ["generate.strategy=nudge"])
    absent = ["generate.strategy=nudge", f"generate.nudge.contexts_file={tmp_path / 'no.txt'}"]
    with pytest.raises(ConfigError, match="contexts_file = .*no such file"):
        load_config(None, absent)  # said before any work
    with pytest.raises(ConfigError, match="cannot read"):  # a file that went since
        load_contexts(load_config(None, absent, check_files=False))
    shipped = load_config(None, ["generate.strategy=nudge",
                                 "generate.nudge.contexts_file=nudge-arithmetic.txt"])
    assert len(load_contexts(shipped)) >= 4  # a preset's side file by its name, from anywhere
    with pytest.raises(Exception, match="template"):
        load_config(None, ["generate.nudge.template=no placeholders"])
    with pytest.raises(Exception, match="distill_coef"):
        load_config(None, ["generate.strategy=nudge", "generate.nudge.contexts=[x]",
                           "train.subsample=2"])


class _Prompter:
    def encode(self, prompt):
        return [ord(c) for c in (prompt if isinstance(prompt, str) else
                                 "|".join(m["content"] for m in prompt))]


def _generator(*extra):
    cfg = load_config(None, ["generate.strategy=nudge", "generate.group_size=8",
                             "generate.nudge.contexts=[A, B, C, D]", *extra])
    g = NudgeGenerator(cfg, None)
    g.bind(prompter=_Prompter())
    return g


def test_a_group_is_shared_over_its_contexts_and_some_rollouts_are_plain():
    g = _generator("generate.nudge.per_prompt=2", "generate.nudge.plain_share=0.25")
    counts, plain, n = Counter(), 0, 0
    for step in range(200):
        got = g.assign("p", 8, step)
        assert got == g.assign("p", 8, step)  # a function of seed, step and prompt: resumable
        nudged = [c for c in got if c >= 0]
        assert len(set(nudged)) <= 2
        counts.update(nudged)
        plain += got.count(-1)
        n += len(got)
    assert plain / n == pytest.approx(0.25, abs=0.03)
    assert all(v / sum(counts.values()) == pytest.approx(0.25, abs=0.05) for v in counts.values())
    seq = _generator("generate.nudge.draw=sequential", "generate.nudge.plain_share=0")
    assert seq.assign("p", 4, 0) == [0, 0, 1, 1] and seq.assign("p", 4, 1) == [2, 2, 3, 3]


def test_the_context_joins_the_last_user_message():
    g = _generator()
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    out = g.nudged(chat, "B")
    assert out[:3] == chat[:3] and out[3]["content"] == "q2\n\nStrategy: B"
    assert chat[3]["content"] == "q2"  # the problem's own prompt is untouched
    assert g.nudged("12+3=", "A") == "12+3=\n\nStrategy: A"
    with pytest.raises(ValueError, match="no user message"):
        g.nudged([{"role": "system", "content": "s"}], "A")


def test_a_nudged_run_trains_the_plain_prompt_too(tmp_path):
    cfg = load_config(None, SMALL + [
        "generate.strategy=nudge", "generate.nudge.contexts=[c1, c2, c3]",
        "train.advantage=nudge", "train.steps=2", "run.checkpoint_every=0",
        f"run.root={tmp_path}", "run.name=n"])
    train(cfg)
    metrics = [json.loads(x) for x in (tmp_path / "n" / "metrics.jsonl").read_text().splitlines()]
    assert sum(m.get("train/nudge/distill_rows", 0) for m in metrics) > 0
    samples = RolloutStore(tmp_path / "n" / "rollouts").samples()
    contexts = Counter(s.meta["nudge"] for s in samples)
    assert contexts[-1] > 0 and sum(v for k, v in contexts.items() if k >= 0) > 0
    by_group = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    for group in by_group.values():  # plain rollouts share the plain prompt; nudged differ
        plain = {tuple(s.prompt_ids) for s in group if s.meta["nudge"] == -1}
        assert len(plain) <= 1
        for s in group:
            if s.meta["nudge"] >= 0:
                assert tuple(s.prompt_ids) not in plain
