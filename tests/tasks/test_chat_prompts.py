"""Chat templates and conversational datasets, with a chat model built locally
(tests/chat_model.py): prompt ids, stop tokens, answers, and short runs on a conversational
JSONL and on a reasoning-gym task."""

import dataclasses
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from chat_model import LLAMA3, build_chat_model, chat_tokenizer, favour_token

import rollwise
from rollwise import models
from rollwise.cli import main
from rollwise.config import ConfigError, FilterConfig, TaskConfig, load_config
from rollwise.loop.run import train
from rollwise.stages.filter import eval_scorer
from rollwise.tasks import Problem, load_task
from rollwise.tasks.files import FileTask
from rollwise.tasks.prompts import Prompter, end_of_turn_id

TEMPLATE = "{prompt} Put the final answer in \\boxed{}."
SYSTEM = "You are a helpful assistant."
ROWS = [{"prompt": [{"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": f"What is {a} + {b}?"}],
         "answer": str(a + b)} for a in range(1, 9) for b in range(1, 5)]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def tok(chat_dir):
    return models.load_tokenizer(chat_dir)


def template_ids(tok, messages):
    out = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_prompt_ids_are_the_chat_templates_with_system_prompt_and_template(tok):
    cfg = TaskConfig(system_prompt=SYSTEM, prompt_template=TEMPLATE)
    prompter = Prompter(cfg, tok)
    assert prompter.chat
    text = Problem("a", "What is 2 + 3?", "5")
    assert prompter.ids(text) == template_ids(tok, [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 2 + 3? Put the final answer in \\boxed{}."}])
    # a conversational row keeps its own system message; the template wraps the last user turn
    conv = Problem("b", ROWS[0]["prompt"], "2")
    assert prompter.ids(conv) == template_ids(tok, [
        ROWS[0]["prompt"][0],
        {"role": "user", "content": "What is 1 + 1? Put the final answer in \\boxed{}."}])
    assert conv.prompt_ids is prompter.ids(conv)  # made once, then reused
    assert prompter.text(conv) == tok.apply_chat_template(
        prompter.messages(conv.prompt), add_generation_prompt=True, tokenize=False)
    # a copy asked another way under the same id (a seeded prompt) has its own text
    other = dataclasses.replace(conv, prompt=[{"role": "user", "content": "1+1?"},
                                              {"role": "assistant", "content": "2"},
                                              *ROWS[0]["prompt"][1:]], prompt_ids=None)
    assert prompter.text(other) == tok.apply_chat_template(
        prompter.messages(other.prompt), add_generation_prompt=True, tokenize=False)
    assert prompter.text(other) != prompter.text(conv)


def test_plain_prompts_without_a_template_and_for_builtin_tiers(tok):
    char = models.char_tokenizer()
    plain = Prompter(TaskConfig(system_prompt="be exact", prompt_template="q {prompt}"), char)
    assert not plain.chat
    assert plain.ids(Problem("p", "1+2=", "3")) == char("be exact\nq 1+2=")["input_ids"]
    builtin = Prompter.for_task(TaskConfig(), tok, load_task(TaskConfig(train_size=10,
                                                                         eval_size=4)))
    assert not builtin.chat  # the arith tiers keep their plain prompts under 'auto'


@pytest.mark.parametrize("template,specials,eos,bos,end", [
    (None, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|endoftext|>", None, "<|im_end|>"),
    (LLAMA3, ("<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>",
              "<|end_header_id|>", "<|eot_id|>"), "<|end_of_text|>", "<|begin_of_text|>",
     "<|eot_id|>")])
def test_stop_tokens_are_eos_and_the_templates_end_of_turn(template, specials, eos, bos, end):
    kw = {"template": template} if template else {}
    tok = chat_tokenizer(specials=specials, eos=eos, bos=bos, **kw)
    stops = Prompter(TaskConfig(), tok).stop_ids
    assert set(stops) == {tok.convert_tokens_to_ids(eos), tok.convert_tokens_to_ids(end)}
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids(end)
    assert Prompter(TaskConfig(chat_template="off"), tok).stop_ids == (tok.eos_token_id,)


def test_answers_from_chat_models_are_extracted_and_scored_by_math_verify(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    task = FileTask(TaskConfig(name="file", path=str(path)))
    problem = Problem("x", "q", "0.5")
    score = eval_scorer(FilterConfig(reward="math"), task)
    assert score("so x = \\boxed{\\frac{1}{2}}", problem)[0] == 1.0
    assert score("so x = \\boxed{\\frac{1}{3}}", problem)[0] == 0.0
    assert task.extract_answer("think <answer> 7 </answer> done") == "7"
    assert task.extract_answer("we get 3, so the answer is 12.") == "12"
    assert task.extract_answer("first\nlast line") == "last line"
    last = FileTask(TaskConfig(name="file", path=str(path), answer_format="last_number"))
    assert last.extract_answer("3 apples and 4 pears") == "4"


def test_bad_conversational_rows_are_skipped_with_their_line(tmp_path, caplog):
    rows = [ROWS[0], {"prompt": [{"role": "robot", "content": "hi"}], "answer": "1"},
            {"prompt": [{"role": "user", "content": ["a", "list"]}], "answer": "1"},
            {"prompt": [], "answer": "1"}, *ROWS[1:10]]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = FileTask(TaskConfig(name="file", path=str(path)))
    assert task.skipped == 3
    assert any(":2:" in e and "unknown role 'robot'" in e for e in task.errors)
    assert any(":3:" in e and "list content" in e for e in task.errors)
    assert any(":4:" in e and "non-empty list" in e for e in task.errors)
    assert len(task.train) + len(task.eval) == 10


def test_verl_parquet_with_nested_answer(tmp_path):
    import pyarrow as pa
    rows = [{"prompt": r["prompt"], "reward_model": {"ground_truth": r["answer"]}} for r in ROWS]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    task = FileTask(TaskConfig(name="file", path=str(path),
                               answer_field="reward_model.ground_truth"))
    def key(prompt, answer):
        return json.dumps(prompt), answer
    assert sorted(key(p.prompt, p.answer) for p in task.train + task.eval) == sorted(
        key(r["prompt"], r["answer"]) for r in ROWS)


def test_chat_template_on_without_one_fails_before_any_work(tmp_path):
    cfg = load_config(None, [f"run.root={tmp_path}", "task.chat_template=on"])
    with pytest.raises(ValueError, match="no chat template.*chat_template = off"):
        train(cfg)
    assert not (tmp_path / "default").exists() and not (tmp_path / ".cache").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cuda_on_a_machine_without_one_fails_before_any_work(tmp_path, capsys):
    """A config error (exit 2, one line naming the fix), not a traceback."""
    with pytest.raises(ConfigError, match="run.device = cuda.*sees no CUDA device.*"
                                          "run.device=cpu"):
        train(load_config(None, [f"run.root={tmp_path}", "run.device=cuda"]))
    assert main(["train", f"run.root={tmp_path}", "run.device=cuda"]) == 2
    assert "run.device = cuda" in capsys.readouterr().err
    assert not (tmp_path / "default").exists() and not (tmp_path / ".cache").exists()


def short_run(tmp_path, name, **overrides):
    common = {"run": {"root": str(tmp_path), "name": name, "log": "quiet", "report": False,
                      "tensorboard": False, "eval_every": 3},
              "train": {"steps": 3}, "control": {"prompts_per_step": 4},
              "generate": {"group_size": 4, "max_new_tokens": 24},
              "filter": {"workers": 0}}
    return common | overrides


def stored(run_dir: Path) -> list[dict]:
    return pq.read_table(run_dir / "rollouts").to_pylist()


def test_three_step_run_on_a_conversational_dataset(tmp_path, chat_dir, tok):
    model = favour_token(models.load_model(chat_dir)[0], tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = short_run(tmp_path, "conv", task={"prompt_template": TEMPLATE})
    summary = rollwise.train(cfg, model=model, tokenizer=tok, dataset=ROWS, reward="math")
    assert summary["steps"] == 3
    rows = stored(Path(summary["run_dir"]))
    assert len(rows) == 3 * 4 * 4
    prompter = Prompter(TaskConfig(prompt_template=TEMPLATE), tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    by_text = {prompter.text(Problem(str(i), r["prompt"], r["answer"])): r
               for i, r in enumerate(ROWS)}
    ended = 0
    for r in rows:
        conv = by_text[r["prompt_text"]]["prompt"]  # stored: the rendered conversation
        assert r["prompt_ids"] == template_ids(tok, prompter.messages(conv))
        ids = r["response_ids"]
        assert im_end not in ids[:-1]  # a response never runs past the end-of-turn token
        if r["status"] == "completed":
            ended += ids[-1] == im_end
            reply = tok.decode(ids[:-1])
            if "\ufffd" not in reply:  # the template renders only whole characters
                full = tok.apply_chat_template(
                    [*prompter.messages(conv), {"role": "assistant", "content": reply}],
                    tokenize=False)
                assert full.rstrip("\n") == tok.decode(r["prompt_ids"] + ids)
    assert ended > len(rows) // 2  # the end-of-turn token, not eos, ended most responses


def test_short_run_on_a_reasoning_gym_task_with_the_chat_template(tmp_path, chat_dir, tok):
    cfg = load_config(None, [f"{k}={v}" for k, v in {
        "run.root": tmp_path, "run.log": "quiet", "run.report": False, "train.steps": 2,
        "run.tensorboard": False, "model.path": chat_dir, "task.name": "gym:basic_arithmetic",
        "task.train_size": 40, "task.eval_size": 8, "task.system_prompt": "'" + SYSTEM + "'",
        "control.prompts_per_step": 3, "generate.group_size": 2,
        "generate.max_new_tokens": 8, "filter.workers": 0, "filter.reward": "gym"}.items()])
    summary = train(cfg)
    task = load_task(cfg.task)
    rows = stored(Path(summary["run_dir"]))
    questions = {p.prompt: p for p in task.train}
    prompter = Prompter(cfg.task, tok)
    for r in rows:
        q = next(q for q in questions if q in r["prompt_text"])
        assert r["prompt_ids"] == template_ids(tok, [{"role": "system", "content": SYSTEM},
                                                     {"role": "user", "content": q}])
        assert r["prompt_text"] == prompter.text(questions[q])


def test_characters_the_tokenizer_does_not_know_are_named_when_the_run_starts(tmp_path, tiny,
                                                                               capsys):
    model, tok = tiny  # the character model: no 'W', no 'é'
    rows = [{"prompt": f"What is {i}+{i}? é", "answer": str(2 * i)} for i in range(12)]
    cfg = short_run(tmp_path, "unk", train={"steps": 1})
    cfg["run"] |= {"log": "plain"}
    rollwise.train(cfg, model=model, tokenizer=tok, dataset=rows, reward="exact")
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "does not know" in line]
    assert said == ["the task's prompts and solutions hold 24 character(s) the tokenizer does "
                    "not know (2 distinct: 'Wé'); the model sees its unknown token '<unk>' in "
                    "their place"]
    prompter = Prompter.plain(tok)
    assert prompter.unknown_characters([Problem("a", "2+2=", "4", solution="4")]) == (0, [])
