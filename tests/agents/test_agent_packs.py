"""Connect-the-Dots pack plays (rollwise.agents.pack_play, rollwise.tasks.packs) on a scripted
engine: each episode carries its (pack, type, index) key, its own reward and its reward-to-go
computed by hand; solves see the hint their play wrote (or, shuffled, a hint of another pack);
the warm start's transcripts are the texts the plays show."""

import re

import pytest
from agent_helpers import ScriptedEngine

from rollwise.agents.pack_play import CoDGenerator, pack_examples, slope
from rollwise.config import load_config
from rollwise.engine import BuiltinEngine, SamplingParams
from rollwise.models import char_tokenizer
from rollwise.stages.control.inflight import RunToEnd
from rollwise.stages.generate import check_generator
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger
from rollwise.tasks import Problem, load_task
from rollwise.tasks.packs import RULES, PacksTask

PACKS = ["task.name=packs", "task.train_size=20", "task.eval_size=4", "generate.strategy=cod",
         "generate.env=remap", "generate.group_size=2", "generate.max_new_tokens=8",
         "filter.reward=env", "train.advantage=cod"]


def pack(pid, rule, items):
    return Problem(pid, "pack", rule, tier=rule, data={"rule": rule, "items": items})


def model(conversation: str) -> str:
    """Solves by the hint's rule (plus without one); as its next hint, writes 'times' when
    the last task was wrong and keeps its hint when it was right."""
    if conversation.endswith("new:"):
        hint, ok = re.match(r"hint:([a-z]*);.*;(ok|no);", conversation).groups()
        return (hint if ok == "ok" and hint else "times") + "<eos>"
    hint, a, b = re.match(r"hint:([a-z]*);(\d)#(\d)=", conversation).groups()
    return str(RULES.get(hint, RULES["plus"])(int(a), int(b))) + "<eos>"


def play(problems, extra=(), shuffle=None, script=model):
    tok = char_tokenizer()
    cfg = load_config(None, PACKS + list(extra))
    engine = ScriptedEngine(tok, script)
    rollout = Rollout(engine, RunToEnd(), Ledger(),
                      SamplingParams(max_new_tokens=8, stop_ids=(tok.eos_token_id,)))
    CoDGenerator(cfg, tok, shuffle_hints=shuffle).generate(rollout, problems, step=3)
    return rollout.groups, tok


def test_each_episode_has_its_key_reward_and_reward_to_go():
    # times: task 0 is solved by 'plus' only where a+b == a*b (2#2); here it is not
    problems = [pack("p", "times", [[3, 2], [4, 3], [5, 5]])]
    groups, tok = play(problems)
    g, = groups
    assert len(g.samples) == 2 * (3 + 2)  # 2 plays of 3 solves and 2 hints
    texts = [(tok.decode(s.prompt_ids), tok.decode(s.response_ids, skip_special_tokens=True))
             for s in g.samples]
    # round 0: both plays solve task 0 without a hint (wrong), then write 'times'
    assert texts[:2] == [("hint:;3#2=", "5")] * 2
    assert texts[2:4] == [("hint:;3#2=5;no;3#2=6;new:", "times")] * 2
    assert texts[4:6] == [("hint:times;4#3=", "12")] * 2
    assert texts[6:8] == [("hint:times;4#3=12;ok;4#3=12;new:", "times")] * 2
    assert texts[8:10] == [("hint:times;5#5=", "25")] * 2
    by_key = {}
    for s in g.samples:
        by_key.setdefault(tuple(s.meta["cod_key"]), []).append(s)
    assert sorted(by_key) == [("p", "hint", 0), ("p", "hint", 1), ("p", "solve", 0),
                              ("p", "solve", 1), ("p", "solve", 2)]
    tasks = [0.0, 1.0, 1.0]
    for i in range(3):  # a solve: the mean of the task rewards from it on
        for s in by_key[("p", "solve", i)]:
            assert s.meta["env_reward"] == tasks[i]
            assert s.meta["cod_return"] == pytest.approx(sum(tasks[i:]) / (3 - i))
    for j in range(2):  # a hint: the mean of its own reward (0: 5 letters) and later tasks
        for s in by_key[("p", "hint", j)]:
            assert s.meta["env_reward"] == 0.0
            assert s.meta["cod_return"] == pytest.approx(sum(tasks[j + 1:]) / (3 - j))


def test_an_empty_hint_is_penalised_and_packs_of_other_sizes_play_on():
    def silent(conversation):
        return "<eos>" if conversation.endswith("new:") else model(conversation)
    problems = [pack("short", "plus", [[3, 2], [4, 1]]), pack("long", "minus", [[3, 2]] * 3)]
    groups, _ = play(problems, script=silent)
    short, long_ = groups
    assert len(short.samples) == 2 * 3 and len(long_.samples) == 2 * 5
    hints = [s for s in long_.samples if s.meta["cod_kind"] == "hint"]
    assert all(s.meta["env_reward"] == -0.1 for s in hints)
    # plus without a hint is wrong for minus (3-2=1, not 5): returns are all task rewards 0
    first = next(s for s in hints if s.meta["cod_key"][2] == 0)
    assert first.meta["cod_return"] == pytest.approx(-0.1 / 3)


def deducer(conversation: str) -> str:
    """Writes as its hint the rule the true equation fits."""
    if conversation.endswith("new:"):
        a, b, c = map(int, re.search(r";(\d)#(\d)=(\d+);new:$", conversation).groups())
        return next(r for r in sorted(RULES) if RULES[r](a, b) == c) + "<eos>"
    return model(conversation)


def test_shuffled_hints_come_from_a_play_of_another_pack():
    import random
    problems = [pack("a", "times", [[3, 2], [4, 3]]), pack("b", "minus", [[3, 2], [5, 3]])]
    for shuffle, seen in ((None, {"a": "times", "b": "minus"}),
                          (random.Random(0), {"a": "minus", "b": "times"})):
        groups, tok = play(problems, shuffle=shuffle, script=deducer)
        for g in groups:
            second = [s for s in g.samples if s.meta["cod_key"][1:] == ["solve", 1]]
            assert len(second) == 2 and {s.meta["hint"] for s in second} == {seen[g.problem.id]}
            assert all(tok.decode(s.prompt_ids).startswith(f"hint:{seen[g.problem.id]};")
                       for s in second)


def test_the_teacher_transcripts_are_the_plays_texts():
    cfg = load_config(None, PACKS + ["sft.noise=0.0"])
    task, tok = load_task(cfg.task), char_tokenizer()
    examples = pack_examples(cfg, task, tok, noise=0.0, seed=0)
    assert len(examples) == len(task.train) * 7  # 4 solves and 3 hints per pack
    p = task.train[0]
    texts = [(tok.decode(ids[:n]), tok.decode(ids[n:])) for ids, n in examples[:7]]
    a0, b0 = p.data["items"][0]
    assert texts[0][0] == f"hint:;{a0}#{b0}=" and texts[0][1].endswith("<eos>")
    truth = RULES[p.data["rule"]]
    for k in range(1, 4):  # after a clean update the hint fits every earlier equation
        hint = texts[2 * k][0].split(";")[0][len("hint:"):]
        assert all(RULES[hint](a, b) == truth(a, b) for a, b in p.data["items"][:k])
        a, b = p.data["items"][k]
        assert texts[2 * k] == (f"hint:{hint};{a}#{b}=", f"{truth(a, b)}<eos>")
    lazy = pack_examples(cfg, task, tok, noise=1.0, seed=0)
    hints = [tok.decode(ids[n:]) for ids, n in lazy if tok.decode(ids[:n]).endswith("new:")]
    assert hints and set(hints) == {"<eos>"}


def test_packs_are_drawn_with_a_rule_and_checked():
    task = PacksTask(load_config(None, PACKS).task)
    assert all(len(p.data["items"]) == 4 for p in task.train)
    assert all(len(p.data["items"]) == 8 for p in task.eval)
    assert {p.data["rule"] for p in task.train} == set(RULES)
    assert all(a >= b for p in task.train for a, b in p.data["items"])
    tok = char_tokenizer()
    carried = load_config(None, PACKS + ["control.inflight=april"])  # refused before any work
    with pytest.raises(ValueError, match="control.inflight=none"):
        check_generator(CoDGenerator(carried, tok), task, carried)
    with pytest.raises(ValueError, match="generate.env"):
        CoDGenerator(load_config(None, [p for p in PACKS if "env" not in p]), tok)


def test_the_cli_refuses_a_carrying_controller_for_packs_with_exit_2(tmp_path, capsys):
    from rollwise.cli import main
    assert main(["train", f"run.root={tmp_path}", *PACKS, "control.inflight=april"]) == 2
    err = capsys.readouterr().err
    assert "set control.inflight=none" in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())  # refused before the run directory or a warm start


def test_slope_is_least_squares():
    import numpy as np
    pts = [(0, 0.0), (1, 1.0), (1, 0.0), (2, 1.0), (3, 1.0), (3, 1.0)]
    xs, ys = zip(*pts)
    assert slope(pts) == pytest.approx(np.polyfit(xs, ys, 1)[0])
    assert slope([(1, 0.0), (1, 1.0)]) == 0.0


def test_packs_need_the_cod_strategy(tmp_path):
    from rollwise.loop.run import train
    with pytest.raises(ValueError, match="generate.strategy=cod"):
        train(load_config(None, ["task.name=packs", f"run.root={tmp_path}"]))


@pytest.mark.integration
@pytest.mark.parametrize("name", ["packs", "calc"])
def test_the_built_in_agent_configs_train_in_the_loop(tmp_path, name):
    """configs/packs.yaml and configs/calc.yaml through the loop on a small model: warm start
    on the teacher's transcripts, episodes, their evaluation, training with CoD returns."""
    from loop_helpers import SMALL

    from rollwise.loop.run import train
    from rollwise.store.rollouts import RolloutStore
    small = [o for o in SMALL if not o.startswith(("filter.reward", "train.steps",
                                                   "task.eval_size"))]
    summary = train(load_config(f"configs/{name}.yaml", small + [
        f"run.root={tmp_path}", "run.name=agents", "train.steps=2", "task.eval_size=6",
        "control.prompts_per_step=3", "run.eval_samples=1", "run.eval_temperature=0"]))
    rows = RolloutStore(tmp_path / "agents" / "rollouts").read().to_pylist()
    assert rows and summary["eval_pass1_end"] >= 0
    if name == "packs":  # (a 20-step warm start fails every calc episode: nothing to train)
        assert summary["tokens_trained"] > 0
        import json
        metas = [json.loads(r["meta"]) for r in rows]
        assert all("cod_key" in m and "cod_return" in m for m in metas)
        last = json.loads((tmp_path / "agents" / "metrics.jsonl").read_text().splitlines()[-1])
        assert "eval/position_slope" in last and "eval/shuffled_slope" in last


def test_a_controller_that_pauses_an_episode_is_refused(tiny):
    import copy

    from rollwise.stages.control.inflight import Decision

    class PauseAll(RunToEnd):
        def on_event(self, event, sample, rollout):
            return Decision("pause", "test", everyone=True)
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    cfg = load_config(None, PACKS)
    rollout = Rollout(BuiltinEngine(model, segment=2), PauseAll(), Ledger(),
                      SamplingParams(max_new_tokens=8, stop_ids=(tok.eos_token_id,)))
    with pytest.raises(RuntimeError, match="without in-flight control"):
        CoDGenerator(cfg, tok).generate(rollout, [pack("p", "plus", [[3, 2], [4, 1]])], 1)
