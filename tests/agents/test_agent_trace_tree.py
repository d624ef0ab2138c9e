"""TRACE's per-turn credit from the whole tree (train.advantage=trace_tree): node values on a
hand-computed tree, the invariants that define them on random trees, equality with the
per-sample estimator where nothing was continued, and the trainer's placement of each turn's
advantage on that turn's tokens."""

import random

import pytest
import torch
from agent_helpers import calls_then_copies, run

from rollwise.training.advantages import AdvantageInputs, compute_advantages, trace
from rollwise.training.trainer import turn_credit
from rollwise.training.tree_credit import TreeRecord, tree_advantages
from rollwise.types import Batch


def test_values_and_baselines_on_a_hand_computed_tree():
    # prompt P: roots A (cuts A@1 at token 5, A@2 at 9) and B (cut B@1 at 4), a continuation
    # C of the prompt; continuations c1, c2 of A@1; nothing continued from A@2 or B@1
    records = [TreeRecord("P", 0.0, [(5, "A@1"), (9, "A@2")]),  # A
               TreeRecord("P", 1.0, [(4, "B@1")]),  # B
               TreeRecord("P", 0.0),  # C
               TreeRecord("A@1", 1.0), TreeRecord("A@1", 0.0)]  # c1, c2
    # V(A@2) = 0 (A alone); V(A@1) = mean(V(A@2), 1, 0) = 1/3; V(B@1) = 1;
    # V(P) = mean(V(A@1), V(B@1), 0) = 4/9. A@2 and B@1 have one branch: their baselines are
    # their parents'
    a, b, c, c1, c2 = tree_advantages(records)
    assert [t for t, _ in a] == [0, 5, 9] and [t for t, _ in b] == [0, 4]
    assert [x for _, x in a] == pytest.approx([1 / 3 - 4 / 9, 0 - 1 / 3, 0 - 1 / 3])
    assert [x for _, x in b] == pytest.approx([1 - 4 / 9, 1 - 4 / 9])
    assert c == [(0, pytest.approx(-4 / 9))]
    assert c1 == [(0, pytest.approx(2 / 3))] and c2 == [(0, pytest.approx(-1 / 3))]


def random_tree(rng: random.Random) -> list[TreeRecord]:
    """One prompt, 2-3 roots of 1-3 cuts, continuations on some prompts and cuts."""
    records = []
    for r in range(rng.randint(2, 3)):
        cuts = [(4 * d, f"r{r}@{d}") for d in range(1, rng.randint(1, 3) + 1)]
        records.append(TreeRecord("P", float(rng.random() < 0.5), cuts))
        for _, key in cuts:
            records += [TreeRecord(key, float(rng.random() < 0.5))
                        for _ in range(rng.choice([0, 0, 2, 3]))]
    records += [TreeRecord("P", float(rng.random() < 0.5)) for _ in range(rng.randint(0, 2))]
    return records


def naive_value(records: list[TreeRecord], node: str) -> float:
    """A node's value, recursing over the records themselves: the mean over the branches
    leaving it of the leaf's reward or the next cut's value."""
    vs = []
    for r in records:
        path = [r.anchor] + [k for _, k in r.cuts]
        if node in path:
            i = path.index(node)
            vs += [r.reward if i == len(path) - 1 else naive_value(records, path[i + 1])]
    return sum(vs) / len(vs)


@pytest.mark.parametrize("seed", range(20))
def test_each_branching_nodes_sibling_credit_sums_to_zero(seed):
    records = random_tree(random.Random(seed))
    segs = tree_advantages(records)
    at: dict[str, list[float]] = {}  # node -> the advantage of each branch leaving it
    for r, s in zip(records, segs):
        path = [r.anchor] + [k for _, k in r.cuts]
        for node, (_, a) in zip(path, s):
            at.setdefault(node, []).append(a)
    for node, credit in at.items():
        if len(credit) > 1:  # its own baseline: the credit of its branches is centred
            assert sum(credit) == pytest.approx(0.0, abs=1e-9), node
    for r, s in zip(records, segs):  # a leaf of a branching node: its reward less the node's
        if not r.cuts and len(at[r.anchor]) > 1:
            assert s == [(0, pytest.approx(r.reward - naive_value(records, r.anchor)))]
    for r, s in zip(records, segs):  # a root's credit telescopes when every node branches
        path = [r.anchor] + [k for _, k in r.cuts]
        if r.cuts and all(len(at[n]) > 1 for n in path):
            assert sum(a for _, a in s) == pytest.approx(r.reward - naive_value(records, "P"))


def test_with_nothing_continued_every_turn_gets_the_per_sample_advantage():
    """allocation=root: no cut is continued, so each root's turns all carry trace's r - mean."""
    rollout, _, _ = run(["generate.trace.allocation=root"], script=sometimes_wrong())
    samples = [s for g in rollout.groups for s in g.samples]
    assert any(s.meta.get("trace_cuts") for s in samples)
    x = AdvantageInputs(rewards=torch.tensor([s.meta["env_reward"] for s in samples]),
                        group_index=torch.zeros(len(samples), dtype=torch.long),
                        meta=[s.meta for s in samples])
    tree = compute_advantages("trace_tree", x)
    assert tree.advantages.abs().sum() > 0
    assert tree.advantages.tolist() == pytest.approx(trace(x).advantages.tolist())
    for i, segs in tree.segments.items():
        assert [a for _, a in segs] == pytest.approx([float(tree.advantages[i])] * len(segs))


def sometimes_wrong():
    """Calls the calculator, then copies its result wrong every third copy: mixed rewards."""
    copies = [0]

    def script(conversation):
        if "tool:" in conversation:
            copies[0] += 1
            if copies[0] % 3 == 0:
                return "9<eos>"
        return calls_then_copies(conversation)
    return script


def test_a_roots_turns_get_their_own_credit_on_their_own_tokens():
    """TRACE continues the cut after the call: the root's call and its copy are credited apart,
    and the trainer puts each value on that turn's response tokens."""
    rollout, _, _ = run(["generate.trace.budget=episodes"], script=sometimes_wrong(),
                        predictor=[10.0, 0.0, 0.0, 0.0, 0.0])
    samples = [s for g in rollout.groups for s in g.samples]
    rewards = torch.tensor([s.meta["env_reward"] for s in samples])
    x = AdvantageInputs(rewards=rewards, group_index=torch.zeros(len(samples), dtype=torch.long),
                        meta=[s.meta for s in samples])
    out = compute_advantages("trace_tree", x, clip=0.25)
    batch = Batch.from_samples(samples, out.advantages.tolist(), 0)
    credit = turn_credit(batch, out.segments)
    segmented = [i for i, s in enumerate(samples) if s.meta.get("trace_cuts")]
    assert segmented and set(out.segments) == set(segmented)
    # the call and the copy are credited apart somewhere: a copy's siblings decide it
    assert any(len({a for _, a in out.segments[i]}) > 1 for i in segmented)
    for i in segmented:
        s, segs = samples[i], out.segments[i]
        assert [t for t, _ in segs] == [0] + [o for o, _ in s.meta["trace_cuts"]]
        assert all(abs(a) <= 0.25 for _, a in segs)  # the clip caps every turn
        first = len(s.prompt_ids) - 1
        for (start, a), end in zip(segs, [t for t, _ in segs[1:]] + [len(s.response_ids)]):
            assert credit[i, first + start:first + end].tolist() == \
                pytest.approx([a] * (end - start))
    for i in set(range(len(samples))) - set(segmented):
        assert (credit[i] == out.advantages[i]).all()


def test_trace_tree_names_what_it_needs():
    x = AdvantageInputs(rewards=torch.tensor([1.0, 0.0]),
                        group_index=torch.zeros(2, dtype=torch.long), meta=[{}, {}])
    with pytest.raises(ValueError, match="trace_anchor"):
        compute_advantages("trace_tree", x)


def test_the_trainer_trains_a_turn_whose_sample_ends_level(tiny):
    """A root whose last turn is level with its siblings (advantage 0) still has credit on its
    first turn: the trainer's advantages are per turn, and its update moves that row too."""
    import copy

    from train_helpers import make_groups

    from rollwise.config import TrainConfig
    from rollwise.training.trainer import Trainer
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    groups = make_groups(model, tok, n_prompts=1, group_size=4, max_new_tokens=6, seed=3)
    samples = groups[0].samples
    cut = min(s.num_tokens for s in samples) // 2 or 1
    metas = [{"trace_anchor": "P@0", "trace_cuts": [[cut, "r0@1"]]},  # root, wins
             {"trace_anchor": "r0@1"}, {"trace_anchor": "r0@1"},  # its cut's continuations
             {"trace_anchor": "P@0"}]  # a root that loses
    for s, m, r in zip(samples, metas, (1.0, 1.0, 1.0, 0.0)):
        s.meta.update(m)
        s.reward = r
    # V(r0@1) = 1, V(P@0) = mean(1, 0) = 1/2: the root's turns get 1/2 then 0
    trainer = Trainer(model, TrainConfig(advantage="trace_tree", minibatches=1),
                      pad_id=tok.pad_token_id)  # one minibatch: its first pass is every row
    prep, _ = trainer.prepare(copy.deepcopy(groups))
    first = len(samples[0].prompt_ids) - 1
    n = samples[0].num_tokens
    assert prep.token_adv[0, first:first + cut].tolist() == pytest.approx([0.5] * cut)
    assert prep.token_adv[0, first + cut:first + n].tolist() == pytest.approx([0.0] * (n - cut))
    assert prep.batch.advantages.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.5])
    before = [p.detach().clone() for p in model.parameters()]
    assert trainer.update(groups)["train/tokens"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
