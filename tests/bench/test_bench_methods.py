"""`rollwise bench methods`: the profiling pass records what a full forward pass gives, the
threshold rules keep the paper's value exactly where the statistics allow it, every arm spends
its share of one budget, the summary's keys come from the runs, and finished runs are reused."""

import argparse
import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

from rollwise.bench import methods, warm_profile
from rollwise.bench.jobs import BENCH_RUN, train_to_budget
from rollwise.config import EchoConfig, load_config
from rollwise.stages.control.abort_duet import first_prefix
from rollwise.stages.generate.tree_rules import EchoTrace, echo_prune_reason, echo_push
from rollwise.tasks import load_task
from rollwise.tasks.prompts import Prompter

SMALL = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.intermediate_size=64", "task.train_size=200",
         "task.eval_size=20", "sft.steps=20", "generate.max_new_tokens=24",
         "control.prompts_per_step=2", "generate.group_size=4"]


def test_first_prefix_is_the_shortest_prefix_that_shows_it():
    ids = [5, 1, 7, 7, 2, 9]
    for want in range(len(ids) + 1):
        def found(x, want=want):
            return len(x) >= want and want > 0
        naive = next((n for n in range(len(ids) + 1) if found(ids[:n])), None)
        assert first_prefix(ids, found) == naive
    assert first_prefix(ids, lambda x: False) is None


def test_profile_records_what_a_full_forward_pass_gives(tiny):
    model, tok = tiny
    cfg = load_config(None, ["task.train_size=50", "task.eval_size=10"])
    task = load_task(cfg.task)
    prompter = Prompter.for_task(cfg.task, tok, task, model)
    problems = task.train[:6]
    torch.manual_seed(0)
    rs = warm_profile.sample_responses(model, tok, prompter, problems,
                                       lambda text, p: (float(text == p.answer), ""),
                                       task.extract_answer, 1.0, 12, cfg.generate.echo,
                                       batch=4)  # two batches, the first left-padded
    assert len(rs) == len(problems)
    for r, p in zip(rs, problems):
        assert 1 <= r.length <= 12 and len(r.top) == r.length == len(r.trace.H)
        assert r.length == 12 or not r.truncated
    # one response checked token by token against the model on prompt + response
    torch.manual_seed(1)
    p = problems[0]
    one = warm_profile.sample_responses(model, tok, prompter, [p], lambda t, q: (0.0, ""),
                                        task.extract_answer, 1.0, 12, cfg.generate.echo)[0]
    torch.manual_seed(1)
    prompt = torch.tensor([prompter.ids(p)])
    seq = model.generate(prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=12, eos_token_id=list(prompter.stop_ids),
                         pad_token_id=tok.pad_token_id)[0, prompt.shape[1]:].tolist()
    seq = seq[:one.length]
    with torch.no_grad():
        logits = model(torch.tensor([prompter.ids(p) + seq])).logits[0].float()
    trace = EchoTrace()
    for j in range(one.length):
        logp = torch.log_softmax(logits[prompt.shape[1] - 1 + j], -1)
        top = logp.topk(10).values
        echo_push(trace, top.tolist(), cfg.generate.echo)
        assert one.top[j] == pytest.approx(top[:5].exp().tolist(), abs=1e-4)
    assert one.trace.H == pytest.approx(trace.H, abs=1e-4)
    assert one.trace.Cg == pytest.approx(trace.Cg, abs=1e-4)


def _response(length, top=None, trace=None, marker_at=None, answer_at=None, reward=0.0):
    return warm_profile.Response(length, False, reward, marker_at, answer_at,
                                 trace or EchoTrace(), top or [[0.9, 0.05, 0.02, 0.01, 0.01]])


def test_latr_keeps_the_paper_thresholds_only_with_one_branch_point_per_response():
    split = [0.45, 0.40, 0.1, 0.03, 0.02]  # branches at the paper's tau (0.40 > 0.15, gap 0.05)
    sure = [0.9, 0.05, 0.03, 0.01, 0.01]
    many = [_response(60, [split, sure, split])] * 4
    tau, rel, ages = warm_profile.latr_choices(many)
    assert (tau.value, rel.value, ages.value) == (0.15, 0.25, [20, 30, 50])
    weak = [0.3, 0.12, 0.1, 0.1, 0.1]  # p2 0.12 < 0.15: no branch point at the paper's tau
    few = [_response(10, [weak, sure]) for _ in range(4)]
    tau, _, ages = warm_profile.latr_choices(few)
    assert tau.value < 0.12 and "lowered" in tau.rule
    rate = sum(sum(p[1] > tau.value and p[0] - p[1] < 0.25 for p in r.top) for r in few) / 4
    assert rate >= 1
    assert ages.value == [2, 5] and ages.paper == [20, 30, 50]  # a quarter and a half of 10


def _traces(H, Cg=2.0, n=40):
    return [EchoTrace(H=list(H), C=[Cg] * len(H), Cg=[Cg] * len(H), Ctail=[Cg] * len(H),
                      dH=[0.3] * len(H)) for _ in range(n)]


def test_echo_entropy_threshold_is_the_released_one_only_where_tokens_reach_it():
    cfg = EchoConfig()
    low = [_response(5, [[0.5, 0.3, 0.1, 0.05, 0.04]] * 5, t) for t in
           _traces([0.1, 0.2, 0.3, 0.4, 2.0])]
    got = {c.knob.split(".")[-1]: c for c in warm_profile.echo_choices(low, cfg)}
    assert got["entropy_threshold"].value == pytest.approx(warm_profile.quantile(
        [h for r in low for h in r.trace.H], 0.95), abs=1e-4)
    assert got["entropy_threshold"].value < math.log(10)
    # C >= ln 5 always, so the released conf_threshold 1.2 passes nothing: the median C_g
    assert got["conf_threshold"].value == 2.0 and got["conf_threshold"].paper == 1.2
    assert got["delta_threshold"].value == 0.2  # dH 0.3 >= 0.2 everywhere: the released one
    assert got["max_width"].value == 3  # ranks 2-4 have p >= 0.05, rank 5 0.04
    high = [_response(10, [[0.5, 0.3, 0.1, 0.05, 0.04]] * 10, t)
            for t in _traces([0.5] * 9 + [3.6])]  # 10 % of the tokens reach 3.5
    got = {c.knob.split(".")[-1]: c for c in warm_profile.echo_choices(high, cfg)}
    assert got["entropy_threshold"].value == 3.5 and got["entropy_floor"].value == 1.0


def test_prune_share_follows_echo_prune_reason_token_by_token():
    cfg = EchoConfig()
    torch.manual_seed(0)
    traces = []
    for _ in range(30):
        t = EchoTrace()
        for _ in range(25):
            echo_push(t, sorted(torch.randn(10).mul(2).log_softmax(-1).tolist(), reverse=True),
                      cfg)
        traces.append(t)
    for knob in warm_profile.PRUNE_RULES:
        stat = {"min_group_conf": "Cg", "tail_conf": "Ctail", "delta_rise": "dH"}[knob]
        for v in (warm_profile.quantile([x for t in traces for x in getattr(t, stat)], f)
                  for f in (0.01, 0.5, 0.99)):
            c = cfg.model_copy(update={**warm_profile.PRUNE_OFF, knob: v})
            naive = sum(any(echo_prune_reason(t.head(n), c) == warm_profile.PRUNE_RULES[knob]
                            for n in range(1, 26)) for t in traces) / len(traces)
            assert warm_profile.prune_share(traces, cfg, knob, v) == naive
    choice = warm_profile.prune_choice("delta_rise", traces, cfg)
    share = warm_profile.prune_share(traces, cfg, "delta_rise", choice.value)
    released = warm_profile.prune_share(traces, cfg, "delta_rise", 0.5)
    assert (choice.value == 0.5) == (0.01 <= released <= 0.25)
    if choice.value != 0.5:
        assert abs(share - 0.05) <= 0.1


def test_duet_takes_the_paper_marker_when_the_model_writes_it_and_arrol_a_length_quantile():
    rs = [_response(100, marker_at=40 + i) for i in range(10)] + [_response(20)] * 10
    marker, horizon = warm_profile.duet_choices(rs)
    assert marker.value == f"'{warm_profile.PAPER_MARKER}'"
    assert horizon.value == warm_profile.quantile(list(range(40, 50)), 0.9)
    assert marker.override() == "control.duet.marker='\\\\boxed\\{'"
    regex = load_config(None, [marker.override()]).control.duet.marker
    assert re.search(regex, "so 3 + 4 = \\boxed{7}") and not re.search(regex, "boxed 7")
    never = [_response(30, answer_at=3 + i) for i in range(20)]  # nobody writes \boxed{
    marker, horizon = warm_profile.duet_choices(never)
    assert marker.value is None and horizon.value == 20  # answers at 3-22: 0.9 quantile
    (checkpoint,) = warm_profile.arrol_choices([_response(n) for n in range(1, 101)])
    assert checkpoint.value == 25


def test_baselines_are_added_before_the_arms_that_need_them():
    assert methods.with_baselines(["latr", "echo_ttrl", "dps", "grpo"]) == [
        "grpo", "latr", "ttrl", "echo_ttrl", "dynamic", "dps"]
    assert methods.with_baselines(["vade", "insight"]) == ["pool", "vade", "insight"]
    assert methods.with_baselines(["cures", "v0", "dora"]) == ["pool", "cures", "grpo", "v0",
                                                               "dora"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown arm"):
        methods.arm_list("latr,bogus")


def test_arms_may_be_given_apart_and_a_stray_word_is_refused_before_any_work(capsys,
                                                                             monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def warm_start_of(config, base, root, init):
        seen["base"] = base
        return "init"

    def with_baselines(arms):
        seen["arms"] = arms
        raise Stop

    monkeypatch.setattr(methods, "warm_start_of", warm_start_of)
    monkeypatch.setattr(methods, "cached_profile", lambda *a: {"stats": {}})
    monkeypatch.setattr(methods, "with_baselines", with_baselines)
    with pytest.raises(Stop):
        methods.main(["--arms", "april", "arrol", "duet50", "run.seed=3"])
    assert seen["arms"] == ["april", "arrol", "duet50"]
    assert seen["base"][-1] == "run.seed=3" and "arrol" not in seen["base"]

    seen.clear()
    with pytest.raises(SystemExit) as stop:
        methods.main(["--arms", "april", "arol", "run.seed=3"])
    assert stop.value.code == 2 and not seen
    assert "'arol': neither an arm" in capsys.readouterr().err


def test_summary_keys_come_from_the_runs():
    def run(arm, seed, tokens, final, **kw):
        r = {"arm": arm, "seed": seed, "tokens_to_target": tokens, "final_pass1": final,
             "seconds_to_target": tokens / 10, "reached": True, "label_acc": None,
             "head_auc": [], **{k: 1.0 for k in methods.MEDIANS if k not in
                                ("tokens_to_target", "final_pass1", "seconds_to_target")}}
        r.update(kw)
        return r
    runs = [run("grpo", s, t, f, mixed_share=m) for s, t, f, m in
            ((0, 600, 0.5, 0.2), (1, 800, 0.6, 0.3), (2, 700, 0.7, 0.4))]
    runs += [run("latr", s, t, f, mixed_share=m) for s, t, f, m in
             ((0, 300, 0.6, 0.3), (1, 500, 0.6, 0.6), (2, 400, 0.6, 0.3))]
    runs += [run("arrol", s, t, 0.5, head_auc=[{"step": 1, "auc": a}])
             for s, t, a in ((0, 350, 0.6), (1, 350, 0.8))]
    runs += [run("duet50", s, 900, f) for s, f in ((0, 0.4), (1, 0.8), (2, 0.7))]
    runs += [run("dynamic", 0, 1, 0.5, rollouts_to_target=400),
             run("dps", 0, 1, 0.5, rollouts_to_target=100)]
    runs += [run("pool", s, t, 0.5) for s, t in ((0, 1000), (1, 1200), (2, 800))]
    runs += [run("vade", s, t, 0.5) for s, t in ((0, 500), (1, 900), (2, 600))]
    # seconds: seed 1 ran on a slower machine than seeds 0 and 2, so only pairs compare
    runs += [run("april", s, 1, 0.5, seconds_to_target=t) for s, t in ((0, 54), (1, 400),
                                                                       (2, 35))]
    out = methods.summarize(runs, [0, 1, 2])
    # GRPO's seconds are 60, 80, 70: ratios 0.9, 5.0, 0.5; the medians' ratio would be 54 / 70
    assert out["april_seconds_ratio"] == pytest.approx(0.9)
    assert out["latr_tokens_to_target_ratio"] == 400 / 700
    assert out["latr_mixed_share_ratio"] == pytest.approx(0.3 / 0.3)
    assert out["arrol_speedup"] == 700 / 350
    assert out["medians"]["arrol"]["head_auc_mean"] == pytest.approx(0.7)
    assert out["duet50_pass1_delta"] == pytest.approx((-0.1 + 0.2 + 0.0) / 3)
    assert out["dps_rollouts_ratio"] == 0.25
    assert out["vade_tokens_to_target_ratio"] == 600 / 1000
    assert "insight_tokens_to_target_ratio" not in out
    assert "sgpo_compute_ratio" not in out and "echo_ttrl_pass1_delta" not in out


def test_the_seed_method_keys_come_from_their_runs():
    def run(arm, seed, tokens, final, **kw):
        return {"arm": arm, "seed": seed, "tokens_to_target": tokens, "final_pass1": final,
                "seconds_to_target": 1.0, "reached": True, "label_acc": None, "head_auc": [],
                **{k: 1.0 for k in methods.MEDIANS if k not in
                   ("tokens_to_target", "final_pass1", "seconds_to_target")}, **kw}
    runs = [run("pool", s, 1000, f) for s, f in ((0, 0.4), (1, 0.5))]
    runs += [run("cures", s, 800, f) for s, f in ((0, 0.45), (1, 0.6))]
    runs += [run("grpo", s, 1000, 0.5) for s in (0, 1)]
    runs += [run("v0", s, t, 0.5, v0_brier=b, v0_brier_const=0.25, v0_auc=None)
             for s, t, b in ((0, 900, 0.2), (1, 700, 0.1))]
    runs += [{"arm": "dora", "seed": s, "dora_acc": d, "solution_acc": a, "directions": 3.0}
             for s, d, a in ((0, 0.5, 0.4), (1, 0.6, 0.6))]
    out = methods.summarize(runs, [0, 1])
    assert out["cures_pass1_delta"] == pytest.approx((0.05 + 0.1) / 2)
    assert out["v0_brier"] == pytest.approx(0.15) and out["v0_brier_const"] == 0.25
    assert out["v0_tokens_to_target_ratio"] == 800 / 1000
    assert "v0_auc" not in out  # no run had both outcomes
    assert out["dora_pass1_delta"] == pytest.approx(0.05)
    assert out["search"] == {"dora_acc": 0.55, "solution_acc": 0.5, "directions": 3.0}
    assert "dora" not in out["medians"]  # a search is not a training run


def test_april_diagnostics_are_shares_of_the_whole_run_and_older_runs_show_a_dash(capsys):
    diag = methods.Diagnostics("april seed 0", 100)
    run = SimpleNamespace(current_step=0)
    for step, (stale, trained, gen, pre) in enumerate(((0, 50, 1.0, 300), (30, 60, 2.0, 420),
                                                       (45, 90, 1.5, 510)), 1):
        run.current_step = step
        diag(run, SimpleNamespace(scored=[]), {"tokens/decoded": 40, "tokens/stale": stale,
                                               "tokens/batch": trained, "perf/gen_seconds": gen,
                                               "tokens/prefilled": pre})
    got = diag.summary(at_step=2)
    assert got["stale_share"] == (0 + 30 + 45) / (50 + 60 + 90)  # not a mean of step shares
    assert got["gen_seconds"] == 4.5 and got["prefilled"] == 300 + 420 + 510
    base = {"arm": "grpo", "seed": 0, "reached": True, "tokens_to_target": 90,
            "seconds_to_target": 9.0, "final_pass1": 0.5, "mixed_share": 0.25, "rollouts": 64}
    april = {**base, "arm": "april", **got}
    methods.method_tables({"arms": ["april"], "seeds": [0], "runs": [base, april]})
    row = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| 0 |")][0]
    assert "| 0.500 / 0.500 | – / 0.375 | – / 4.500 | – / 1230 |" in row
    # seeds run on two machines: the table says their seconds only compare within a seed
    later = [{**r, "seed": 1, "machine": "Intel Xeon, 2 cores, amx_bf16"} for r in (base, april)]
    methods.method_tables({"arms": ["april"], "seeds": [0, 1], "runs": [base, april, *later]})
    assert "seconds compare only" not in capsys.readouterr().out  # one machine is named
    earlier = [{**r, "machine": "AMD EPYC, 2 cores, avx512_bf16"} for r in (base, april)]
    methods.method_tables({"arms": ["april"], "seeds": [0, 1], "runs": [*earlier, *later]})
    assert "ran on 2 machines, AMD EPYC, 2 cores, avx512_bf16; Intel Xeon" in \
        capsys.readouterr().out


def test_evaluations_follow_the_decoded_tokens(tmp_path):
    steps = []
    t = train_to_budget(None, SMALL + BENCH_RUN + [f"run.root={tmp_path}"], 500, 10 ** 9,
                        lambda run, r, m: steps.append(m["tokens/decoded"]), eval_tokens=120)
    used, want = 0, []
    for n, d in enumerate(steps, 1):
        if (used + d) // 120 > used // 120 or used + d >= 500:
            want.append(n)
        used += d
    assert [c["step"] for c in t["curve"]] == [0] + want
    assert t["curve"][-1]["tokens"] == t["tokens"] == used >= 500


@pytest.mark.integration
def test_every_arm_spends_its_share_and_finished_runs_are_reused(tmp_path, capsys):
    args = ["--config", "", "--seeds", "0", "--tokens", "300", "--eval-tokens", "150",
            "--gain", "0.99", "--profile-prompts", "8", "--root", str(tmp_path), "--json",
            *SMALL]
    assert methods.main(["--arms", "latr,duet50", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["arm"]: r for r in out["runs"]}
    assert set(runs) == {"grpo", "latr", "duet50"}
    per_step_max = 2 * 4 * 24 * 2  # LATR and ARRoL decode more than a group per prompt
    for arm, share in (("grpo", 300), ("latr", 300), ("duet50", 150)):
        assert share <= runs[arm]["tokens"] < share + per_step_max
        assert not runs[arm]["reached"] and runs[arm]["tokens_to_target"] == runs[arm]["tokens"]
    assert {"latr", "echo", "arrol", "duet"} <= set(out["profile"]["choices"])
    for o in out["profile"]["overrides"]["latr"]:
        assert o in out["per_arm"]["latr"]
    assert isinstance(out["latr_tokens_to_target_ratio"], float)
    log = tmp_path / "runs.jsonl"
    assert len(log.read_text().splitlines()) == 3
    # again with one more arm, side by side this time: the three finished runs are reused
    # (a run's thread count is not among its settings), only ARRoL runs, on one thread
    assert methods.main(["--arms", "latr,duet50,arrol", "--jobs", "2", *args]) == 0
    out2 = json.loads(capsys.readouterr().out)
    assert len(log.read_text().splitlines()) == 4
    assert [r["threads"] for r in out2["runs"] if r["arm"] == "arrol"] == [1]
    assert {r["arm"] for r in out2["runs"]} == {"grpo", "latr", "duet50", "arrol"}
    assert [r for r in out2["runs"] if r["arm"] == "latr"] == [runs["latr"]]
    assert out2["profile"] == out["profile"]
    # the saved JSON prints its tables again without running anything
    saved = tmp_path / "out.json"
    saved.write_text(json.dumps(out2))
    assert methods.main(["--report", str(saved)]) == 0
    text = capsys.readouterr().out
    assert "latr against grpo" in text and "arrol against grpo" in text
    assert len(log.read_text().splitlines()) == 4


def test_ttrl_arms_train_on_the_vote_and_score_held_out_like_the_others():
    from rollwise.stages.filter import eval_scorer
    for config, truth in ((None, "exact"), (methods.CONFIG, "math")):
        override = methods.ttrl_reward(config, [])
        cfg = load_config(config, [override], check_files=False)
        assert cfg.filter.reward == {"majority": 1.0, truth: 0.0}
        task = load_task(cfg.task)
        scorer = eval_scorer(cfg.filter, task)
        try:
            assert scorer.stage.channels[0].key == truth  # held-out: the true answers
        finally:
            scorer.close()
    # a config whose reward carries no ground truth: the vote alone
    assert methods.ttrl_reward(None, ["filter.reward=majority"]) == "filter.reward=majority"


def test_a_config_that_warm_starts_its_pretrained_model_benches_from_the_warm_start(tmp_path):
    """model.path with sft.from_path: every arm starts from the cached float32 warm start
    (its folder as saved), not from the model as fetched; without from_path, from model.path."""
    from chat_model import build_chat_model

    from rollwise.training.sft import warm_start_path
    path = build_chat_model(tmp_path / "chat")
    base = [f"model.path={path}", "task.name=worked", "task.worked.terms=[2, 3]",
            "task.train_size=12", "task.eval_size=4", "sft.steps=1", "sft.batch_size=4",
            "sft.lr=1e-4"]
    assert methods.warm_start_of(None, base, str(tmp_path), None) is None
    tuned = methods.warm_start_of(None, base + ["sft.from_path=true"], str(tmp_path), None)
    cfg = load_config(None, base + ["sft.from_path=true", f"run.root={tmp_path}"])
    assert tuned == str(warm_start_path(cfg, load_task(cfg.task)))
    from safetensors.torch import load_file
    weights = load_file(f"{tuned}/model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}  # the masters' precision
