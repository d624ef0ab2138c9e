import json
import random
import re

import pytest

from rollwise.config import ConfigError, TaskConfig
from rollwise.tasks import load_task
from rollwise.tasks.arith import noisy_answer


def test_arith_answers_are_correct_and_eval_is_held_out():
    task = load_task(TaskConfig(train_size=3000, eval_size=200))
    for p in task.train[:500] + task.eval:
        assert int(p.answer) == eval(p.prompt.strip().rstrip("="))  # the prompt is arithmetic
        assert task.extract_answer(p.solution) == p.answer  # solutions are reversed answers
    assert not {p.prompt for p in task.train} & {p.prompt for p in task.eval}
    tiers = {p.tier for p in task.eval}
    assert tiers == {"add2", "sub2", "add3", "chain"}
    assert len({len(p.prompt) for p in task.train}) == 1  # right-aligned to a fixed width


def test_arith_is_deterministic_by_seed():
    a, b = (load_task(TaskConfig(train_size=100, eval_size=40)) for _ in range(2))
    c = load_task(TaskConfig(train_size=100, eval_size=40, seed=7))
    assert [p.prompt for p in a.train] == [p.prompt for p in b.train]
    assert [p.prompt for p in a.train] != [p.prompt for p in c.train]


def test_noisy_answer_moves_only_the_top_digit_by_one():
    rng = random.Random(0)
    for value in [5, 10, 99, 123, -47, 905]:
        for _ in range(20):
            noisy = noisy_answer(value, rng)
            s, n = str(abs(value)), noisy.lstrip("-")
            assert len(n) == len(s) and n[1:] == s[1:] and abs(int(n[0]) - int(s[0])) == 1
            assert noisy.startswith("-") == (value < 0)


def test_unknown_tier_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tier.*choose from"):
        load_task(TaskConfig(tiers={"add9": 1.0}))


def test_file_task_reports_malformed_rows_with_line_numbers(tmp_path, caplog):
    path = tmp_path / "data.jsonl"
    rows = [json.dumps({"prompt": f"q{i}", "answer": i}) for i in range(20)]
    rows[3] = "{not json"
    rows[7] = json.dumps({"prompt": "no answer here"})
    rows[11] = json.dumps([1, 2])
    path.write_text("\n".join(rows) + "\n")
    task = load_task(TaskConfig(name="file", path=str(path), eval_size=4))
    assert task.skipped == 3
    joined = "\n".join(task.errors)
    assert f"{path}:4: not valid JSON" in joined
    assert f"{path}:8: missing field(s) ['answer']" in joined
    assert f"{path}:12: not a JSON object" in joined
    assert len(task.train) + len(task.eval) == 17 and len(task.eval) == 3
    assert "skipped row" in caplog.text


def test_file_task_custom_columns_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": f"{i}+1=", "a": str(i + 1)} for i in range(10)]),
                   path)
    task = load_task(TaskConfig(name="file", path=str(path), prompt_field="q",
                                answer_field="a", eval_size=2))
    assert len(task.eval) == 2 and task.skipped == 0
    assert sorted(p.answer for p in task.train + task.eval) == sorted(str(i + 1) for i in range(10))
    with pytest.raises(ValueError, match="no usable rows"):
        load_task(TaskConfig(name="file", path=str(path), eval_size=2, prompt_field="x"))


def test_reasoning_gym_adapter_scores_with_the_dataset():
    task = load_task(TaskConfig(name="gym:basic_arithmetic", train_size=4, eval_size=2))
    p = task.train[0]
    assert task.score_fn(p.answer, p) == 1.0 and task.score_fn("nonsense", p) == 0.0


def _operands(prompt: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", prompt)]


def test_gym_settings_reach_the_generator():
    """chain_sum's digit and term settings shape every problem, train and held-out alike."""
    def task(**settings):
        return load_task(TaskConfig(name="gym:chain_sum", gym={"chain_sum": settings},
                                    train_size=300, eval_size=50))
    small, large = task(min_digits=1, max_digits=1), task(min_digits=3, max_digits=3)
    for p in small.train + small.eval:
        assert all(n < 10 for n in _operands(p.prompt)) and p.tier == "chain_sum"
    for p in large.train + large.eval:
        assert all(100 <= n < 1000 for n in _operands(p.prompt))
    four = task(min_terms=4, max_terms=4)
    assert all(len(_operands(p.prompt)) == 4 for p in four.train)
    for p in small.eval[:20]:  # the answers are the sums the prompts ask for
        expr = p.prompt.split(":", 1)[1].rstrip("= ")
        assert int(p.answer) == eval(expr)


def test_gym_held_out_prompts_are_distinct_and_never_trained():
    task = load_task(TaskConfig(name="gym:chain_sum", train_size=2000, eval_size=200,
                                gym={"chain_sum": {"max_digits": 1, "max_terms": 3}}))
    held = [p.prompt for p in task.eval]
    assert len(set(held)) == 200 and not set(held) & {p.prompt for p in task.train}
    with pytest.raises(ConfigError, match="too few distinct problems"):  # 10 x 10 x 2 signs
        load_task(TaskConfig(name="gym:chain_sum", eval_size=300, train_size=10,
                             gym={"chain_sum": {"max_digits": 1, "max_terms": 2}}))


def test_a_gym_mix_draws_in_its_weights():
    """n draws of a 3 : 1 mix hold 3/4 chain_sum within 4 binomial standard deviations, and
    pass@1 is reported per dataset (each problem's tier)."""
    n = 3000
    task = load_task(TaskConfig(name="gym", train_size=n, eval_size=40,
                                gym={"chain_sum": {"weight": 3}, "products": {}}))
    share = sum(p.tier == "chain_sum" for p in task.train) / n
    assert abs(share - 0.75) < 4 * (0.75 * 0.25 / n) ** 0.5
    assert {p.tier for p in task.train} == {"chain_sum", "products"}
    swapped = load_task(TaskConfig(name="gym", train_size=n, eval_size=40,
                                   gym={"chain_sum": {}, "products": {"weight": 3}}))
    share = sum(p.tier == "products" for p in swapped.train) / n
    assert abs(share - 0.75) < 4 * (0.75 * 0.25 / n) ** 0.5
    for p in task.train[:50]:  # each problem keeps its own dataset's answer
        if p.tier == "products":
            a, b = _operands(p.prompt)[:2]
            assert int(p.answer) == a * b


@pytest.mark.parametrize("name, gym, expected", [
    ("gym:chain_sum", {"chain_sum": {"max_termz": 3}}, "Did you mean 'max_terms'"),
    ("gym:chain_sun", {}, "no dataset 'chain_sun'. Did you mean chain_sum"),
    ("gym:chain_sum", {"chain_sum": {"min_terms": 4, "max_terms": 2}}, "max_terms must be"),
    ("gym", {"products": {"weight": 0}}, "products.weight = 0: give a number > 0"),
    ("gym", {}, "task.gym, which is empty"),
    ("gym:chain_sum", {"products": {}}, "also has products: set task.name=gym"),
])
def test_a_wrong_gym_setting_is_a_clear_config_error(name, gym, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_task(TaskConfig(name=name, gym=gym))


def test_gym_settings_on_another_task_are_refused():
    with pytest.raises(ValueError, match="task.gym sets reasoning-gym datasets"):
        TaskConfig(name="arith", gym={"chain_sum": {}})


def test_a_wrong_gym_setting_stops_the_cli_before_any_work(tmp_path, capsys):
    from rollwise.cli import main
    code = main(["train", f"run.root={tmp_path}", "task.name=gym:chain_sum",
                 "task.gym.chain_sum.max_digitz=2"])
    assert code == 2 and "max_digitz: not a setting" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # no run directory, no warm start


def test_math_verify_is_refused_where_a_gym_reference_is_not_a_plain_number():
    """countdown's reference is an expression: math-verify scores restating the target as
    right, where reasoning-gym's own scorer does not; so the pair is refused, naming gym."""
    from rollwise.gym_settings import Spec, check_reward, specs
    from rollwise.stages.filter import make_scorer
    task = load_task(TaskConfig(name="gym:countdown", train_size=4, eval_size=2))
    p = task.train[0]
    target = p.data["metadata"]["target"]
    assert make_scorer("math", task)(f"\\boxed{{{target}}}", p)[0] == 1.0  # why it is refused
    assert make_scorer("gym", task)(f"\\boxed{{{target}}}", p)[0] < 1.0
    countdown = specs("gym:countdown", {})
    for reward in ("math", {"math": 1.0, "format": 0.1}, "math_verify"):
        with pytest.raises(ConfigError, match="filter.reward=gym") as e:
            check_reward(countdown, reward)
        assert "countdown (e.g. '" in str(e.value)
    check_reward(countdown, "gym")
    check_reward(specs("gym", {"chain_sum": {}, "products": {}}), "math")  # plain numbers
    numbers = ["12", "-4", "0.5", "1e3", "3/4", " 7 "]
    check_reward([Spec("d", 1.0, {}, tuple(numbers))], "math")
    for form in ("x + 1", "$\\dfrac{1}{2}$", "[1, 2]", "3*4"):
        with pytest.raises(ConfigError):
            check_reward([Spec("d", 1.0, {}, ("1", form))], "math")


def test_filler_tail_mixes_a_long_thinking_mode_into_the_worked_solutions():
    """filler_tail of the solutions think with ',' (geometric, mean filler_tail_mean), the
    rest with '.'; the answer extractor skips both; no tail leaves the old solutions as they
    were (the same random draws)."""
    base = dict(tiers={"add2": 1.0}, train_size=50, eval_size=10, filler_mean=2.0)
    plain = load_task(TaskConfig(**base))
    tailed = load_task(TaskConfig(**base, filler_tail=0.1, filler_tail_mean=30.0))
    off = load_task(TaskConfig(**base, filler_tail=0.0, filler_tail_mean=30.0))
    p = plain.train[0]
    draws = [tailed.worked_solution(p, random.Random(i), noisy=False) for i in range(4000)]
    long = [d for d in draws if d.startswith(",")]
    assert 0.08 < len(long) / len(draws) < 0.12  # P(first ',') = 0.1 * 30/31
    lengths = [len(d) - len(d.lstrip(",")) for d in long]
    assert 26 < sum(lengths) / len(lengths) < 35  # mean 31 given at least one ','
    assert all(tailed.extract_answer(d) == p.answer for d in draws)
    assert all(plain.worked_solution(p, random.Random(i), noisy=False)
               == off.worked_solution(p, random.Random(i), noisy=False) for i in range(200))


def test_filler_tail_without_a_mean_is_a_clear_error():
    with pytest.raises(ValueError, match="filler_tail_mean"):
        TaskConfig(filler_tail=0.1)


def _sft_answers(noise):
    """(tier, response written, clean solution) for each worked solution at this sft.noise."""
    from rollwise.models import char_tokenizer
    from rollwise.tasks import solution_examples
    task = load_task(TaskConfig(tiers={"add2": 0.5, "sub2": 0.5}, train_size=400))
    tok = char_tokenizer()
    out = []
    for p, (ids, plen) in zip(task.train, solution_examples(task, tok, noise, seed=0)):
        out.append((p.tier, tok.decode(ids[plen:-1]), p.solution))
    return out


def test_sft_noise_per_tier_leaves_the_other_tiers_clean():
    rows = _sft_answers({"sub2": 0.6})
    wrong = {t: sum(a != b for tt, a, b in rows if tt == t) / sum(tt == t for tt, _, _ in rows)
             for t in ("add2", "sub2")}
    assert wrong["add2"] == 0.0
    assert 0.5 < wrong["sub2"] < 0.7
    # one share for every tier draws exactly as the same share named for each tier
    assert _sft_answers(0.6) == _sft_answers({"add2": 0.6, "sub2": 0.6})


def test_sft_noise_naming_an_absent_tier_is_a_clear_error():
    with pytest.raises(ValueError, match="sft.noise names tier"):
        _sft_answers({"sub3": 0.6})
    from rollwise.config import ConfigError, load_config
    cfg = load_config(None, ["sft.noise={sub2: 0.6, add2: 0}"])
    assert cfg.sft.noise == {"sub2": 0.6, "add2": 0.0}
    with pytest.raises(ConfigError, match="noise"):
        load_config(None, ["sft.noise={sub2: 1.5}"])


def _check_steps(text: str) -> list[bool]:
    """Each step 'x+y+c=zz;' checked by its own arithmetic, and each carry c against the
    previous step's written sum."""
    ok, carry = [], 0
    for step in text.split(":")[0].rstrip(";").split(";"):
        lhs, rhs = step.split("=")
        x, y, c = (int(v) for v in lhs.split("+"))
        ok.append(x + y + c == int(rhs) and c == carry)
        carry = int(rhs) // 10
    return ok


@pytest.mark.parametrize("tier,digits", [("add2s", 2), ("add3s", 3), ("add4s", 4), ("add5s", 5)])
def test_stepped_tiers_write_one_checked_column_per_step(tier, digits):
    task = load_task(TaskConfig(tiers={tier: 1.0}, train_size=200, eval_size=50))
    rng = random.Random(0)
    for p in task.train + task.eval:
        a, b = (int(v) for v in p.prompt.strip().rstrip("=").split("+"))
        assert len(str(a)) == len(str(b)) == digits and int(p.answer) == a + b
        text = task.worked_solution(p, rng, noisy=False)
        assert all(_check_steps(text)) and len(_check_steps(text)) == digits
        assert task.extract_answer(text) == p.answer
        assert 20 <= len(text) <= 100  # long enough to branch on
        # the noisy teacher forgets every carry: each step adds 0, the answer follows the
        # steps, and it is wrong exactly when the sum has a carry
        dropped = task.worked_solution(p, rng, noisy=True)
        steps = dropped.split(":")[0].rstrip(";").split(";")
        assert all(s.split("=")[0].endswith("+0") for s in steps)
        assert dropped.split(":")[1] == "".join(str(int(s.split("=")[1]) % 10) for s in steps)
        has_carry = any(int(x) + int(y) >= 10 for x, y in zip(str(a)[::-1], str(b)[::-1])) \
            or len(str(a + b)) > digits
        assert (task.extract_answer(dropped) != p.answer) == has_carry


def test_stepped_answer_is_read_after_the_marker_only():
    task = load_task(TaskConfig(tiers={"add3s": 1.0}, train_size=10, eval_size=5))
    assert task.extract_answer("7+6+0=13;4+8+1=13;") is None  # no answer yet
    assert task.extract_answer("7+6+0=13;4+8+1=13;3+5+1=09;:") is None
    assert task.extract_answer("7+6+0=13;4+8+1=13;3+5+1=09;:339") == "933"
    assert task.extract_answer("12") == "21"  # the unstepped tiers' format still reads


def test_wrong_facts_teacher_slips_exactly_on_its_digit_pairs():
    from rollwise.tasks.arith import wrong_facts
    cfg = TaskConfig(tiers={"add4s": 1.0}, train_size=300, eval_size=20,
                     stepped_teacher="wrong_facts", wrong_facts=30)
    task, wrong = load_task(cfg), wrong_facts(30, cfg.seed)
    assert len(wrong) == 30 and set(wrong.values()) <= {-1, 1}
    rng, slipped_any = random.Random(0), 0
    for p in task.train:
        a, b = (int(v) for v in p.prompt.strip().rstrip("=").split("+"))
        text = task.worked_solution(p, rng, noisy=True)
        carry, used = 0, False
        for step in text.split(":")[0].rstrip(";").split(";"):
            lhs, rhs = step.split("=")
            x, y, c = (int(v) for v in lhs.split("+"))
            assert c == carry  # carries follow the written (slipped) sums
            assert int(rhs) == x + y + c + wrong.get((x, y), 0)
            used |= (x, y) in wrong
            carry = int(rhs) // 10
        # a slip of +-1 at column i moves the sum by +-10^i: never back to the right answer
        assert (task.extract_answer(text) != p.answer) == used
        slipped_any += used
    assert 0 < slipped_any < len(task.train)


def test_a_sorted_files_held_out_rows_are_drawn_from_all_of_it(tmp_path):
    """Held-out rows are a seeded random draw, not the file's tail: from rows sorted by their
    answer, the held-out answers spread over the whole range; the same seed gives the same
    split, another seed another one, and train keeps the file's order."""
    path = tmp_path / "sorted.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+0=", "answer": i}) + "\n"
                            for i in range(1000)))
    split = [load_task(TaskConfig(name="file", path=str(path), eval_size=100, seed=s))
             for s in (1234, 1234, 7)]
    held = [sorted(int(p.answer) for p in t.eval) for t in split]
    assert len(held[0]) == 100 and held[0] == held[1] and held[0] != held[2]
    assert min(held[0]) < 100 and max(held[0]) >= 900  # not the last 100 rows
    train = [int(p.answer) for p in split[0].train]
    assert train == sorted(train) and not set(train) & set(held[0])
