"""TRACE rollouts (rollwise.agents.trace_rollout) on a scripted engine: a continuation of a turn
prefix holds the root's tokens up to the cut in its prompt and an environment replayed to the
same point, so a deterministic policy continues it into the root's own episode token for token;
the budget is the group size; the allocation follows the predictor; advantages are taken among
the samples of one anchor."""

import pytest
import torch
from agent_helpers import TRACE, calls_then_copies, run

from rollwise.agents.trace_rollout import TraceGenerator, features
from rollwise.config import load_config
from rollwise.models import char_tokenizer
from rollwise.training.advantages import AdvantageInputs, trace
from rollwise.types import Problem


def test_a_continuation_of_a_deterministic_policy_is_its_root_episode():
    # the predictor favours depth-1 cuts (p = 0.5) over the prompts (p ~ 1)
    rollout, tok, _ = run(["generate.trace.budget=episodes"], predictor=[10.0, 0.0, 0.0, 0.0, 0.0])
    # the budget is the batch's: 2 roots per problem, and 2 x (6 - 2) continuations in all
    assert sum(len(g.samples) for g in rollout.groups) == 12
    for g in rollout.groups:
        root = g.samples[0]
        whole = root.prompt_ids + root.response_ids
        assert tok.decode(root.response_ids).startswith("calculator(")
        for s in g.samples[2:]:
            assert s.meta["trace_depth"] == 1 and s.meta["trace_anchor"].endswith("@1")
            cut = len(s.prompt_ids) - len(root.prompt_ids)
            assert s.prompt_ids == whole[:len(s.prompt_ids)]  # the root's tokens to the cut
            assert tok.decode(whole[len(root.prompt_ids):][:cut]).endswith(";tool: " +
                                                                          g.problem.answer + ";")
            assert s.prompt_ids + s.response_ids == whole  # continued into the same episode
            assert all(m == 1 for m in s.loss_mask)  # only its own turn is trained
            assert s.meta["env_reward"] == 1.0 and s.meta["env_tool_calls"] == 1
    d = rollout.ledger.decisions
    assert d["trace/continue/depth1"] == 8 and d["trace/continue/depth0"] == 0
    cuts = {s.meta["trace_anchor"] for g in rollout.groups for s in g.samples[2:]}
    assert d["trace/siblings/sets"] == 2 + len(cuts) and d["trace/siblings/mixed"] == 0


def test_the_token_budget_is_what_root_only_allocation_would_sample():
    """budget=tokens: each problem's group size less its roots, at its roots' mean sampled
    tokens; a continuation costs its root's sampled tokens after the cut. A deterministic
    policy samples exactly that, so the continuations spend the budget but for less than one
    continuation's cost."""
    rollout, tok, _ = run(predictor=[10.0, 0.0, 0.0, 0.0, 0.0])
    budget, spent, cheapest = 0, 0, None
    for g in rollout.groups:
        root = g.samples[0]
        sampled = sum(root.loss_mask)  # calculator(..)<eos> and the copied result<eos>
        assert sampled == len("calculator(" + g.problem.prompt[:-1] + ")") + 1 \
            + len(g.problem.answer) + 1
        budget += (6 - 2) * sampled
        tail = len(g.problem.answer) + 1  # after the cut: the copy of the result
        for s in g.samples[2:]:
            assert s.meta["trace_depth"] == 1 and sum(s.loss_mask) == tail
            spent += tail
        cheapest = min(cheapest or tail, tail)
    assert budget - cheapest < spent <= budget
    assert sum(len(g.samples) for g in rollout.groups) - 4 > 8  # more than budget=episodes


def test_root_allocation_spends_the_budget_on_the_prompts():
    rollout, _, _ = run(["generate.trace.allocation=root"])
    d = rollout.ledger.decisions
    assert d["trace/continue/depth0"] == 8 and d["trace/continue/depth1"] == 0
    for g in rollout.groups:  # i.i.d. groups of the group size, each sample once
        assert len(g.samples) == 6 and len({s.uid for s in g.samples}) == 6
        assert {s.meta["trace_anchor"] for s in g.samples} == {f"{g.problem.id}@0"}
    # a problem's own group size (Control's per-prompt sizes) is its budget
    sized = [Problem("p0", "417*386=", str(417 * 386), group_size=3),
             Problem("p1", "12*34=", str(12 * 34), group_size=9)]
    rollout, _, _ = run(["generate.trace.allocation=root"], problems=sized)
    assert [len(g.samples) for g in rollout.groups] == [3, 9]


def test_mixed_sets_are_counted_and_the_predictor_learns_from_them():
    def flaky(conversation):  # copies the result right only for the first problem
        out = calls_then_copies(conversation)
        return "9<eos>" if "tool:" in conversation and "12*34" in conversation else out
    rollout, _, gen = run(predictor=[10.0, 0.0, 0.0, 0.0, 0.0], script=flaky)
    for g in rollout.groups:
        won = {s.meta["env_reward"] for s in g.samples}
        assert won == ({1.0} if g.problem.id == "p0" else {0.0})
    # after the update, a depth-1 prefix with a call is no longer predicted certain
    x = torch.tensor([features(1, 3, {"tool_calls": 1}, 0)])
    assert 0.0 < float(gen.predictor.predict(x)) < 1.0


def test_the_trace_estimator_baselines_each_anchor():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    meta = [{"trace_anchor": k} for k in ("a@0", "a@0", "r@1", "r@1", "r@1")]
    x = AdvantageInputs(rewards=rewards, group_index=torch.zeros(5, dtype=torch.long),
                        meta=meta)
    adv = trace(x).advantages.tolist()
    assert adv == pytest.approx([0.5, -0.5, 1 / 3, 1 / 3, -2 / 3])
    with pytest.raises(ValueError, match="trace_anchor"):
        trace(AdvantageInputs(rewards=rewards, group_index=torch.zeros(5, dtype=torch.long),
                              meta=[{}] * 5))


def test_roots_must_leave_a_budget():
    with pytest.raises(ValueError, match="fewer roots"):
        TraceGenerator(load_config(None, TRACE + ["generate.trace.roots=6"]), char_tokenizer())
