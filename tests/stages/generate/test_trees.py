"""Tree rollouts: ECHO's and LATR's rules at their thresholds on constructed traces, and both
generators on the real engine: lineage, chosen-token flags and log-probabilities against a
full forward pass, groups of the asked size, pruned branches counted and never trained."""

import copy
import math

import engine_contract as contract
import pytest
import torch

from rollwise.config import EchoConfig, load_config
from rollwise.engine import BuiltinEngine, SamplingParams
from rollwise.stages.control.inflight import RunToEnd
from rollwise.stages.generate.echo import EchoGenerator
from rollwise.stages.generate.latr import LatrGenerator
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.generate.tree_rules import (
    EchoTrace,
    echo_alternatives,
    echo_branches_at,
    echo_prune_reason,
    echo_push,
    echo_width,
    edit_distance,
    eta_at,
    latr_branches,
    latr_exit_count,
    latr_too_similar,
)
from rollwise.stages.ledger import Ledger
from rollwise.types import Problem, Status

ECHO = EchoConfig()


# ---------------------------------------------------------------------------- ECHO's rules

def test_echo_width_at_its_thresholds():
    assert echo_width(1.0, 1.2, ECHO) == 1  # the floor of the formula
    assert echo_width(3.5, 1.2, ECHO) == 3  # 1 + 2 at the entropy threshold
    assert echo_width(3.5, 0.0, ECHO) == 4  # + 1 at zero confidence
    assert echo_width(9.0, 0.0, ECHO) == 4  # capped at max_width
    assert echo_width(1.0, 2.4, ECHO) == 1  # round(0) clipped up to 1
    assert echo_width(2.25, 1.2, ECHO) == 2  # 1 + 2 * 1.25 / 2.5 = 2


def test_echo_width_with_a_lower_entropy_floor_for_a_small_model():
    small = EchoConfig(entropy_threshold=0.5, entropy_floor=0.1, conf_threshold=4.0)
    assert echo_width(0.1, 4.0, small) == 1  # at the floor
    assert echo_width(0.5, 4.0, small) == 3  # 1 + 2 at the threshold, as with the defaults
    assert echo_width(0.3, 4.0, small) == 2  # halfway: 1 + 2 * 0.2 / 0.4 = 2
    assert echo_width(0.5, 0.0, small) == 4  # + 1 at zero confidence
    with pytest.raises(ValueError, match="entropy_floor .* must be below entropy_threshold"):
        EchoConfig(entropy_threshold=0.5)  # the default floor 1.0 is above it


def _trace(H, Cg, dH, Ctail=None) -> EchoTrace:
    n = len(H)
    return EchoTrace(list(H), [1.0] * n, list(Cg), list(Ctail or [2.0] * n), list(dH))


def test_echo_branches_only_where_all_three_conditions_hold_from_min_position():
    ok = _trace([3.5] * 6, [1.2] * 6, [0.2] * 6)
    assert not any(echo_branches_at(ok, t, ECHO) for t in range(4))  # before min_position
    assert echo_branches_at(ok, 4, ECHO)  # each value exactly at its threshold
    assert not echo_branches_at(_trace([3.49] * 6, [1.2] * 6, [0.2] * 6), 5, ECHO)
    assert not echo_branches_at(_trace([3.5] * 6, [1.21] * 6, [0.2] * 6), 5, ECHO)
    assert not echo_branches_at(_trace([3.5] * 6, [1.2] * 6, [0.19] * 6), 5, ECHO)


def test_echo_prune_triggers_each_on_its_own_trace():
    calm = dict(H=[1.0] * 5, dH=[0.0] * 5)
    assert echo_prune_reason(_trace(Cg=[1, 1, 0.4, 1, 1], **calm), ECHO) is None
    assert echo_prune_reason(_trace(Cg=[1, 1, 0.39, 1, 1], **calm), ECHO) == "min_conf"
    falling = [1.6, 1.4, 1.2, 1.0]
    assert echo_prune_reason(_trace([1] * 4, [1] * 4, [0] * 4, falling), ECHO) == "conf_falling"
    assert echo_prune_reason(_trace([1] * 4, [1] * 4, [0] * 4, [1.6, 1.4, 1.2, 1.01]),
                             ECHO) is None  # fell 3 times but above tail_conf
    assert echo_prune_reason(_trace([1] * 4, [1] * 4, [0] * 4, [1.6, 1.6, 1.2, 1.0]),
                             ECHO) is None  # fell twice only
    rising = [0.1, 0.2, 0.4, 0.51]
    assert echo_prune_reason(_trace([1] * 4, [1] * 4, rising), ECHO) == "entropy_rising"
    assert echo_prune_reason(_trace([1] * 4, [1] * 4, [0.1, 0.2, 0.4, 0.5]), ECHO) is None
    assert echo_prune_reason(_trace([1] * 4, [1] * 4, [0.3, 0.2, 0.4, 0.6]), ECHO) is None


def test_echo_statistics_from_top_k_logprobs_by_hand():
    cfg = EchoConfig(group_window=2, tail_window=3, delta_window=2)
    tr = EchoTrace()
    rows = [[math.log(p) for p in (0.5, 0.3, 0.1, 0.05, 0.03, 0.02)],
            [math.log(0.9), math.log(0.1)], [math.log(0.25)] * 4]
    for r in rows:
        echo_push(tr, r, cfg)
    p = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    assert tr.H[0] == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)
    assert tr.H[2] == pytest.approx(math.log(4), abs=1e-9)  # uniform over 4
    C = [-sum(math.log(x) for x in (0.5, 0.3, 0.1, 0.05, 0.03)) / 5,
         -(math.log(0.9) + math.log(0.1)) / 2, -math.log(0.25)]
    assert tr.C == pytest.approx(C)
    assert tr.Cg == pytest.approx([C[0], (C[0] + C[1]) / 2, (C[1] + C[2]) / 2])
    assert tr.Ctail[2] == pytest.approx(sum(C) / 3)
    assert tr.dH == pytest.approx([0.0, tr.H[1] - tr.H[0], tr.H[2] - (tr.H[0] + tr.H[1]) / 2])
    assert echo_alternatives([(7, -1.0), (3, -0.5), (9, -2.0)], sampled=3, width=2) == [7, 9]


# ---------------------------------------------------------------------------- LATR's rules

def test_latr_branch_thresholds_are_strict():
    assert latr_branches(0.40, 0.30, 0.25, 0.15)
    assert not latr_branches(0.50, 0.25, 0.25, 0.30)  # p2 not above tau_abs
    assert not latr_branches(0.45, 0.30, 0.25, 0.15)  # p1 - p2 = tau_rel is not below it
    assert latr_branches(0.449, 0.30, 0.25, 0.15)


def test_latr_similarity_pruning_on_constructed_token_sequences():
    assert edit_distance(list("kitten"), list("sitting")) == 3
    assert edit_distance([], [1, 2]) == 2
    assert latr_too_similar([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], 0.4)  # rejoined the parent
    assert latr_too_similar([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], 0.4)  # 1/5 < 0.4
    assert not latr_too_similar([1, 2, 3, 4, 5], [1, 9, 9, 4, 5], 0.4)  # 2/5 is not below
    assert not latr_too_similar([1, 2, 3, 4, 5], [6, 7, 8, 9, 0], 0.4)


def test_latr_eta_schedule_and_exit_count():
    sched = {0: 1.0, 10: 0.75, 20: 0.5, 80: 0.25, 200: 0.0}
    assert [eta_at(sched, s) for s in (0, 9, 10, 19, 20, 79, 80, 199, 200, 10**6)] == \
        [1.0, 1.0, 0.75, 0.75, 0.5, 0.5, 0.25, 0.25, 0.0, 0.0]
    assert eta_at({5: 0.5}, 0) == 1.0  # before the first key: all tree
    assert latr_exit_count(8, 1, 0, 100) == 8  # round(7.84)
    assert latr_exit_count(8, 1, 100, 100) == 7  # round(7.44)
    assert latr_exit_count(8, 4, 50, 100) == round(32 * 0.955)


# ---------------------------------------------------------------------------- on the engine

@pytest.fixture(scope="module")
def wild():
    return contract.wild_model(seed=2)


def _round(wild, strategy: str, overrides: list[str], G: int = 6, n_prompts: int = 2,
           temperature: float = 1.0):
    model, tok = wild
    cfg = load_config(None, [f"generate.strategy={strategy}", f"generate.group_size={G}",
                             *overrides])
    engine = BuiltinEngine(model, seed=0, max_batch=64, segment=4)
    params = SamplingParams(temperature=temperature, max_new_tokens=10)
    ledger = Ledger()
    rollout = Rollout(engine, RunToEnd(), ledger, params)
    problems = [Problem(f"p{i}", p, "0", prompt_ids=p)
                for i, p in enumerate(contract.PROMPTS[:n_prompts])]
    gen = {"latr": LatrGenerator, "echo": EchoGenerator}[strategy](cfg, tok)
    gen.generate(rollout, problems, step=0)
    rollout.run()
    return rollout.groups, ledger, engine, model


def _check_lineage_and_logprobs(groups, model, G: int):
    """Every group has G finished samples; a child repeats its parent's tokens before its
    branch point and its chosen token sits there; every behaviour log-probability is the
    untempered model's (T = 1 and greedy both use it) by a full forward pass."""
    for g in groups:
        assert len(g.samples) == G and all(s.finished for s in g.samples)
        by_uid = {s.uid: s for s in g.samples}
        for s in g.samples:
            s.check()
            assert s.chosen == sorted(set(s.chosen))
            if s.parent_uid is not None:
                b = s.branch_point
                assert s.chosen and b in s.chosen and s.root_uid is not None
                parent = by_uid.get(s.parent_uid)
                if parent is not None:
                    assert s.response_ids[:b] == parent.response_ids[:b]
            lp, _ = contract.forward_logprobs(model, s.prompt_ids, s.response_ids,
                                              SamplingParams(temperature=1.0))
            assert (lp - torch.tensor(s.logprobs)).abs().max() < 1e-4


def test_latr_grows_its_tree_with_chosen_tokens_and_exact_logprobs(wild):
    groups, ledger, engine, model = _round(
        wild, "latr", ["generate.latr.tau_abs=0", "generate.latr.tau_rel=1",
                       "generate.latr.ages=[2]", "generate.latr.similarity=0",
                       "generate.latr.force_exit=5"])
    _check_lineage_and_logprobs(groups, model, 6)
    for g in groups:
        tree = [s for s in g.samples if not s.meta.get("tree_fill")]
        assert len(tree) == 6  # eta = 1 at step 0: the whole group from the tree
        assert sum(s.parent_uid is None for s in tree) == 1  # one root
        for s in tree:  # greedy until the tree phase ended at decode step 5, sampled after
            assert s.chosen and max(s.chosen) <= 6
    assert ledger.decisions["generate/fork/latr_branch"] == 10  # 5 per tree
    assert engine.prefix_tokens_saved > 0


def test_latr_pruned_children_leave_their_group_counted_and_are_refilled(wild, monkeypatch):
    """Every child judged too similar at its age r = 2 (the rule itself is tested above): it
    is aborted, leaves its group, its tokens are counted as pruned, and the tree keeps
    branching or fills its group with i.i.d. samples."""
    import rollwise.stages.generate.latr as latr
    compared = []
    monkeypatch.setattr(latr, "latr_too_similar",
                        lambda c, p, th: compared.append((c, p)) or True)
    groups, ledger, _, model = _round(
        wild, "latr", ["generate.latr.tau_abs=0", "generate.latr.tau_rel=1",
                       "generate.latr.ages=[2]", "generate.latr.force_exit=8"])
    pruned = ledger.decisions["generate/prune/latr_similar"]
    assert pruned == len(compared) > 0 and ledger.tokens["pruned/latr_similar"] >= 3 * pruned
    assert all(len(c) == len(p) == 2 and c[0] != p[0] for c, p in compared)
    assert ledger.decisions["generate/fork/latr_branch"] > pruned  # it kept branching
    _check_lineage_and_logprobs(groups, model, 6)  # pruned ones gone, the groups full


def test_latr_eta_mixes_tree_and_iid_samples(wild):
    groups, *_ = _round(wild, "latr", ["generate.latr.tau_abs=0", "generate.latr.tau_rel=1",
                                       "generate.latr.eta={0: 0.5}"])
    for g in groups:
        iid = [s for s in g.samples if not s.chosen]
        assert len(iid) == 3 and all(s.parent_uid is None for s in iid)


def test_echo_branches_on_alternatives_fills_its_groups_and_logs_exactly(wild):
    groups, ledger, engine, model = _round(
        wild, "echo", ["generate.echo.entropy_threshold=1.01", "generate.echo.conf_threshold=100",
                       "generate.echo.delta_threshold=-100", "generate.echo.min_position=0",
                       "generate.echo.prune=false", "generate.echo.roots=1"])
    _check_lineage_and_logprobs(groups, model, 6)
    for g in groups:
        by_uid = {s.uid: s for s in g.samples}
        children = [s for s in g.samples if s.parent_uid]
        assert children
        for c in children:  # on a top-k token other than the one its parent sampled there
            parent = by_uid[c.parent_uid]
            assert c.response_ids[c.branch_point] != parent.response_ids[c.branch_point]
    assert ledger.decisions["generate/fork/echo_branch"] > 0
    assert engine.prefix_tokens_saved > 0


def test_dora_fill_continues_openings_by_direction_quality_on_a_hand_made_tree():
    from rollwise.stages.generate.echo import dora_fill
    from rollwise.types import Sample

    def seq(uid, ids, lp):
        return Sample(prompt_id="p", prompt_ids=[1], response_ids=ids, logprobs=[lp] * len(ids),
                      versions=[3] * len(ids), loss_mask=[1] * len(ids), uid=uid,
                      status=Status.COMPLETED)
    strong = seq("s", [5, 6, 7, 8], -0.1)  # one confident sequence opening (5, 6)
    weak = [seq(f"w{i}", [9, 9, 1 + i, 2], -0.3) for i in range(3)]  # three opening (9, 9)
    short = seq("x", [4, 4], -0.01)  # ends within its opening: no direction
    fill = dora_fill([strong, *weak, short], 6, 2, 0.2)
    a, b = math.exp(-0.1 / 0.2), math.exp(-0.3 / 0.2)
    assert a / (a + b) * 6 == pytest.approx(4.38, abs=0.01)  # DORA: 4 to the strong opening
    assert [c.parent_uid for c in fill] == ["s"] * 4 + ["w0", "w1"]
    parents = {x.uid: x for x in [strong, *weak]}
    for c in fill:
        parent = parents[c.parent_uid]
        assert c.branch_point == 2 and c.response_ids == parent.response_ids[:2]
        assert c.logprobs == parent.logprobs[:2] and c.versions == [3, 3]
        assert c.loss_mask == [1, 1] and c.root_uid == c.parent_uid
        c.check()
    # solution-level allocation would have given the strong opening a / (a + 3 b) of 6 = 2.9
    assert dora_fill([short], 3, 2, 0.2) == []


def test_echo_fills_with_dora_continuations_that_log_exactly(wild):
    groups, *_, model = _round(
        wild, "echo", ["generate.echo.roots=2", "generate.echo.fill=dora",
                       "generate.echo.fill_prefix_tokens=3", "generate.echo.prune=false"])
    continued = 0
    for g in groups:
        by_uid = {s.uid: s for s in g.samples}
        for s in g.samples:
            if s.meta.get("tree_fill") == "dora":
                continued += 1
                assert s.branch_point == 3 and s.parent_uid in by_uid
                assert s.response_ids[:3] == by_uid[s.parent_uid].response_ids[:3]
                lp, _ = contract.forward_logprobs(model, s.prompt_ids, s.response_ids,
                                                  SamplingParams(temperature=1.0))
                assert (lp - torch.tensor(s.logprobs)).abs().max() < 1e-4
        assert len(g.samples) == 6 and all(s.finished for s in g.samples)
    assert continued > 0


def test_echo_pruned_sequences_leave_the_group_and_are_replaced(wild):
    groups, ledger, _, model = _round(wild, "echo", ["generate.echo.min_group_conf=100"])
    assert ledger.decisions["generate/prune/echo_min_conf"] == 4  # 2 roots in each of 2 groups
    for g in groups:
        assert all(s.meta.get("tree_fill") for s in g.samples)
        assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in g.samples)
    _check_lineage_and_logprobs(groups, model, 6)


# ---------------------------------------------------------------------------- training on trees

def _echo_tree_groups(wild):
    groups, _, _, model = _round(
        wild, "echo", ["generate.echo.entropy_threshold=1.01", "generate.echo.conf_threshold=100",
                       "generate.echo.delta_threshold=-100", "generate.echo.min_position=2",
                       "generate.echo.prune=false", "generate.echo.roots=1"])
    for g in groups:
        for j, s in enumerate(g.samples):
            s.reward = float(j % 3 == 0)
            s.versions = [0] * s.num_tokens
    return groups, model


def test_a_tree_trains_as_its_leaves_laid_out_apart_with_the_prefix_run_once(wild):
    """The trainer's update on tree groups (shared response prefixes packed once) has the
    gradients of the same leaves as independent padded samples; the packed rows hold each
    distinct prefix once."""
    from train_helpers import capture_grads, clone

    from rollwise.config import TrainConfig
    from rollwise.training.packing import pack
    from rollwise.training.trainer import Trainer
    from rollwise.types import Batch
    groups, model = _echo_tree_groups(wild)
    samples = [s for g in groups for s in g.samples]
    batch = Batch.from_samples(samples, [0.0] * len(samples), 0)
    packed = pack(batch)
    distinct = {tuple((s.prompt_ids + s.response_ids)[:d]) for s in samples
                for d in range(1, len(s.prompt_ids) + s.num_tokens + 1)}
    real = packed.position_ids > 0  # one block per row (no fill): position 0 only at column 0
    real[:, 0] = True
    assert int(real.sum()) == len(distinct) < int(batch.attention_mask.sum())
    grads = []
    for packing in (False, True):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=1, pack_prompts=packing,
                                                            warmup_steps=0), pad_id=0, seed=1)
        seen = capture_grads(trainer)
        trainer.update(clone(groups))
        assert trainer._pack is packing
        grads.append(torch.cat([g.flatten() for g in seen[0]]))
    assert grads[0].abs().max() > 0
    assert (grads[0] - grads[1]).abs().max() <= 1e-5 * grads[0].abs().max()


def test_chosen_tokens_mask_drops_exactly_the_chosen_tokens_from_the_loss(wild):
    """train.chosen_tokens=mask gives the gradient of the same samples with loss mask 0 on
    their chosen tokens (laid out by hand) under the default 'ratio'."""
    from train_helpers import capture_grads, clone

    from rollwise.config import TrainConfig
    from rollwise.training.trainer import Trainer
    groups, model = _echo_tree_groups(wild)
    assert any(s.chosen for g in groups for s in g.samples)
    by_hand = clone(groups)
    for g in by_hand:
        for s in g.samples:
            for i in s.chosen:
                s.loss_mask[i] = 0
    grads = []
    for mode, gs in (("mask", groups), ("ratio", by_hand)):
        trainer = Trainer(copy.deepcopy(model), TrainConfig(minibatches=1, chosen_tokens=mode,
                                                            warmup_steps=0), pad_id=0, seed=1)
        seen = capture_grads(trainer)
        trainer.update(clone(gs))
        grads.append(torch.cat([g.flatten() for g in seen[0]]))
    assert grads[0].abs().max() > 0 and torch.allclose(grads[0], grads[1], atol=1e-7)


def test_rollouts_tree_view_puts_each_sample_under_its_parent():
    from rollwise.store.browse import tree_line, tree_order

    def row(uid, parent=None, group="g", bp=None, chosen=()):
        return {"uid": uid, "parent_uid": parent, "group_id": group, "branch_point": bp,
                "chosen": list(chosen), "step": 1, "prompt_id": "p", "status": "completed",
                "reward": 1.0, "response_ids": [1, 2], "prompt_text": "1+1=",
                "response_text": "2"}
    rows = [row("a"), row("c", "b", bp=3, chosen=[3]), row("b", "a", bp=1, chosen=[1]),
            row("d", "a", bp=2), row("e", "gone"), row("x", group="h")]
    order = [(r["uid"], d) for r, d in tree_order(rows)]
    assert order == [("a", 0), ("b", 1), ("c", 2), ("d", 1), ("e", 0), ("x", 0)]
    assert "└ @3 chosen 1" in tree_line(rows[1], 2)
