"""The Filter stage: composite channels, failure handling in the worker pool (raise, hang,
crash, garbage), majority-vote pseudo-labels, format/length shaping, the judge, and the
evaluation scorer that always uses the true answer."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from rollwise.config import FilterConfig, TaskConfig
from rollwise.engine import BuiltinEngine, Completion
from rollwise.evaluate import evaluate
from rollwise.stages.filter import build_filter, eval_scorer, make_scorer
from rollwise.stages.filter.base import Item
from rollwise.stages.filter.fmt import overlong_penalty
from rollwise.stages.filter.judge import JudgeVerifier, parse_verdict
from rollwise.stages.filter.majority import MajorityVerifier
from rollwise.tasks import Problem, load_task
from rollwise.tasks.prompts import Prompter
from rollwise.types import Sample, Status


@pytest.fixture(scope="module")
def task():
    return load_task(TaskConfig(train_size=50, eval_size=16))


def samples_for(problems: list[Problem], texts_per_problem: list[list[str]]):
    samples, probs, texts = [], [], []
    for p, group in zip(problems, texts_per_problem):
        for t in group:
            samples.append(Sample(prompt_id=p.id, prompt_ids=[1], group_id=f"0:{p.id}",
                                  response_ids=[5] * len(t), status=Status.COMPLETED))
            probs.append(p)
            texts.append(t)
    return samples, probs, texts


def test_default_is_exact_with_the_task_extractor(task):
    p = task.eval[0]
    s, probs, texts = samples_for([p], [[p.solution, "1", p.solution + "9"]])
    stage = build_filter(FilterConfig(), task)
    m = stage.score(s, probs, texts)
    assert [x.reward for x in s] == [1.0, 0.0, 0.0]
    assert s[0].rewards == {"exact": 1.0} and s[0].reward_info == f"answer={p.answer!r}"
    assert m["filter/failed"] == 0 and stage.pool is None  # cheap: in-process, no workers


def test_composite_reward_is_the_weighted_sum_of_channels(task):
    p = task.eval[0]
    long = p.solution + "0" * 7  # 9+ tokens: past length_max = 8
    s, probs, texts = samples_for([p], [[p.solution, "x", long]])
    cfg = FilterConfig(reward={"exact": 1.0, "format": 0.25, "length": 0.5},
                       format_pattern=r"\d+", length_max=8, length_buffer=2)
    build_filter(cfg, task).score(s, probs, texts)
    for x in s:  # reference: the sum computed by hand from the channels
        assert set(x.rewards) == {"exact", "format", "length"}
        assert x.reward == pytest.approx(x.rewards["exact"] + 0.25 * x.rewards["format"]
                                         + 0.5 * x.rewards["length"])
    assert s[0].rewards == {"exact": 1.0, "format": 1.0, "length": 0.0}
    assert s[1].rewards["format"] == 0.0  # 'x' is not digits
    assert s[2].rewards["length"] == -1.0


def test_overlong_penalty_matches_its_definition():
    for n in range(0, 12):  # reference: DAPO's piecewise definition written out
        want = 0.0 if n <= 6 else ((6 - n) / 2 if n <= 8 else -1.0)
        assert overlong_penalty(n, 8, 2) == pytest.approx(want)
        assert overlong_penalty(n, 8, 0) == (0.0 if n <= 8 else -1.0)  # hard cut-off only


def test_failures_are_counted_by_cause_and_the_run_goes_on(task):
    p = task.eval[0]
    texts = [p.solution, "hang", "die", "raise", "garbage", "nan", "12", p.solution]
    s, probs, texts = samples_for([p], [texts])
    stage = build_filter(FilterConfig(reward="filter_userfns:flaky", workers=2, timeout_s=2.0),
                         task)
    try:
        t0 = time.monotonic()
        m = stage.score(s, probs, texts)
        assert time.monotonic() - t0 < 30
        want_cause = {1: "timeout", 2: "crash", 3: "error", 4: "bad_output", 5: "bad_output"}
        for i, x in enumerate(s):
            if i in want_cause:
                assert x.status == Status.FAILED and x.reward == 0.0, (i, x.reward_info)
                assert want_cause[i] in x.reward_info
            else:
                assert x.status == Status.COMPLETED
        assert [s[i].reward for i in (0, 6, 7)] == [1.0, 0.0, 1.0]
        assert "boom" in s[3].reward_info and "not a number" in s[4].reward_info
        assert {k: v for k, v in m.items() if k.startswith("filter/failed/")} == {
            "filter/failed/timeout": 1, "filter/failed/crash": 1, "filter/failed/error": 1,
            "filter/failed/bad_output": 2}
        # the pool recovered: a second batch scores normally on fresh workers
        s2, probs2, texts2 = samples_for([p], [[p.solution, "5"]])
        stage.score(s2, probs2, texts2)
        assert [x.reward for x in s2] == [1.0, 0.0]
    finally:
        stage.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_huge_info_or_reason_is_cut_where_it_is_made(task, workers):
    """A reward's info is kept with every sample: a 10 MB one is cut to MAX_INFO_CHARS (with
    its length said), in a worker before it crosses the pipe, and in this process."""
    from rollwise.stages.filter.base import MAX_INFO_CHARS
    p = task.eval[0]
    s, probs, texts = samples_for([p], [["huge", "huge-raise", p.answer[::-1]]])
    stage = build_filter(FilterConfig(reward="filter_userfns:flaky", workers=workers), task)
    try:
        stage.score(s, probs, texts)
    finally:
        stage.close()
    assert [x.reward for x in s] == [1.0, 0.0, 1.0]
    assert all(len(x.reward_info) <= MAX_INFO_CHARS for x in s)
    assert s[0].reward_info.startswith("iii") and f"{10 << 20} characters, cut" in \
        s[0].reward_info
    assert s[1].status == Status.FAILED and "ValueError: eee" in s[1].reward_info


@pytest.mark.parametrize("workers", [0, 2])
def test_a_verdict_past_the_channel_bounds_fails_its_sample_with_the_reason(task, workers):
    """A reward returning 100,000 channels grew the driver to 11 GB and wrote a 465 MB log for
    one step: past MAX_CHANNELS (or a name past MAX_CHANNEL_NAME_CHARS) the sample fails with
    a reason, in the worker before it crosses the pipe; 21 channels are kept."""
    from rollwise.stages.filter.base import MAX_CHANNEL_NAME_CHARS, MAX_CHANNELS
    p = task.eval[0]
    s, probs, texts = samples_for([p], [["many-channels", "long-name", "some-channels"]])
    stage = build_filter(FilterConfig(reward="filter_userfns:flaky", workers=workers), task)
    try:
        stage.score(s, probs, texts)
    finally:
        stage.close()
    assert [x.status for x in s] == [Status.FAILED, Status.FAILED, Status.COMPLETED]
    assert f"100001 reward channels, more than {MAX_CHANNELS}" in s[0].reward_info
    assert "10000 characters" in s[1].reward_info and \
        f"more than {MAX_CHANNEL_NAME_CHARS}" in s[1].reward_info
    assert all(not x.rewards for x in s[:2])
    assert len(s[2].rewards) == 21 and s[2].reward == 1.0


def test_in_process_mode_isolates_failures_per_sample(task):
    p = task.eval[0]
    s, probs, texts = samples_for([p], [[p.solution, "raise", "garbage"]])
    m = build_filter(FilterConfig(reward="filter_userfns:flaky", workers=0), task).score(
        s, probs, texts)
    assert [x.status for x in s] == [Status.COMPLETED, Status.FAILED, Status.FAILED]
    assert m["filter/failed/error"] == 1 and m["filter/failed/bad_output"] == 1


def test_user_verifier_class_fills_its_channels(task):
    p = task.eval[0]
    s, probs, texts = samples_for([p], [["abc", "abcd"]])
    build_filter(FilterConfig(reward={"filter_userfns:LengthChannels": 0.5}), task).score(
        s, probs, texts)
    assert s[0].rewards == {"chars": 3.0, "even": 0.0} and s[0].reward == 1.5
    assert s[1].rewards == {"chars": 4.0, "even": 1.0} and s[1].reward == 2.0


def test_unknown_verifier_and_bad_import_are_clear_errors(task):
    # the config refuses an unknown name before any work, listing the known ones
    with pytest.raises(ValueError, match="filter.reward = 'exakt': unknown verifier; choose "
                                         "from exact, math"):
        FilterConfig(reward="exakt")
    with pytest.raises(ValueError, match="filter.reward = 'exakt'"):
        FilterConfig(reward={"exact": 1.0, "exakt": 1.0})
    with pytest.raises(ValueError, match="filter.reward = 'exakt': unknown verifier"):
        build_filter(FilterConfig.model_construct(reward="exakt"), task)  # past validation
    with pytest.raises(ValueError, match="filter.reward = 'no_such_mod:fn': cannot import "
                                         "no_such_mod:fn"):  # a plugin path: at config time
        FilterConfig(reward="no_such_mod:fn")
    with pytest.raises(ValueError, match="cannot import 'no_such_mod:fn'"):
        build_filter(FilterConfig.model_construct(reward="no_such_mod:fn"), task)


# --- majority vote ------------------------------------------------------------------------

def naive_majority(answers: list[str | None], min_ratio: float = 0.0) -> tuple[str | None, int]:
    """Reference by brute force: count every distinct answer; the label is the single answer
    with the highest count, if it holds more than min_ratio of all samples (None never votes)."""
    counts = {a: answers.count(a) for a in set(answers) if a is not None}
    n = max(counts.values(), default=0)
    winners = [a for a, k in counts.items() if k == n]
    if len(winners) != 1 or n <= min_ratio * len(answers):
        return None, n
    return winners[0], n


@pytest.mark.parametrize("min_ratio", [0.0, 0.5])
def test_majority_vote_matches_a_naive_count_and_ignores_labels(task, min_ratio):
    import random
    rng = random.Random(0)
    problems = task.eval[:12]
    groups = [[rng.choice(["12", "21", "33", "", "12 ", "."]) for _ in range(8)]
              for _ in problems]
    s, probs, texts = samples_for(problems, groups)
    cfg = FilterConfig(reward="majority", majority_min_ratio=min_ratio)
    m = build_filter(cfg, task).score(s, probs, texts)
    ratios, labels = [], []
    for g, group in enumerate(groups):
        answers = [t.strip().lstrip(".")[::-1] or None for t in group]  # arith's extractor
        label, n = naive_majority(answers, min_ratio)
        ratios.append(n / len(group))
        labels.append(label)
        for j, a in enumerate(answers):
            assert s[g * 8 + j].reward == float(label is not None and a == label)
    assert m["filter/majority_ratio"] == pytest.approx(sum(ratios) / len(ratios))
    assert m["filter/majority_labelled"] == pytest.approx(
        sum(x is not None for x in labels) / len(labels))
    assert None in labels and any(x is not None for x in labels)  # the draw covers both cases
    # labels hidden: scrambled reference answers change nothing but the label diagnostic
    wrong = [Problem(p.id, p.prompt, "999999", p.tier) for p in probs]
    s2 = [Sample(prompt_id=x.prompt_id, prompt_ids=[1], group_id=x.group_id) for x in s]
    m2 = build_filter(cfg, task).score(s2, wrong, texts)
    assert [x.reward for x in s2] == [x.reward for x in s]
    assert m2["filter/majority_label_acc"] == 0.0


def test_majority_ties_normalisation_and_empty_groups():
    def items(answers, group=0):
        return [Item(str(a), Problem("p", "q", "0.5"), a, group=group) for a in answers]
    v = MajorityVerifier()
    out = v.score(items(["1/2", "0.5", "\\frac{1}{2}", "3", "3"]))
    assert [o.rewards["majority"] for o in out] == [1, 1, 1, 0, 0]
    assert v.metrics() == {"filter/majority_ratio": 0.6, "filter/majority_labelled": 1.0,
                           "filter/majority_label_acc": 1.0}
    out = v.score(items(["7", "8", "8", "7", "9"]))  # a tie for the top: no label, no reward
    assert [o.rewards["majority"] for o in out] == [0] * 5
    assert "label=None" in out[0].info
    assert v.metrics() == {"filter/majority_ratio": 0.4, "filter/majority_labelled": 0.0}
    out = v.score(items([None, None]))  # nobody answered: no label, no reward
    assert [o.rewards["majority"] for o in out] == [0, 0]
    assert v.metrics()["filter/majority_ratio"] == 0.0


def test_unanswered_samples_never_vote_but_count_in_the_group_size():
    def items(answers):
        return [Item(str(a), Problem("p", "q", "3"), a) for a in answers]
    # five samples without an answer (None, empty, blank, LaTeX-empty) outnumber the "3"s
    answers = [None, "", "  ", "$$", None, "3", "3", "4"]
    out = MajorityVerifier().score(items(answers))  # plurality: "3" wins, no answer never does
    assert [o.rewards["majority"] for o in out] == [0, 0, 0, 0, 0, 1, 1, 0]
    strict = MajorityVerifier(min_ratio=0.5)  # 2 of 8 is no strict majority: no label
    assert [o.rewards["majority"] for o in strict.score(items(answers))] == [0] * 8
    assert strict.metrics()["filter/majority_labelled"] == 0.0
    # a strict majority: 5 of 8 agree; the other three (one disagrees) get 0
    out = strict.score(items(["3", "3", "4", "3", None, "3", "3", "5"]))
    assert [o.rewards["majority"] for o in out] == [1, 1, 0, 1, 0, 1, 1, 0]
    exactly_half = strict.score(items(["3", "3", "4", "5"]))  # 2 of 4 is not more than half
    assert [o.rewards["majority"] for o in exactly_half] == [0] * 4
    with pytest.raises(ValueError, match="majority_min_ratio = 1.0"):
        MajorityVerifier(min_ratio=1.0)


def test_groups_are_voted_separately():
    a = [Item("x", Problem("p", "q", "1"), x, group=0) for x in ["1", "1", "2"]]
    b = [Item("x", Problem("r", "q", "5"), x, group=1) for x in ["2", "5", "5"]]
    v = MajorityVerifier()
    out = v.score(a + b)
    assert [o.rewards["majority"] for o in out] == [1, 1, 0, 0, 1, 1]
    assert v.metrics()["filter/majority_label_acc"] == 1.0


# --- judge --------------------------------------------------------------------------------

class ScriptedEngine:
    """Engine protocol stand-in: answers each judge prompt with a scripted verdict."""

    def __init__(self, tokenizer, reply):
        self.tok, self.reply, self.prompts = tokenizer, reply, []

    def generate(self, requests):
        out = []
        for r in reversed(requests):  # out of order on purpose: the judge must re-sort
            prompt = self.tok.decode(r.prompt_ids, skip_special_tokens=True)
            self.prompts.append(prompt)
            ids = self.tok(self.reply(prompt))["input_ids"]
            out.append(Completion(r.id, ids, [0.0] * len(ids), [0.0] * len(ids),
                                  [0] * len(ids), "length"))
        return out


@pytest.mark.parametrize("fapo, want", [(False, [1.0, 1.0, 0.0]), (True, [1.0, 0.0, -1.0])])
def test_judge_grades_through_the_engine(tiny, fapo, want):
    _, tok = tiny
    replies = {"11": " correct", "22": " flawed: step 2", "33": "it is incorrect"}
    # the character tokenizer of the tiny model knows only lowercase, so a lowercase rubric
    judge = JudgeVerifier("problem: {prompt}; answer: {answer}; response: {response}; "
                          "{flawed}verdict:", fapo=fapo)
    engine = ScriptedEngine(tok, lambda prompt: next(v for k, v in replies.items()
                                                     if f"response: {k};" in prompt))
    judge.attach(engine, tok)
    problem = Problem("p", "what is 5+6", "11")
    out = judge.score([Item(t, problem, t) for t in ("11", "22", "33")])
    assert [o.rewards["judge"] for o in out] == want
    assert all("what is 5+6" in p and "answer: 11" in p for p in engine.prompts)


def test_judge_with_a_real_engine_fails_unparseable_verdicts(tiny, task):
    model, tok = tiny  # an untrained model says nothing like a verdict
    p = task.eval[0]
    s, probs, texts = samples_for([p], [[p.solution, "1"]])
    stage = build_filter(FilterConfig(reward="judge", judge={"max_new_tokens": 4}), task)
    stage.attach_engine(BuiltinEngine(model), tok)
    m = stage.score(s, probs, texts)
    for x in s:  # either parsed or failed with the judge's words as the reason
        assert (x.status == Status.FAILED and "judge said" in x.reward_info) or \
            x.rewards["judge"] in (0.0, 1.0)
    assert m["filter/failed"] == sum(x.status == Status.FAILED for x in s)


def test_verdict_parsing():
    assert parse_verdict("blah. verdict: wrong") == "wrong"
    assert parse_verdict("the answer is correct. verdict: incorrect") == "wrong"
    assert parse_verdict("Correct!") == "correct"
    assert parse_verdict("no idea") is None


def test_judge_without_a_model_says_how_to_give_it_one(task):
    p = task.eval[0]
    s, probs, texts = samples_for([p], [["1"]])
    build_filter(FilterConfig(reward="judge"), task).score(s, probs, texts)
    assert s[0].status == Status.FAILED and "filter.judge.model" in s[0].reward_info


# --- evaluation scorer --------------------------------------------------------------------

@pytest.mark.parametrize("reward", ["majority", "judge", "format", {"majority": 1, "length": 1}])
def test_evaluation_always_uses_the_true_answer(task, reward):
    p = task.eval[0]
    score = eval_scorer(FilterConfig(reward=reward), task)
    assert score(p.solution, p)[0] == 1.0 and score("1", p)[0] == 0.0
    name = reward if isinstance(reward, str) else "majority"
    assert make_scorer(name, task)(p.solution, p)[0] == 1.0


def test_math_channel_through_the_pool(task):
    problems = [Problem("a", "q", "\\frac{1}{2}"), Problem("b", "q", "[1,2)")]
    s, probs, texts = samples_for(problems, [["so \\boxed{0.5}", "\\boxed{1/3}"],
                                             ["\\boxed{[1, 2)}", "\\boxed{(1,2]}"]])
    stage = build_filter(FilterConfig(reward="math", extract=["boxed"], workers=1), task)
    try:
        m = stage.score(s, probs, texts)
    finally:
        stage.close()
    assert [x.reward for x in s] == [1.0, 0.0, 1.0, 0.0] and m["filter/failed"] == 0
    assert Counter(x.rewards["math"] for x in s) == Counter({1.0: 2, 0.0: 2})


@pytest.mark.integration  # worker processes started three times (about 20 s)
def test_a_reward_that_hangs_on_a_held_out_problem_is_cut_off_by_the_timeout(tiny):
    """Evaluation scores as training does: a user function in a worker process with
    filter.timeout_s, so a hang is a wrong answer, never a hung run."""
    task = load_task(TaskConfig(eval_size=40))
    scorer = eval_scorer(FilterConfig(reward="filter_userfns:flaky", timeout_s=1.0), task)
    try:
        p = task.eval[0]
        with pytest.raises(RuntimeError, match=r"scoring failed \(timeout\)"):
            scorer("hang", p)
        assert scorer(p.answer[::-1], p) == (1.0, "checked")  # a fresh worker goes on

        class Hangs(BuiltinEngine):  # every response is "hang"
            def generate(self, requests):
                out = super().generate(requests)
                for c in out:
                    c.token_ids = tok("hang")["input_ids"]
                return out
        model, tok = tiny
        t0 = time.monotonic()
        m = evaluate(Hangs(model), Prompter.plain(tok), task.eval[:1], scorer, 4)
        assert m["eval/pass1"] == 0.0 and time.monotonic() - t0 < 30
    finally:
        scorer.close()


class Scripted:
    """An engine that answers each prompt with answer(prompt text)."""

    def __init__(self, tok, answer):
        self.tok, self.answer = tok, answer

    def generate(self, requests):
        return [Completion(r.id, self.tok(self.answer(self.tok.decode(r.prompt_ids)))
                           ["input_ids"], [], [], [], "stop") for r in requests]


def script_for(problems, kinds):
    """prompt -> 'hang', 'raise' or the right answer, by the problem's place in `kinds`."""
    by_prompt = {p.prompt: k for p, k in zip(problems, kinds)}
    right = {p.prompt: p.answer[::-1] for p in problems}
    return lambda prompt: right[prompt] if by_prompt[prompt] == "right" else by_prompt[prompt]


def test_evaluation_counts_and_says_its_failures_and_scores_in_parallel(tiny, capsys):
    """A reward raising on some problems and hanging on others: each failure is counted by
    cause (eval/failed), said in a line, and the others score as they should; two workers
    share the hangs."""
    from rollwise.evaluate import scoring_bounded
    task = load_task(TaskConfig(eval_size=12))
    problems = task.eval
    kinds = ["right", "raise", "hang", "right", "raise", "right", "hang", "right", "raise",
             "right", "right", "hang"]
    scorer = eval_scorer(FilterConfig(reward="filter_userfns:flaky", timeout_s=1.0,
                                      workers=2), task)
    tok = tiny[1]
    lines = []
    try:
        m = scoring_bounded(scorer, 120.0, lambda: evaluate(
            Scripted(tok, script_for(problems, kinds)), Prompter.plain(tok), problems, scorer,
            8), lines.append)
        assert len(scorer.stage.pool.workers) == 2
    finally:
        scorer.close()
    assert m["eval/pass1"] == pytest.approx(kinds.count("right") / len(kinds))
    assert (m["eval/failed"], m["eval/failed/error"], m["eval/failed/timeout"]) == (6, 3, 3)
    assert lines == ["evaluation: 6 held-out answers could not be scored (error 3, timeout 3); "
                     "counted as wrong"]


def test_a_verifier_worker_starts_without_torch(task):
    """A worker replaced after a timeout starts in about a second: the verifiers' modules
    and the records they score need no torch (it took most of a worker's 14-33 s start)."""
    p = task.eval[0]
    s, probs, texts = samples_for([p], [["x", "y"]])
    stage = build_filter(FilterConfig(reward="filter_userfns:torch_imported", workers=1), task)
    try:
        stage.score(s, probs, texts)
    finally:
        stage.close()
    assert [x.status for x in s] == [Status.COMPLETED] * 2 and [x.reward for x in s] == [0, 0]


def test_an_evaluation_past_its_deadline_fails_what_is_left_unscored(tiny):
    """Every answer hangs: without a bound the evaluation would take 12 x timeout; past the
    deadline the rest fail as 'deadline' at once, and a later evaluation scores again."""
    task = load_task(TaskConfig(eval_size=12))
    problems = task.eval
    scorer = eval_scorer(FilterConfig(reward="filter_userfns:flaky", timeout_s=30.0,
                                      workers=2), task)
    try:
        scorer.start(1.0)
        scored = scorer.score_all(["hang"] * len(problems), problems)
        causes = Counter(c for _, _, c in scored)
        assert causes == {"deadline": len(problems)} and all(r == 0 for r, _, _ in scored)
        assert scorer.failures == causes
        scorer.start(None)  # the bound is per evaluation
        assert scorer(problems[0].answer[::-1], problems[0]) == (1.0, "checked")
        scorer.start(60.0)
        assert [c for _, _, c in scorer.score_all(["raise", problems[1].answer[::-1]],
                                                  problems[:2])] == ["error", None]
    finally:
        scorer.close()


def test_the_deadline_counts_scoring_only_not_the_generation_before_it(tiny, monkeypatch):
    """An evaluation whose answers took longer to write than the whole deadline still scores
    them: the clock starts at the first answer scored."""
    import rollwise.stages.filter as filter_stage
    task = load_task(TaskConfig(eval_size=4))
    scorer = eval_scorer(FilterConfig(workers=0), task)
    now = [1000.0]
    monkeypatch.setattr(filter_stage.time, "monotonic", lambda: now[0])
    try:
        scorer.start(5.0)
        now[0] += 60.0  # generation: longer than the deadline
        p = task.eval[0]
        (reward, _, cause), = scorer.score_all([p.answer[::-1]], [p])
        assert (reward, cause) == (1.0, None)
        now[0] += 6.0  # past the deadline counted from the first scoring
        assert [c for _, _, c in scorer.score_all(["1"], [p])] == ["deadline"]
    finally:
        scorer.close()


def test_a_scorer_without_counts_still_has_its_exceptions_counted(tiny):
    def half(text, problem):
        if problem.id.endswith(("0", "2", "4", "6", "8")):
            raise ValueError("no")
        return 1.0, "ok"
    task = load_task(TaskConfig(eval_size=10))
    tok = tiny[1]
    m = evaluate(Scripted(tok, lambda prompt: "x"), Prompter.plain(tok), task.eval, half, 4)
    failed = sum(p.id.endswith(("0", "2", "4", "6", "8")) for p in task.eval)
    assert m["eval/failed"] == m["eval/failed/error"] == failed
    assert m["eval/pass1"] == pytest.approx(1 - failed / len(task.eval))


def test_user_code_that_no_timeout_can_stop_is_named():
    """A user's reward in a worker process is bounded by filter.timeout_s; in this process
    (filter.workers=0, or a function a worker cannot import) nothing can stop it, and the
    stage says which (the run logs it at its start)."""
    from rollwise.stages.filter.python_fn import CallableVerifier
    from rollwise.stages.filter.stage import Channel, FilterStage
    task = load_task(TaskConfig(eval_size=40))
    pooled = build_filter(FilterConfig(reward="filter_userfns:flaky", workers=2), task)
    in_process = build_filter(FilterConfig(reward="filter_userfns:flaky", workers=0), task)
    assert pooled.unbounded() == [] and in_process.unbounded() == ["flaky"]
    lam = CallableVerifier(lambda response, problem: 1.0)
    stage = FilterStage([Channel("reward", 1.0, lam)], lambda text: text, workers=2)
    assert stage.unbounded() == []  # a lambda goes to a worker by value
    lock = threading.Lock()
    held = CallableVerifier(lambda response, problem: float(lock.locked()))
    stuck = FilterStage([Channel("reward", 1.0, held)], lambda text: text, workers=2)
    assert stuck.unbounded() == ["reward"]  # what refers to a lock cannot be copied there
    assert build_filter(FilterConfig(reward="exact"), task).unbounded() == []
    for s in (pooled, in_process, stage, stuck):
        s.close()
