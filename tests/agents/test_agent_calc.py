"""The multi-turn calculator task (rollwise.tasks.calc), its warm start on the teacher's
transcripts (rollwise.agents.transcripts) and held-out evaluation of episodes
(rollwise.agents.episode): a transcript is token for token the episode the episode generator
builds from the same turns; the environment's tokens are not trained; evaluation counts a split
episode once and reads tool use from the environment."""

import random

import pytest
from agent_helpers import run_episodes

from rollwise.agents.episode import EpisodeGenerator, episode_metrics, evaluate_episodes
from rollwise.agents.transcripts import episode_examples
from rollwise.config import load_config
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.models import build, char_tokenizer
from rollwise.stages.control.inflight import RunToEnd
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger
from rollwise.tasks import Problem, load_task
from rollwise.tasks.prompts import Prompter
from rollwise.training.sft import collate
from rollwise.types import Group, Sample

CALC = ["task.name=calc", "task.train_size=300", "task.eval_size=30",
        "generate.strategy=episode", "generate.env=tools", "generate.tools=[calculator]",
        "generate.tool_format=plain", "generate.max_new_tokens=24", "generate.max_turns=3",
        "generate.group_size=1", "filter.reward=env"]


def test_the_task_draws_its_own_tiers_and_keeps_eval_out_of_train():
    task = load_task(load_config(None, CALC).task)
    assert {p.tier for p in task.train} == {"small", "mul2", "mul3"}
    assert not {p.prompt for p in task.eval} & {p.prompt for p in task.train}
    for p in task.train + task.eval:
        a, op, b = p.data["terms"]
        assert p.prompt == f"{a}{op}{b}=" and int(p.answer) == (a + b if op == "+" else a * b)
    chains = load_task(load_config(None, CALC + ["task.tiers={chain: 1}"]).task)
    for p in chains.train:
        a, _, b, _, c = p.data["terms"]
        assert p.prompt == f"{a}*{b}*{c}=" and int(p.answer) == a * b * c
    for p in load_task(load_config(None, CALC + ["task.tiers={chain3: 1}"]).task).train:
        a, _, b, _, c, _, d = p.data["terms"]
        assert p.prompt == f"{a}*{b}*{c}*{d}=" and int(p.answer) == a * b * c * d
    only = load_task(load_config(None, CALC + ["task.tiers={mul3: 1}"]).task)
    assert {p.tier for p in only.train} == {"mul3"}
    with pytest.raises(ValueError, match="unknown calc tier"):
        load_task(load_config(None, CALC + ["task.tiers={add2: 1}"]).task)


def test_a_transcript_is_the_episode_the_generator_builds_from_the_same_turns():
    """The SFT example of every tier equals, id for id and mask for mask, the episode the
    episode generator makes when the engine writes the teacher's turns."""
    cfg = load_config(None, CALC + [
        "task.tiers={small: 1, mul2: 1, mul3: 1, chain: 1, chain3: 1}", "model.max_positions=128",
        "generate.max_turns=4"])
    task, tok = load_task(cfg.task), char_tokenizer()
    examples = episode_examples(cfg, task, tok, noise=0.0, seed=0)
    seen = set()
    for p, (ids, plen, mask) in zip(task.train, examples):
        if p.tier in seen:
            continue
        seen.add(p.tier)
        actions = iter(task.worked_actions(p, random.Random(0), noisy=False))
        p.prompt_ids = tok.encode(p.prompt, add_special_tokens=False)
        params = SamplingParams(max_new_tokens=24, stop_ids=(tok.eos_token_id,))
        group, _, _ = run_episodes(tok, cfg, p, params, lambda _: next(actions) + "<eos>")
        s = group.samples[0]
        assert ids == s.prompt_ids + s.response_ids and plen == len(s.prompt_ids)
        assert mask == s.loss_mask and s.meta["env_reward"] == 1.0
    assert seen == {"small", "mul2", "mul3", "chain", "chain3"}
    product = next(ex for p, ex in zip(task.train, examples) if p.tier == "mul3")
    _, _, labels = collate([product], tok.pad_token_id)
    trained = tok.decode([t for t in labels[0].tolist() if t != -100])
    a, b = product[0][:product[1]], product[0][product[1]:]
    text = tok.decode(b)
    assert trained.startswith("calculator(" + tok.decode(a).rstrip("=") + ")")
    assert ";tool:" in text and ";tool:" not in trained  # the observation is not trained


def test_the_noisy_teacher_answers_products_without_the_calculator():
    cfg = load_config(None, CALC + ["task.train_size=2000"])
    task, tok = load_task(cfg.task), char_tokenizer()
    noise = {"small": 0.0, "mul2": 0.5, "mul3": 0.5}
    examples = episode_examples(cfg, task, tok, noise=noise, seed=0)
    called = {"small": [], "mul2": [], "mul3": []}
    for p, (ids, plen, _) in zip(task.train, examples):
        text = tok.decode(ids[plen:], skip_special_tokens=True)
        called[p.tier].append(text.startswith("calculator("))
        if not text.startswith("calculator("):  # a direct answer: right only when clean
            assert (text == p.answer) == (p.tier == "small")
    assert not any(called["small"])
    for tier in ("mul2", "mul3"):
        assert 0.4 < sum(called[tier]) / len(called[tier]) < 0.6


def test_the_noisy_teacher_stops_a_chain_after_its_first_call():
    """A chain's decision sits after the first call: the teacher always makes it, then makes
    the second only when clean, and otherwise answers a near miss of the product."""
    cfg = load_config(None, CALC + ["task.tiers={chain: 1}", "task.train_size=1000"])
    task, rng = load_task(cfg.task), random.Random(0)
    for p in task.train:
        a, _, b, _, c = p.data["terms"]
        first = f"calculator({a}*{b})"
        assert task.worked_actions(p, rng, noisy=False) == [
            first, f"calculator({a * b}*{c})", p.answer]
        noisy = task.worked_actions(p, rng, noisy=True)
        assert noisy[0] == first and len(noisy) == 2 and noisy[1] != p.answer
        assert len(noisy[1]) == len(p.answer)  # a near miss: one digit moved
    tok = char_tokenizer()
    examples = episode_examples(cfg, task, tok, noise={"chain": 0.6}, seed=0)
    second = [tok.decode(ids[plen:], skip_special_tokens=True).count("calculator(") == 2
              for ids, plen, _ in examples]
    assert all(tok.decode(ids[plen:]).startswith("calculator(") for ids, plen, _ in examples)
    assert 0.35 < sum(second) / len(second) < 0.45


def test_the_noisy_teacher_stops_a_three_hop_chain_after_one_or_two_calls():
    """Each call takes the last one's result; a noisy solution makes the first call, stops
    after the first or the second about equally often, and answers a near miss."""
    cfg = load_config(None, CALC + ["task.tiers={chain3: 1}", "task.train_size=2000"])
    task, rng = load_task(cfg.task), random.Random(0)
    stops = []
    for p in task.train:
        a, _, b, _, c, _, d = p.data["terms"]
        calls = [f"calculator({a}*{b})", f"calculator({a * b}*{c})",
                 f"calculator({a * b * c}*{d})"]
        assert task.worked_actions(p, rng, noisy=False) == calls + [p.answer]
        noisy = task.worked_actions(p, rng, noisy=True)
        stops.append(len(noisy) - 1)
        assert noisy[:-1] == calls[:stops[-1]] and noisy[-1] != p.answer
        assert len(noisy[-1]) == len(p.answer)
    assert set(stops) == {1, 2} and 0.45 < stops.count(1) / len(stops) < 0.55


def _episode(tier, reward, calls, split=False, error=False):
    s = Sample(uid=f"{tier}-{reward}-{calls}-{split}", prompt_id=tier, prompt_ids=[1], step=0)
    s.meta.update(env_reward=reward, env_tool_calls=calls)
    if split:
        s.meta["split"] = True
    if error:
        s.meta["env_error"] = "step: RuntimeError"
    return Group(tier, [s], Problem(tier, "x", "1", tier=tier))


def test_episode_metrics_count_each_episode_once_and_read_tool_use():
    groups = [_episode("mul3", 1.0, 1), _episode("mul3", 0.0, 0), _episode("mul3", 1.0, 1, True),
              _episode("small", 1.0, 0), _episode("small", 1.0, 0, error=True)]
    m = episode_metrics(groups)
    assert m["eval/pass1/mul3"] == 0.5 and m["eval/pass1/small"] == 0.5
    assert m["eval/pass1"] == 0.5 and m["eval/tool_use"] == 0.25
    assert m["eval/solved_without_tool/mul3"] == 0.0
    assert m["eval/solved_without_tool/small"] == 0.5


def test_sampled_evaluation_is_reproducible_and_draws_distinct_episodes():
    cfg = load_config(None, CALC)
    task = load_task(cfg.task)
    model, tok = build(cfg.model, seed=0)
    engine = BuiltinEngine(model, copy_model=False)
    prompter = Prompter.for_task(cfg.task, tok, task, model)
    first = evaluate_episodes(engine, prompter, task.eval[:8], cfg, 4, 1.0)
    # the engine's own seed stream moves on between the calls; the evaluation's seeds do not
    engine.generate([Request([5, 6], SamplingParams(temperature=1.0, max_new_tokens=4), 0)])
    second = evaluate_episodes(engine, prompter, task.eval[:8], cfg, 4, 1.0)
    assert first == second
    # each of a problem's episodes has its own seed: an untrained model's draws differ
    gen = EpisodeGenerator(cfg.model_copy(update={"generate": cfg.generate.model_copy(
        update={"group_size": 4})}), tok, seed=7)
    rollout = Rollout(engine, RunToEnd(), Ledger(),
                      SamplingParams(temperature=1.0, max_new_tokens=24,
                                     stop_ids=prompter.stop_ids))
    gen.generate(rollout, prompter.render(task.eval[:2]), step=0)
    for g in rollout.groups:
        assert len({tuple(s.response_ids) for s in g.samples}) > 1
    with pytest.raises(ValueError, match="temperature"):
        evaluate_episodes(engine, prompter, task.eval[:2], cfg, 2, 0.0)


def test_the_task_needs_episodes(tmp_path):
    from rollwise.loop.run import train
    with pytest.raises(ValueError, match="generate.strategy=episode"):
        train(load_config(None, ["task.name=calc", f"run.root={tmp_path}"]))
