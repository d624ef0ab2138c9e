"""SCOPE's rectification: the rectified sample's tokens, mask, versions and off-policy marks
exact (character and byte-level BPE tokenizers), which failures are rectified, the merge rule,
the trainer's treatment of off-policy tokens, and a run that rectifies and stores both."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from train_helpers import make_groups, set_on_policy

from rollwise.config import TrainConfig, load_config
from rollwise.loop.run import train
from rollwise.stages.filter.process import StepFix
from rollwise.stages.generate.scope import Scope, distinct_correct, merge
from rollwise.store.rollouts import RolloutStore
from rollwise.tasks.arith import scratchpad
from rollwise.training.trainer import Trainer
from rollwise.types import Group, Problem, Sample, Status
from tests.chat_model import chat_tokenizer
from tests.loop_helpers import SMALL

P = Problem(id="p", prompt="   347+586=", answer="933")
RIGHT = scratchpad(347, 586)  # 7+6+0=13;4+8+1=13;3+5+1=09;:339


def _scope(tok, *extra, max_new_tokens=56):
    cfg = load_config(None, ["generate.scope.verifier=columns",
                             f"generate.max_new_tokens={max_new_tokens}", *extra])
    return Scope(cfg, tok)


def _sample(tok, text: str, reward: float, version: int = 3) -> Sample:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    s = Sample(prompt_id="p", prompt_ids=[1, 2, 3], group_id="0:p", step=0,
               status=Status.COMPLETED)
    s.extend(ids, [-0.01 * (i + 1) for i in range(len(ids))], [version] * len(ids),
             [0.5] * len(ids))
    s.reward = reward
    return s


@pytest.mark.parametrize("wrong, at", [("7+6+0=13;4+8+0=12;3+5+1=09;:239", 9),
                                       ("7+6+0=12;4+8+1=13;3+5+1=09;:339", 0),
                                       ("7+6+0=13;4+8+1=13;3+5+1=09;:329", 27)])
def test_the_rectified_sample_keeps_the_prefix_and_marks_the_written_step(tiny, wrong, at):
    _, tok = tiny  # a character tokenizer: one token a character
    scope = _scope(tok)
    s = _sample(tok, wrong, 0.0)
    [r] = scope.propose([Group("p", [s], P)], version=7)
    new = r.sample
    fix_ids = tok(r.fix.text, add_special_tokens=False)["input_ids"]
    assert r.fix.start == at and new.parent_uid == s.uid and new.group_id == s.group_id
    assert new.response_ids == s.response_ids[:at] + fix_ids
    assert new.logprobs == s.logprobs[:at] + [0.0] * len(fix_ids)
    assert new.versions == [3] * at + [7] * len(fix_ids)  # the corrector's: this version
    assert new.loss_mask == [1] * (at + len(fix_ids))
    assert new.off_policy == list(range(at, at + len(fix_ids)))
    assert new.status == Status.PAUSED and not new.finished  # the engine continues it
    assert tok.decode(new.response_ids) == RIGHT[:at + len(r.fix.text)]
    assert new.meta["scope"] == {"step": r.fix.step, "kept": at,
                                 "written": len(fix_ids)}
    assert s.response_ids == tok(wrong, add_special_tokens=False)["input_ids"]  # untouched


def test_a_bpe_prefix_is_cut_at_a_token_boundary_and_the_corrector_writes_the_rest():
    tok = chat_tokenizer()
    scope = _scope(tok)
    s = _sample(tok, "34 + 56 = 80, so the answer is 80.", 0.0)
    fix = StepFix(0, 10, "90")
    new = scope.rectified(s, fix, version=1)
    k = new.meta["scope"]["kept"]
    assert new.response_ids[:k] == s.response_ids[:k]
    assert tok.decode(new.response_ids) == "34 + 56 = 90"
    assert tok.decode(s.response_ids[:k]) == "34 + 56 = 90"[:len(tok.decode(s.response_ids[:k]))]
    assert new.off_policy == list(range(k, new.num_tokens))
    # a token that straddles the step start is not kept: the corrector writes it again
    assert len(tok.decode(s.response_ids[:k])) <= 10


def test_only_failed_rollouts_of_mostly_wrong_groups_the_longest_right_prefix_first(tiny):
    _, tok = tiny
    scope = _scope(tok, "generate.scope.per_group=2", "generate.scope.max_solved=0.5")
    early = _sample(tok, "7+6+0=12;4+8+1=13;3+5+1=09;:339", 0.0)  # wrong at step 0
    late = _sample(tok, "7+6+0=13;4+8+1=13;3+5+1=08;:338", 0.0)  # wrong at step 2
    middle = _sample(tok, "7+6+0=13;4+8+0=12;3+5+1=09;:239", 0.0)
    right = _sample(tok, RIGHT, 1.0)
    todo = scope.propose([Group("p", [early, late, middle, right], P)], version=0)
    assert [t.failed for t in todo] == [late, middle]
    mostly_right = Group("p", [_sample(tok, RIGHT, 1.0), _sample(tok, RIGHT, 1.0),
                               _sample(tok, RIGHT, 1.0), copy.deepcopy(early)], P)
    assert scope.propose([mostly_right], version=0) == []  # 3/4 solved > 0.5
    unscored = copy.deepcopy(early)
    unscored.status = Status.FAILED
    assert scope.propose([Group("p", [unscored], P)], version=0) == []


def test_no_room_left_means_no_rectification(tiny):
    _, tok = tiny
    scope = _scope(tok, max_new_tokens=30)
    late = _sample(tok, "7+6+0=13;4+8+1=13;3+5+1=08;:338", 0.0)  # 18 kept + 9 written
    assert scope.propose([Group("p", [late], P)], version=0) != []
    scope = _scope(tok, max_new_tokens=27)
    assert scope.propose([Group("p", [late], P)], version=0) == []


def test_a_rectification_replaces_its_failure_only_when_it_scores_higher(tiny):
    _, tok = tiny
    scope = _scope(tok)
    a, b, c = (_sample(tok, "7+6+0=12;4+8+1=13;3+5+1=09;:339", 0.0) for _ in range(3))
    g = Group("p", [a, b, c], P)
    todo = scope.propose([g], version=0)
    scope.per_group = 3
    todo = scope.propose([g], version=0)
    todo[0].sample.reward, todo[0].sample.status = 1.0, Status.COMPLETED
    todo[1].sample.reward, todo[1].sample.status = 0.0, Status.COMPLETED  # no better
    todo[2].sample.reward, todo[2].sample.status = 1.0, Status.FAILED  # unscored
    aside, counts = merge(todo)
    assert g.samples == [todo[0].sample, b, c]
    # stored, never trained: the replaced rollout and the two rectifications that lost
    assert [r.samples for r in aside] == [[a], [todo[1].sample], [todo[2].sample]]
    assert all(r.problem is P for r in aside)
    assert [t.sample.meta["scope"]["replaced"] for t in todo] == [True, False, False]
    assert counts == {"generate/scope/proposed": 3.0, "generate/scope/replaced": 1.0,
                      "generate/scope/off_policy_tokens": float(len(todo[0].sample.off_policy))}


def test_distinct_correct_traces_per_group():
    def s(ids, r, status=Status.COMPLETED):
        x = Sample(prompt_id="p", prompt_ids=[1], response_ids=ids, status=status)
        x.reward = r
        return x
    g1 = Group("a", [s([1, 2], 1.0), s([1, 2], 1.0), s([1, 3], 1.0), s([4], 0.0)])
    g2 = Group("b", [s([5], 0.0), s([6], 1.0, Status.FAILED)])  # an unscored one is no trace
    assert distinct_correct([g1, g2]) == 1.0
    assert distinct_correct([]) == 0.0


def test_off_policy_tokens_take_the_pre_update_policy_as_behaviour(tiny):
    """Corrected tokens have no sampling distribution: their ratio is against the policy
    before the update, and no TIS/MIS weight or mask touches them, while the sampled tokens
    around them keep their behaviour correction."""
    model, tok = tiny
    groups = make_groups(model, tok, n_prompts=1, group_size=4, max_new_tokens=6)
    set_on_policy(groups, model, 0, 0)
    s = groups[0].samples[1]
    s.off_policy = [1, 2]
    s.logprobs[1] = s.logprobs[2] = 0.0
    s.logprobs[3] -= 3.0  # a sampled token the engine saw far likelier: TIS weighs it
    cfg = TrainConfig(correction={"mode": "tis", "high": 2.0}, warmup_steps=0)
    t = Trainer(copy.deepcopy(model), cfg, pad_id=0)
    prep, m = t.prepare(groups)
    row, p = 1, len(s.prompt_ids) - 1
    fresh, _ = t.logprobs(t.model, prep.batch)
    assert torch.allclose(prep.anchor[row], fresh[row], atol=1e-6)
    assert torch.allclose(prep.batch.behaviour_logprobs[row, p + 1:p + 3],
                          fresh[row, p + 1:p + 3], atol=1e-6)
    assert prep.weights[row, p + 1:p + 3].tolist() == [1.0, 1.0]
    assert float(prep.weights[row, p + 3]) == pytest.approx(2.0)  # e^3, truncated at 2
    assert m["off_policy_tokens"] == 2.0
    # no correction: the engine's log-probs could stand in for the old ones, but they hold
    # the corrector's 0s, so the pass is taken on every row
    t = Trainer(copy.deepcopy(model), TrainConfig(warmup_steps=0), pad_id=0)
    prep, m = t.prepare(groups, first_mb=torch.tensor([0]))
    assert m.get("old_logprobs_from_engine", 0.0) == 0.0
    assert torch.allclose(prep.anchor[row], fresh[row], atol=1e-6)


def test_a_run_rectifies_trains_on_the_rectified_and_stores_the_replaced(tmp_path):
    cfg = load_config(None, SMALL + [
        "task.tiers={add2s: 1.0}", "generate.max_new_tokens=40", "generate.scope.verifier=columns",
        "generate.scope.max_solved=1.0", "train.steps=2", "run.checkpoint_every=0",
        "filter.reward=tests.loop_helpers:first_column", "model.max_positions=64",
        f"run.root={tmp_path}", "run.name=s"])
    train(cfg)
    metrics = [json.loads(x) for x in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    rows = [m for m in metrics if "generate/scope/proposed" in m]
    assert rows and sum(m["generate/scope/proposed"] for m in rows) > 0
    # the trainer saw the corrected steps of the rollouts that replaced failures (all of
    # them, but in groups Filter dropped)
    assert 0 < sum(m.get("train/off_policy_tokens", 0) for m in rows) <= sum(
        m["generate/scope/off_policy_tokens"] for m in rows)
    samples = RolloutStore(tmp_path / "s" / "rollouts").samples()
    summary = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert summary["rollouts"] == len(samples)  # the replaced and the losing ones count
    rectified = [s for s in samples if "scope" in s.meta]
    uids = {s.uid: s for s in samples}
    # every rectified rollout is stored, and so is every failed one it rectified
    assert len(rectified) == sum(m["generate/scope/proposed"] for m in rows)
    assert sum(s.meta["scope"]["replaced"] for s in rectified) == sum(
        m["generate/scope/replaced"] for m in rows) > 0
    for s in rectified:
        failed = uids[s.parent_uid]
        assert s.meta["scope"]["replaced"] == (s.reward > failed.reward)
        k, w = s.meta["scope"]["kept"], s.meta["scope"]["written"]
        assert s.off_policy == list(range(k, k + w)) and s.finished
