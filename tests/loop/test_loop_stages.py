"""The GFCR step with its Control options: dynamic sampling refills to a full batch, APRIL
carries partial groups, and every decision is counted with its reason."""

import json

import pytest
from loop_helpers import SHORT_RUN as SMALL

from rollwise.config import load_config
from rollwise.loop.run import train
from rollwise.report.data import load_run
from rollwise.store.rollouts import RolloutStore


def run(tmp_path, name, *extra):
    cfg = load_config(None, SMALL + [f"run.root={tmp_path}", f"run.name={name}",
                                     "filter.reward=tests.loop_helpers:coin_reward",
                                     "run.report=false", *extra])
    summary = train(cfg)
    lines = [json.loads(x) for x in open(tmp_path / name / "metrics.jsonl")][1:]
    return summary, lines, RolloutStore(tmp_path / name / "rollouts").samples()


@pytest.mark.integration
def test_dynamic_sampling_trains_on_a_full_batch_of_mixed_groups(tmp_path):
    _, lines, samples = run(tmp_path, "ds", "control.dynamic_sampling=true",
                            "control.max_rounds=10")
    for m in lines:
        assert m["groups/trained"] == 6  # control.prompts_per_step in SMALL
        dropped = sum(v for k, v in m.items() if k.startswith("decisions/filter/drop/"))
        assert m["groups/scored"] == m["groups/trained"] + dropped
        assert m["decisions/control/select/uniform"] == m["groups/scored"]
    assert len(samples) == sum(m["samples/total"] for m in lines)
    assert all(m["tokens/decoded"] == m["tokens/generated"] for m in lines)


@pytest.mark.integration
def test_dynamic_sampling_full_refill_generates_whole_batches_then_stops(tmp_path):
    """refill=full (verl's DAPO): every round generates prompts_per_step groups; after
    max_rounds the step trains on the mixed groups it has."""
    _, lines, samples = run(tmp_path, "dsf", "control.dynamic_sampling=true",
                            "control.refill=full", "control.max_rounds=2")
    assert len(samples) == sum(m["samples/total"] for m in lines)
    for m in lines:
        assert m["groups/scored"] in (6, 12)
        assert m["decisions/control/select/uniform"] == m["groups/scored"]
        assert m["groups/trained"] <= 6
        dropped = sum(v for k, v in m.items() if k.startswith("decisions/filter/drop/"))
        assert m["groups/scored"] == m["groups/trained"] + dropped
        if m["groups/trained"] < 6:  # short batch: both rounds were spent
            assert m["groups/scored"] == 12
        if m["groups/scored"] == 6:  # one round filled the batch, nothing extra dropped
            assert m["groups/trained"] == 6
    assert any(m["groups/scored"] == 12 for m in lines)


def test_refill_without_dynamic_sampling_is_a_config_error():
    from rollwise.config import ConfigError
    with pytest.raises(ConfigError, match="control.dynamic_sampling"):
        load_config(None, ["control.refill=full"])


@pytest.mark.integration
def test_april_in_the_loop_stores_every_sample_once_and_counts_carried_tokens(tmp_path):
    summary, lines, samples = run(tmp_path, "april", "control.inflight=april",
                                  "generate.max_new_tokens=12")
    uids = [s.uid for s in samples]
    assert len(uids) == len(set(uids))
    assert all(s.finished for s in samples)
    carried_before = 0
    for m in lines:
        assert m["groups/scored"] == 6
        # tokens decoded this step = those of the groups scored now, less what they brought
        # in from earlier steps, plus what stays in flight
        carried = m["tokens/paused_carried"]
        assert m["tokens/decoded"] == m["tokens/generated"] + carried - carried_before
        carried_before = carried
    assert any(m["tokens/decoded"] != m["tokens/generated"] for m in lines)
    # the report gives every scored token one fate; the carried ones are a level beside them
    report = load_run(tmp_path / "april")
    cats = report.token_categories()
    assert "unaccounted" not in cats and not any("paused" in c for c in cats)
    for i, m in enumerate(lines):
        assert sum(v[i] for v in cats.values()) == m["tokens/generated"]
    assert report.held_over() == [m["tokens/paused_carried"] for m in lines]
    # stale tokens exist once carried samples finish under newer weights
    assert any(v < s.step - 1 for s in samples for v in s.versions) or \
        all(m["tokens/paused_carried"] == 0 for m in lines)


@pytest.mark.integration
def test_april_with_shared_prefixes_prefills_what_running_answers_share_once(tmp_path):
    """engine.share_prefix: a request copies the K/V of the ids it shares with a running one
    (the system prompt across prompts; a carried group's prompt across its resumed answers).
    The run samples the same answers, stores each once, and prefills less."""
    april = ["control.inflight=april", "generate.max_new_tokens=64", "engine.segment=4",
             "task.system_prompt=Think step by step and answer.", "train.steps=3"]
    _, plain, plain_samples = run(tmp_path, "plain", *april)
    _, lines, samples = run(tmp_path, "shared", *april, "engine.share_prefix=true")
    assert any(len(set(s.versions)) > 1 for s in samples)  # answers resumed under new weights
    assert len({s.uid for s in samples}) == len(samples) and all(s.finished for s in samples)
    assert [s.response_ids for s in samples] == [s.response_ids for s in plain_samples]
    for m, p in zip(lines, plain):
        assert m["tokens/decoded"] == p["tokens/decoded"]
        assert m["tokens/prefilled"] + m["tokens/prefix_saved"] == p["tokens/prefilled"]
        assert m["tokens/prefilled"] < p["tokens/prefilled"]


@pytest.mark.integration
def test_april_keeping_carried_kv_prefills_no_carried_answer_and_loses_nothing(tmp_path):
    """loop.carried_kv=keep: carried answers stay paused in the engine with their K/V across
    the update and sync, and go on from it: a step prefills only its new groups' prompts.
    Every sample is stored once, and the trainer reports the tokens continued across a sync
    by tokens since it, beside responses of one version."""
    april = ["control.inflight=april", "generate.max_new_tokens=48", "engine.segment=4",
             "train.steps=4", "run.eval_every=4"]
    _, plain, _ = run(tmp_path, "recompute", *april)
    _, lines, samples = run(tmp_path, "keep", *april, "loop.carried_kv=keep")
    assert len({s.uid for s in samples}) == len(samples) and all(s.finished for s in samples)
    assert any(len(set(s.versions)) > 1 for s in samples)  # continued across a sync
    for m in lines:  # a group's first token is sampled by the weights of the step it began
        begun = {s.group_id: len(s.prompt_ids) for s in samples
                 if s.versions[0] == m["policy/version"] - 1}
        assert m["tokens/prefilled"] >= sum(begun.values())  # (more: a kept one evicted)
    assert lines[-1]["engine/kept_resumed_tokens"] > 0
    assert sum(m["tokens/prefilled"] for m in lines) < sum(m["tokens/prefilled"] for m in plain)
    assert any(k.startswith("train/correction/kl_since_sync_") for m in lines for k in m)
    assert all("train/correction/tokens_age_0" in m for m in lines)


@pytest.mark.integration
def test_a_killed_run_keeping_carried_kv_resumes_losing_nothing(tmp_path):
    """The kept K/V dies with the process; the carry is in the checkpoint as data, so the
    resumed run submits those answers again (prefilled under the weights of the moment):
    each step once, each rollout stored once, none lost."""
    import signal

    from loop_helpers import SMALL as CRASH_RUN
    from loop_helpers import check_resumed, fork_main
    run_dir = tmp_path / "kept"
    argv = ["train", *CRASH_RUN, "control.inflight=april", "loop.carried_kv=keep",
            "generate.max_new_tokens=32", f"run.root={tmp_path}", "run.name=kept"]
    assert fork_main(argv, "train:3") == -signal.SIGKILL
    assert fork_main(["train", "--resume", str(run_dir)]) == 0
    check_resumed(run_dir, steps=6, eta=6)


def test_keeping_kv_on_an_engine_that_cannot_is_refused_before_any_step(tmp_path):
    from rollwise.config import ConfigError
    with pytest.raises(ConfigError, match="cannot keep a paused sequence's K/V"):
        run(tmp_path, "nokeep", "control.inflight=april", "loop.carried_kv=keep",
            "engine.backend=tests.loop_helpers:no_keep_engine")
    assert not (tmp_path / "nokeep" / "metrics.jsonl").exists()


def test_a_step_counts_the_prompt_tokens_it_prefilled_once_per_group(tmp_path):
    """A group's members share their prompt's prefill (one pass admits them together), so a
    plain step prefills each of its prompts once: what APRIL's resumed answers add shows."""
    _, lines, samples = run(tmp_path, "plain", "train.steps=2")
    assert len(lines) == 2
    for m in lines:
        prompts = {s.group_id: len(s.prompt_ids) for s in samples if s.step == m["step"]}
        assert len(prompts) == 6
        assert m["tokens/prefilled"] == sum(prompts.values())
    # prompt tokens are no fate of a generated token: the report's categories still add up
    cats = load_run(tmp_path / "plain").token_categories()
    assert "prefilled" not in cats and "unaccounted" not in cats
    for i, m in enumerate(lines):
        assert sum(v[i] for v in cats.values()) == m["tokens/generated"]


def test_a_plugin_engine_that_counts_no_prefill_runs_the_same_steps_without_the_metric(
        tmp_path):
    """An engine from a dotted path that lacks `prefill_tokens` gets the contract's default
    (None: not counted): the step reports no prefilled tokens instead of failing, and the run
    is the built-in engine's sample for sample."""
    _, plain, plain_samples = run(tmp_path, "builtin", "train.steps=2")
    _, lines, samples = run(tmp_path, "plugin", "train.steps=2",
                            "engine.backend=tests.loop_helpers:uncounted_engine")
    assert all("tokens/prefilled" in m for m in plain)
    assert not any("tokens/prefilled" in m for m in lines)
    assert [m["tokens/decoded"] for m in lines] == [m["tokens/decoded"] for m in plain]
    assert [s.response_ids for s in samples] == [s.response_ids for s in plain_samples]


def test_a_judge_without_a_model_grades_with_the_policy_engine(tmp_path):
    """filter.judge.model unset: the loop lends the judge its own engine (the policy judging
    itself), so the run scores every sample instead of failing on 'the judge has no model'."""
    _, lines, samples = run(tmp_path, "judge", "filter.reward=judge",
                            "filter.judge.max_new_tokens=4", "train.steps=1")
    assert len(samples) == 6 * 4
    # every sample went through the judge's generate call: the tiny arithmetic policy gives
    # no verdict word, so each one fails as bad_verdict (not as a missing judge model)
    failed = {k: v for k, v in lines[0].items() if k.startswith("filter/failed/")}
    assert failed == {"filter/failed/bad_verdict": 24.0}


def test_unknown_selector_is_a_config_error(tmp_path):
    from rollwise.config import ConfigError
    with pytest.raises(ConfigError, match="control.selector"):
        load_config(None, ["control.selector=best"])


@pytest.mark.integration
@pytest.mark.parametrize("strategy, rules", [
    ("latr", ["generate.latr.tau_abs=0", "generate.latr.tau_rel=1", "generate.latr.ages=[2]"]),
    ("echo", ["generate.echo.entropy_threshold=0.01", "generate.echo.entropy_floor=0",
              "generate.echo.conf_threshold=100", "generate.echo.delta_threshold=-100",
              "generate.echo.min_position=0", "generate.echo.roots=1"]),
])
def test_trees_compose_with_april_and_a_selector(tmp_path, strategy, rules):
    """A tree generator under APRIL's in-flight control and Thompson selection: trees fork,
    paused branches are carried into later steps, every sample is stored once and finished,
    every group scored is a full one the selector saw, and a stored child's parent is in
    the store or was pruned (counted)."""
    _, lines, samples = run(tmp_path, strategy, f"generate.strategy={strategy}", *rules,
                            "control.inflight=april", "control.selector=thompson",
                            "generate.max_new_tokens=12", "train.steps=3",
                            "sft.steps=0")  # no warm start: greedy roots run long enough to fork
    uids = [s.uid for s in samples]
    assert len(uids) == len(set(uids)) and all(s.finished for s in samples)
    assert sum(m.get(f"decisions/generate/fork/{strategy}_branch", 0) for m in lines) > 0
    assert any(m["tokens/paused_carried"] > 0 for m in lines)
    assert all(m["groups/scored"] == 6 for m in lines)
    # new prompts come through the selector (a step APRIL fills with carried groups takes none)
    assert sum(m.get("decisions/control/select/thompson", 0) for m in lines) >= 6
    by_uid = {s.uid: s for s in samples}
    pruned = sum(v for m in lines for k, v in m.items() if k.startswith("decisions/generate/prune"))
    orphans = [s for s in samples if s.parent_uid and s.parent_uid not in by_uid]
    assert len(orphans) <= pruned
    for s in samples:  # a child repeats its stored parent's tokens up to its branch point
        p = by_uid.get(s.parent_uid)
        if p is not None:
            assert s.response_ids[:s.branch_point] == p.response_ids[:s.branch_point]
            assert s.branch_point in s.chosen
