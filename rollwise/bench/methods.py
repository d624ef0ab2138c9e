"""The rollout methods against their baselines on any task config, at an equal budget of
generated tokens.

    rollwise bench methods [--config smollm2] [--arms latr,arrol,...]
                           [--seeds 0 1 2] [--tokens N] [--eval-tokens N] [--gain G]
                           [--json] [key=value ...]

Every arm starts from the same warm start (the config's model.path, or its SFT warm start, or
--init), decodes the same budget of generated tokens (the engine's decoded tokens: pruned
branches, aborted tails and sGPO's profiling pass count; DUET-50 gets half) and is evaluated on
the same held-out set, greedy pass@1, after each further --eval-tokens decoded tokens and at the
end (evaluation is not timed). The target is the warm start's pass@1 plus --gain for every arm.

Arms and what each is paired with (a baseline is added when an arm needs it):

| arm | settings | baseline | headline key |
|---|---|---|---|
| grpo | i.i.d. groups of generate.group_size | - | - |
| latr | generate.strategy=latr | grpo | latr_tokens_to_target_ratio, latr_mixed_share_ratio |
| arrol | control.inflight=arrol | grpo | arrol_speedup (GRPO's tokens to target / ARRoL's) |
| duet50 | control.inflight=duet at 50 % of the budget | grpo | duet50_pass1_delta |
| sgpo | control.group_size=sgpo | grpo | sgpo_compute_ratio |
| dars | control.group_size=dars | grpo | dars_compute_ratio |
| april | control.inflight=april | grpo | april_seconds_ratio (seconds to target, by seed) |
| ttrl | filter.reward=majority (labels never read) | - | - |
| echo_ttrl | ECHO trees, shaping, adaptive clip, majority | ttrl | echo_ttrl_pass1_delta |
| dynamic | DAPO dynamic sampling on a recurring pool (--pool) | - | - |
| dps | DPS prompt selection on the same pool | dynamic | dps_rollouts_ratio |
| xrpo | XRPO's allocator and advantage sharpening | grpo | xrpo_tokens_to_target_ratio |
| pool | uniform prompts (GRPO) on a recurring pool (--pool) | - | - |
| vade | VADE selection on the same pool | pool | vade_tokens_to_target_ratio |
| insight | InSight selection on the same pool | pool | insight_tokens_to_target_ratio |
| cures | CurES selection and allocation on the same pool | pool | cures_pass1_delta |
| v0 | rollouts by V0's predicted success rate | grpo | v0_brier, v0_tokens_to_target_ratio |
| xrpo_icl | XRPO, in-context seeding too, on the pool | pool | xrpo_icl_tokens_to_target_ratio |
| dora | a search from the warm start: DORA against by-candidate | - | dora_pass1_delta |
| d3s | D3S down-sampling of samples and tokens | grpo | d3s_tokens_to_target_ratio |
| mssr | single rollouts, entropy shaping, on the pool | pool | mssr_tokens_to_target_ratio |
| brorl | 4x the rollouts per prompt, an unbiased quarter trained | grpo | brorl_pass1_delta |
| scope | SCOPE's rectified failures, pool | pool | scope_pass1_delta, scope_diversity_ratio |
| nudge | NudgeRL's contexts and distillation, pool | pool | nudge_tokens_to_target_ratio |

The mssr arm asks as many prompts a step as its baseline draws rollouts a step (prompts per
step times group size; the command's overrides come first), so both train on as many
rollouts a step. The scope arm's process verifier is worked on the worked task, columns on
the stepped tiers and equations otherwise; the nudge arm's contexts are
configs/nudge-arithmetic.txt.

The dora arm trains nothing: per seed, it searches the held-out set from the warm start with
--search-budget rollouts per prompt (run.search.*) twice, spread by DORA and by candidate, on
the same draws of the first candidates (rollwise.search).

The two TTRL arms train on the majority vote alone (the config's ground-truth verifier rides
along at weight 0, so held-out pass@1 is scored as in the other arms) and report sampled
pass@1 (4 draws at T = 1; greedy decoding already picks the majority's answer); echo_ttrl
also reports echo_label_acc_delta. Thresholds that depend on the model (LATR's tau and ages,
ECHO's entropy and confidence thresholds, ARRoL's checkpoint, DUET's marker and horizon) are
set once, before any arm runs, by the documented rules of rollwise.bench.warm_profile from a
profiling pass on the warm start: one sampled response per training prompt
(--profile-prompts). The choices and the statistics behind them are in the JSON ("profile").

Each finished run is appended to <root>/runs.jsonl at once; a later call with the same settings
reuses the runs there (--fresh starts over), so a long comparison can be run arm by arm.
Reported per arm (median over seeds): tokens, seconds and steps to the target (a run that
misses it counts its whole budget, reached: false), final pass@1, and each method's own
diagnostics: mixed-group share, distinct answers per group, forks, pruned branches and prefix
tokens saved (trees), the quality head's AUC over training (ARRoL), aborts per rollout
(ARRoL, DUET), group sizes (sGPO, DARS), rollouts to target (DPS), pseudo-label accuracy (TTRL),
the share of trained tokens sampled by an older policy, generation's seconds and the tokens
prefilled, resumed answers among them (APRIL).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path

import torch

from rollwise import models
from rollwise.bench import warm_profile
from rollwise.bench.jobs import (
    BENCH_RUN,
    execute,
    print_keys_and_failures,
    train_to_budget,
    warm_start_folder,
)
from rollwise.bench.target import first_reach
from rollwise.bench.trees import distinct_answers
from rollwise.config import load_config
from rollwise.presets import PRESETS
from rollwise.stages.filter import eval_scorer
from rollwise.stages.filter.stage import CORRECTNESS, weights_of
from rollwise.stages.generate.scope import distinct_correct
from rollwise.store.rollouts import RolloutStore
from rollwise.tasks import load_task
from rollwise.tasks.prompts import Prompter
from rollwise.types import Group

CONFIG = str(PRESETS / "smollm2.yaml")
NUDGE_CONTEXTS = str(PRESETS / "nudge-arithmetic.txt")
TTRL = ["run.eval_samples=4", "run.eval_temperature=1.0"]  # and ttrl_reward()
# arm -> (baseline arm, overrides, the profile's methods whose choices it takes)
ARMS: dict[str, tuple[str | None, list[str], list[str]]] = {
    "grpo": (None, ["generate.strategy=group"], []),
    "latr": ("grpo", ["generate.strategy=latr"], ["latr"]),
    "arrol": ("grpo", ["control.inflight=arrol"], ["arrol"]),
    "duet50": ("grpo", ["control.inflight=duet", "control.duet.budget=0.5"], ["duet"]),
    "sgpo": ("grpo", ["control.group_size=sgpo"], []),
    "dars": ("grpo", ["control.group_size=dars"], []),
    "april": ("grpo", ["control.inflight=april"], []),
    "ttrl": (None, ["generate.strategy=group"] + TTRL, []),
    "echo_ttrl": ("ttrl", ["generate.strategy=echo", "train.token_shaping=echo",
                           "train.adaptive_clip=echo"] + TTRL, ["echo"]),
    "dynamic": (None, ["control.dynamic_sampling=true"], []),
    "dps": ("dynamic", ["control.selector=dps"], []),
    "xrpo": ("grpo", ["control.group_size=xrpo", "train.advantage=xrpo"], []),
    "pool": (None, ["control.selector=uniform"], []),
    "vade": ("pool", ["control.selector=vade"], []),
    "insight": ("pool", ["control.selector=insight"], []),
    "cures": ("pool", ["control.selector=cures", "control.group_size=cures"], []),
    "v0": ("grpo", ["control.group_size=v0"], []),
    "xrpo_icl": ("pool", ["control.group_size=xrpo", "train.advantage=xrpo",
                          "control.icl_seeding.exemplars=2", "control.icl_seeding.after=1"], []),
    "dora": (None, ["run.eval_temperature=1.0"], []),
    "d3s": ("grpo", ["train.downsample=d3s"], []),
    "brorl": ("grpo", ["generate.group_size=32", "train.subsample=8",
                       "train.mass_balance=true"], []),
    "mssr": ("pool", ["generate.group_size=1", "train.advantage=mssr",
                      "control.baseline=running", "train.token_shaping=entropy",
                      "filter.drop_equal_reward_groups=false"], []),
    "scope": ("pool", [], []),  # its process verifier: arm_last
    "nudge": ("pool", ["generate.strategy=nudge", f"generate.nudge.contexts_file={NUDGE_CONTEXTS}",
                       "train.advantage=nudge"], []),
}
BUDGET_SHARE = {"duet50": 0.5}
TTRL_ARMS = {"ttrl", "echo_ttrl"}
# on a recurring prompt pool (--pool): a prompt comes back, so its statistics (and a stuck
# prompt's seeding) have a next time
POOLED = {"dynamic", "dps", "pool", "vade", "insight", "cures", "xrpo_icl", "mssr", "scope",
          "nudge"}
TEST_TIME = {"dora"}  # no training: a search on the warm start


def with_baselines(arms: list[str]) -> list[str]:
    """The arms in the order given, each preceded by its baseline when not already there."""
    out: list[str] = []
    for a in arms:
        base = ARMS[a][0]
        if base and base not in out:
            out.append(base)
        if a not in out:
            out.append(a)
    return out


def arm_last(arm: str, config: str | None, overrides: list[str]) -> list[str]:
    """Overrides an arm needs after the command's: mssr's prompts a step (its baseline's
    rollouts a step), scope's process verifier (by the task and its tiers)."""
    if arm == "mssr":
        cfg = load_config(config, overrides, check_files=False)
        rollouts = cfg.control.prompts_per_step * cfg.generate.group_size
        return [f"control.prompts_per_step={rollouts}"]
    if arm == "scope":
        cfg = load_config(config, overrides, check_files=False)
        if cfg.task.name == "worked":
            return ["generate.scope.verifier=worked"]
        stepped = cfg.task.name == "arith" and any(t.endswith("s") for t in cfg.task.tiers)
        return [f"generate.scope.verifier={'columns' if stepped else 'equations'}"]
    return []


def ttrl_reward(config: str | None, overrides: list[str]) -> str:
    """The TTRL arms' reward: the majority vote alone, with the config's ground-truth
    verifier carried at weight 0 so that held-out pass@1 is scored as in the other arms
    (with no such verifier, held-out scoring falls back to exact match)."""
    reward = load_config(config, overrides, check_files=False).filter.reward
    truth = [n for n in weights_of(reward) if n in CORRECTNESS or ":" in n]
    return (f"filter.reward={{majority: 1.0, '{truth[0]}': 0.0}}" if truth
            else "filter.reward=majority")


def warm_start_of(config: str | None, overrides: list[str], root: str,
                  init: str | None) -> str | None:
    """The folder every arm starts from: --init, else None when the config names a
    pretrained model loaded as is (model.path), else its SFT warm start (cached)."""
    if init:
        return init
    cfg = load_config(config, overrides)
    if cfg.model.path and not cfg.sft.from_path:
        return None
    return warm_start_folder(config, overrides, root)


def profile(config: str | None, overrides: list[str], init: str | None, prompts: int,
            seed: int = 0) -> dict:
    """The profiling pass on the warm start and the rules' choices (warm_profile)."""
    cfg = load_config(config, overrides)
    task = load_task(cfg.task)
    model, tok = models.load_model(init or cfg.model.path, cfg.model.dtype)
    model.eval()
    torch.manual_seed(seed)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    scorer = eval_scorer(cfg.filter, task)
    try:
        rs = warm_profile.sample_responses(
            model, tok, Prompter.for_task(cfg.task, tok, task, model), task.train[:prompts],
            scorer, task.extract_answer, cfg.generate.temperature, cfg.generate.max_new_tokens,
            cfg.generate.echo)
    finally:
        scorer.close()
    choices = warm_profile.choose(rs, cfg.generate.echo)
    return {"stats": warm_profile.summary(rs), "choices": warm_profile.as_json(choices),
            "overrides": {m: [c.override() for c in cs] for m, cs in choices.items()}}


def cached_profile(path: Path, config: str | None, overrides: list[str], init: str | None,
                   prompts: int) -> dict:
    """profile(), kept in `path` and reused while its inputs are the same, so that every arm
    of a comparison run arm by arm gets the same thresholds."""
    key = settings_key(config, overrides, init, prompts)
    if path.exists():
        kept = json.loads(path.read_text())
        if kept.get("key") == key:
            return kept
    prof = {"key": key, **profile(config, overrides, init, prompts)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(prof, indent=1))
    return prof


MASS = ("sampled_correct", "unsampled_correct", "sampled_wrong", "unsampled_wrong")


class Diagnostics:
    """Each step's method diagnostics, summed or averaged over the run."""

    def __init__(self, label: str, budget: float):
        self.label, self.budget = label, budget
        self.steps: list[dict] = []
        self.used = 0.0

    def __call__(self, run, r, m) -> None:
        sizes = [len(g.samples) for g in r.scored]
        aborts = sum(v for k, v in m.items() if k.startswith("decisions/control/abort"))
        self.used += m["tokens/decoded"]
        self.steps.append({
            "step": run.current_step, "tokens": self.used,
            "mixed": m.get("groups/mixed_share", 0.0),
            "distinct": distinct_answers(run, r.scored) if r.scored else 0.0,
            "forks": sum(v for k, v in m.items() if k.startswith("decisions/generate/fork")),
            "pruned": sum(v for k, v in m.items() if k.startswith("decisions/generate/prune")),
            "prefix_saved": m.get("tokens/prefix_saved", 0.0),
            "rollouts": sum(sizes) + aborts, "aborts": aborts,
            "group_size": statistics.mean(sizes) if sizes else 0.0,
            "group_range": (min(sizes), max(sizes)) if sizes else (0, 0),
            "head_auc": m.get("arrol/head_auc"),
            "label_acc": m.get("filter/majority_label_acc"),
            "length": m.get("response/length_mean", 0.0),
            # APRIL: trained tokens sampled before the last update, generation's seconds, and
            # the tokens prefilled (a resumed answer is prefilled again)
            "stale": m.get("tokens/stale", 0.0), "trained": m.get("tokens/batch", 0.0),
            "gen_seconds": m.get("perf/gen_seconds", 0.0),
            "prefilled": m.get("tokens/prefilled"),
            # V0's calibration before generation; XRPO's seeded prompts
            "v0_brier": m.get("control/v0/brier"), "v0_auc": m.get("control/v0/auc"),
            "v0_brier_const": m.get("control/v0/brier_const"),
            "seeded": m.get("control/icl_seeding/seeded", 0.0),
            "loss_tokens": m.get("tokens/trained", 0.0), "decoded": m["tokens/decoded"],
            # BroRL's mass balance: each class's own-token probability change in the update
            **{f"mass_{k}": m.get(f"train/mass/{k}_delta") for k in MASS}})
        print(f"{self.label}: step {run.current_step}, {self.used:.0f}/{self.budget:.0f} "
              f"tokens, mixed {self.steps[-1]['mixed']:.2f}, mean length "
              f"{self.steps[-1]['length']:.1f}", file=sys.stderr, flush=True)

    def summary(self, at_step: int) -> dict:
        s = self.steps
        aucs = [x["head_auc"] for x in s if x["head_auc"] is not None]
        accs = [x["label_acc"] for x in s[-max(len(s) // 4, 1):] if x["label_acc"] is not None]
        rollouts = sum(x["rollouts"] for x in s)
        return {"mixed_share": statistics.mean(x["mixed"] for x in s),
                "distinct_answers": statistics.mean(x["distinct"] for x in s),
                "forks": sum(x["forks"] for x in s), "pruned": sum(x["pruned"] for x in s),
                "prefix_saved": sum(x["prefix_saved"] for x in s), "rollouts": rollouts,
                "abort_rate": sum(x["aborts"] for x in s) / max(rollouts, 1),
                "group_size": statistics.mean(x["group_size"] for x in s),
                "group_size_max": max(x["group_size"] for x in s),
                # the smallest and largest single group of the run (an allocator's spread)
                "group_smallest": min(x["group_range"][0] for x in s),
                "group_largest": max(x["group_range"][1] for x in s),
                "rollouts_to_target": sum(x["rollouts"] for x in s if x["step"] <= at_step),
                "head_auc": aucs, "label_acc": statistics.mean(accs) if accs else None,
                "stale_share": sum(x["stale"] for x in s) / max(sum(x["trained"] for x in s), 1),
                "gen_seconds": sum(x["gen_seconds"] for x in s),
                "prefilled": (None if any(x.get("prefilled") is None for x in s)
                              else sum(x["prefilled"] for x in s)),
                "length_first": s[0]["length"], "length_last": s[-1]["length"],
                **{k: _mean_known(x.get(k) for x in s)
                   for k in ("v0_brier", "v0_auc", "v0_brier_const")},
                "seeded": sum(x.get("seeded", 0.0) for x in s),
                # tokens the loss saw over tokens decoded (D3S trains a share)
                "trained_share": sum(x.get("loss_tokens", 0.0) for x in s)
                / max(sum(x.get("decoded", 0.0) for x in s), 1),
                **{f"mass_{k}": _mean_known(x.get(f"mass_{k}") for x in s) for k in MASS}}


def _mean_known(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def run_arm(config: str | None, overrides: list[str], arm: str, seed: int, tokens: float,
            eval_tokens: float, gain: float, root: str, init: str | None,
            settings: str) -> dict:
    """One arm and seed, trained until its share of the token budget is decoded."""
    if arm in TEST_TIME:
        return run_search(config, overrides, seed, init, settings)
    budget = tokens * BUDGET_SHARE.get(arm, 1.0)
    diag = Diagnostics(f"{arm} seed {seed}", budget)
    t = train_to_budget(config, overrides + [
        f"run.seed={seed}", f"run.root={root}", f"run.name={arm}-{seed}"]
        + ([f"run.init={init}"] if init else []), budget, 10 ** 9, diag, eval_tokens)
    curve = t["curve"]
    target = curve[0]["pass1"] + gain
    hit = first_reach(curve, target)
    return {"arm": arm, "seed": seed, "settings": settings, "steps": t["steps"],
            "tokens": t["tokens"], "seconds": t["seconds"], "start_pass1": curve[0]["pass1"],
            "final_pass1": curve[-1]["pass1"], "target": target, "reached": hit is not None,
            "tokens_to_target": hit["tokens"] if hit else t["tokens"],
            "seconds_to_target": hit["seconds"] if hit else t["seconds"],
            "steps_to_target": hit["step"] if hit else t["steps"],
            **diag.summary(hit["step"] if hit else t["steps"]), "curve": curve,
            "distinct_correct": store_diversity(Path(root) / f"{arm}-{seed}"),
            "threads": torch.get_num_threads()}  # seconds depend on it (--jobs: 1)


def store_diversity(run_dir: Path) -> float | None:
    """Distinct correct responses per generated group over a whole run, read from its rollout
    store (None when it has none); a rollout SCOPE replaced, or a rectification that did not
    replace one, is not its group's."""
    store = RolloutStore(run_dir / "rollouts")
    if not store.steps():
        return None
    samples = store.samples()
    rectified = [s for s in samples if "scope" in s.meta]
    aside = {s.parent_uid if s.meta["scope"].get("replaced", True) else s.uid
             for s in rectified}
    groups: dict[str, list] = {}
    for s in samples:
        if s.uid not in aside:
            groups.setdefault(s.group_id, []).append(s)
    return distinct_correct([Group(k, v) for k, v in groups.items()])


def run_search(config: str | None, overrides: list[str], seed: int, init: str | None,
               settings: str) -> dict:
    """The dora arm: the warm start's held-out search accuracy with run.eval_samples
    rollouts per prompt, by DORA and by solution-level allocation, on the same draws."""
    from rollwise.engine import BuiltinEngine
    from rollwise.search import search_vote
    cfg = load_config(config, overrides)
    task = load_task(cfg.task)
    model, tok = models.load_model(init or cfg.model.path, cfg.model.dtype)
    model.eval()
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    scorer = eval_scorer(cfg.filter, task)
    engine = BuiltinEngine(model, copy_model=False)
    prompter = Prompter.for_task(cfg.task, tok, task, model)
    out = {"arm": "dora", "seed": seed, "settings": settings, "budget": cfg.run.eval_samples}
    try:
        for by in ("dora", "solution"):
            search = cfg.run.search.model_copy(update={"allocation": by})
            got = search_vote(engine, prompter, task.eval, scorer, task.extract_answer,
                              cfg.generate.max_new_tokens, cfg.run.eval_samples,
                              cfg.run.eval_temperature, search, seed=seed)
            out[f"{by}_acc"] = got["eval/search_acc"]
            out["directions"] = got["eval/search_directions"]
    finally:
        scorer.close()
    return out


def _run(*job) -> dict:
    r = run_arm(*job)
    if r["arm"] in TEST_TIME:
        print(f"dora seed {r['seed']}: search accuracy {r['dora_acc']:.3f} (DORA) against "
              f"{r['solution_acc']:.3f} (solution level), {r['directions']:.2f} directions a "
              f"prompt", file=sys.stderr, flush=True)
        return r
    print(f"{r['arm']} seed {r['seed']}: {r['steps']} steps, {r['tokens']:.0f} tokens, "
          f"{r['seconds']:.0f} s, pass@1 {r['start_pass1']:.3f} -> {r['final_pass1']:.3f}, "
          f"to target {r['tokens_to_target']:.0f} tokens"
          f"{'' if r['reached'] else ' (not reached)'}", file=sys.stderr, flush=True)
    return r


MEDIANS = ("tokens_to_target", "seconds_to_target", "steps_to_target", "final_pass1",
           "tokens", "seconds", "mixed_share", "distinct_answers", "forks", "pruned",
           "prefix_saved", "rollouts", "rollouts_to_target", "abort_rate", "group_size",
           "group_size_max")


def _median_known(values: list) -> float | None:
    """The median, or None where a run's value is unknown."""
    return None if any(v is None for v in values) else statistics.median(values)


def summarize(runs: list[dict], seeds: list[int]) -> dict:
    by: dict[str, list[dict]] = {}
    for r in runs:
        if r["arm"] not in TEST_TIME:
            by.setdefault(r["arm"], []).append(r)
    searched = [r for r in runs if r["arm"] == "dora"]
    med = {a: {k: _median_known([r[k] for r in rs]) for k in MEDIANS}
           for a, rs in by.items()}
    for a, rs in by.items():  # runs recorded before it was kept have their stores read
        known = [r["distinct_correct"] for r in rs if r.get("distinct_correct") is not None]
        med[a]["distinct_correct"] = statistics.median(known) if known else None
    for a, rs in by.items():
        med[a]["reached"] = sum(r["reached"] for r in rs)
        med[a]["seeds"] = len(rs)
        accs = [r["label_acc"] for r in rs if r["label_acc"] is not None]
        med[a]["label_acc"] = statistics.mean(accs) if accs else None
        aucs = [x["auc"] if isinstance(x, dict) else x for r in rs for x in r["head_auc"]]
        med[a]["head_auc_mean"] = statistics.mean(aucs) if aucs else None

    def pairs(a: str, key: str) -> list[tuple[float, float]]:
        """(arm's value, its baseline's) for each seed both ran and both know."""
        x = {r["seed"]: r[key] for r in by.get(a, [])}
        y = {r["seed"]: r[key] for r in by.get(ARMS[a][0], [])}
        return [(x[s], y[s]) for s in seeds if s in x and s in y
                and x[s] is not None and y[s] is not None]

    def paired(a: str, key: str) -> float | None:
        d = [u - v for u, v in pairs(a, key)]
        return statistics.mean(d) if d else None

    def seed_ratio(a: str, key: str) -> float | None:
        """The median over seeds of each seed's ratio to its baseline run: for seconds, which
        are only comparable between two runs on one machine (the runs' "machine")."""
        d = [u / max(v, 1e-9) for u, v in pairs(a, key)]
        return statistics.median(d) if d else None

    def median_of(a: str, key: str) -> float | None:
        known = [r[key] for r in by.get(a, []) if r.get(key) is not None]
        return statistics.median(known) if known else None

    def ratio(a: str, key: str) -> float | None:
        base = ARMS[a][0]
        if a not in med or base not in med or med[a][key] is None or med[base][key] is None:
            return None
        return med[a][key] / max(med[base][key], 1e-9)
    out: dict = {"medians": med,
                 "paired_pass1_delta": {a: paired(a, "final_pass1") for a in med
                                        if ARMS[a][0]}}
    keys = {"latr_tokens_to_target_ratio": ratio("latr", "tokens_to_target"),
            "latr_mixed_share_ratio": ratio("latr", "mixed_share"),
            "echo_ttrl_pass1_delta": paired("echo_ttrl", "final_pass1"),
            "echo_label_acc_delta": paired("echo_ttrl", "label_acc"),
            "arrol_speedup": (1 / ratio("arrol", "tokens_to_target")
                              if ratio("arrol", "tokens_to_target") else None),
            "arrol_pass1_delta": paired("arrol", "final_pass1"),
            "duet50_pass1_delta": paired("duet50", "final_pass1"),
            "sgpo_compute_ratio": ratio("sgpo", "tokens_to_target"),
            "dars_compute_ratio": ratio("dars", "tokens_to_target"),
            "april_seconds_ratio": seed_ratio("april", "seconds_to_target"),
            "dps_rollouts_ratio": ratio("dps", "rollouts_to_target"),
            "xrpo_tokens_to_target_ratio": ratio("xrpo", "tokens_to_target"),
            "vade_tokens_to_target_ratio": ratio("vade", "tokens_to_target"),
            "insight_tokens_to_target_ratio": ratio("insight", "tokens_to_target"),
            "cures_pass1_delta": paired("cures", "final_pass1"),
            "cures_tokens_to_target_ratio": ratio("cures", "tokens_to_target"),
            "v0_brier": median_of("v0", "v0_brier"),
            "v0_brier_const": median_of("v0", "v0_brier_const"),
            "v0_auc": median_of("v0", "v0_auc"),
            "v0_tokens_to_target_ratio": ratio("v0", "tokens_to_target"),
            "xrpo_icl_tokens_to_target_ratio": ratio("xrpo_icl", "tokens_to_target"),
            "d3s_tokens_to_target_ratio": ratio("d3s", "tokens_to_target"),
            "mssr_tokens_to_target_ratio": ratio("mssr", "tokens_to_target"),
            "mssr_steps_to_target_ratio": ratio("mssr", "steps_to_target"),
            "brorl_pass1_delta": paired("brorl", "final_pass1"),
            "brorl_tokens_to_target_ratio": ratio("brorl", "tokens_to_target"),
            "scope_pass1_delta": paired("scope", "final_pass1"),
            "scope_diversity_ratio": ratio("scope", "distinct_correct"),
            "scope_tokens_to_target_ratio": ratio("scope", "tokens_to_target"),
            "nudge_tokens_to_target_ratio": ratio("nudge", "tokens_to_target"),
            "nudge_pass1_delta": paired("nudge", "final_pass1"),
            "nudge_diversity_ratio": ratio("nudge", "distinct_correct"),
            "dora_pass1_delta": (statistics.mean(r["dora_acc"] - r["solution_acc"]
                                                 for r in searched) if searched else None)}
    if searched:
        out["search"] = {k: statistics.median(r[k] for r in searched)
                         for k in ("dora_acc", "solution_acc", "directions")}
    out.update({k: v for k, v in keys.items() if v is not None})
    return out


HEADLINE = ("latr_tokens_to_target_ratio", "latr_mixed_share_ratio", "echo_ttrl_pass1_delta",
            "echo_label_acc_delta", "arrol_speedup", "duet50_pass1_delta", "sgpo_compute_ratio",
            "dars_compute_ratio", "april_seconds_ratio", "dps_rollouts_ratio",
            "xrpo_tokens_to_target_ratio", "vade_tokens_to_target_ratio",
            "insight_tokens_to_target_ratio", "cures_pass1_delta", "v0_brier",
            "xrpo_icl_tokens_to_target_ratio", "dora_pass1_delta",
            "d3s_tokens_to_target_ratio", "mssr_tokens_to_target_ratio", "brorl_pass1_delta",
            "scope_pass1_delta", "scope_diversity_ratio", "nudge_tokens_to_target_ratio")


def arm_list(text: str) -> list[str]:
    arms = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(f"unknown arm(s) {unknown or text!r}; choose from "
                                         f"{', '.join(ARMS)}")
    return arms


def settings_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def load_finished(log: Path, settings: dict[str, str]) -> list[dict]:
    """Runs in the log whose arm was run with the same settings (the rest are ignored)."""
    if not log.exists():
        return []
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    return [settle_target(r) for r in rows
            if "error" not in r and settings.get(r.get("arm")) == r.get("settings")]


def settle_target(r: dict) -> dict:
    """The run's first reach of its target, read again from its curve: a log written while an
    evaluation scoring exactly the target was missed by rounding holds a later one. Rollouts
    to an earlier reach are not in the log (None then)."""
    hit = first_reach(r["curve"], r["target"])
    if hit is None or (r["reached"] and hit["step"] == r["steps_to_target"]):
        return r
    return {**r, "reached": True, "tokens_to_target": hit["tokens"],
            "seconds_to_target": hit["seconds"], "steps_to_target": hit["step"],
            "rollouts_to_target": None}


# each method's own diagnostics, shown beside its baseline's
DIAGNOSTICS = {
    "latr": ("mixed_share", "distinct_answers", "forks", "pruned", "prefix_saved"),
    "echo_ttrl": ("label_acc", "mixed_share", "forks", "pruned", "prefix_saved"),
    "arrol": ("head_auc", "abort_rate", "mixed_share", "rollouts"),
    "duet50": ("abort_rate", "mixed_share", "rollouts"),
    "sgpo": ("group_size", "group_size_max", "mixed_share"),
    "dars": ("group_size", "group_size_max", "mixed_share"),
    "april": ("stale_share", "gen_seconds", "prefilled", "mixed_share", "rollouts"),
    "dps": ("rollouts_to_target", "mixed_share"),
    "xrpo": ("group_size", "group_size_max", "mixed_share"),
    "vade": ("mixed_share", "rollouts"),
    "insight": ("mixed_share", "rollouts"),
    "cures": ("group_smallest", "group_largest", "mixed_share"),
    "v0": ("v0_brier", "v0_brier_const", "v0_auc", "group_smallest", "group_largest",
           "mixed_share"),
    "xrpo_icl": ("seeded", "group_smallest", "group_largest", "mixed_share"),
    "d3s": ("trained_share", "mixed_share"),
    "mssr": ("steps_to_target", "trained_share"),
    "brorl": ("mixed_share", "trained_share", "mass_sampled_correct", "mass_unsampled_correct",
              "mass_sampled_wrong", "mass_unsampled_wrong"),
}


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, list):  # the quality head's AUC per step
        aucs = [x["auc"] if isinstance(x, dict) else x for x in v]
        return f"{aucs[0]:.2f} → {aucs[-1]:.2f}" if aucs else "–"
    if 0 < abs(v) < 1e-3:  # BroRL's mass changes
        return f"{v:.1e}"
    return f"{v:.3f}" if abs(v) < 10 else f"{v:.0f}"


def method_tables(out: dict) -> None:
    """One table per method: per seed, the method against its baseline."""
    runs = {(r["arm"], r["seed"]): r for r in out["runs"]}
    for arm in out["arms"]:
        base = ARMS[arm][0]
        if not base:
            continue
        keys = DIAGNOSTICS.get(arm, ())
        print(f"\n{arm} against {base} (each cell: {base} / {arm})\n")
        print("| seed | tokens to target | s to target | final pass@1 | "
              + " | ".join(k.replace("_", " ") for k in keys) + " |")
        print("|---" * (4 + len(keys)) + "|")
        for seed in out["seeds"]:
            b, m = runs.get((base, seed)), runs.get((arm, seed))
            if not b or not m:
                continue
            # runs recorded before a diagnostic existed show it as "–"
            cell = lambda k, f=_fmt: f"{f(b.get(k))} / {f(m.get(k))}"  # noqa: E731
            to = [f"{b[k]:.0f}{'' if b['reached'] else '*'} / "
                  f"{m[k]:.0f}{'' if m['reached'] else '*'}"
                  for k in ("tokens_to_target", "seconds_to_target")]
            print(f"| {seed} | {to[0]} | {to[1]} | {cell('final_pass1')} | "
                  + " | ".join(cell(k) for k in keys) + " |")
    print("\n(* the target was not reached: the whole budget is counted)")
    machines = sorted({r["machine"] for r in out["runs"] if r.get("machine")})
    if len(machines) > 1:
        print(f"(the runs ran on {len(machines)} machines, {'; '.join(machines)}: seconds "
              "compare only between the runs of one seed)")


def table(out: dict) -> None:
    print("| arm | tokens to target | s to target | reached | final pass@1 | paired Δ pass@1 "
          "| mixed share | forks | prefix saved | abort rate | group size | head AUC |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for a, v in out["medians"].items():
        delta = out["paired_pass1_delta"].get(a)
        auc = v["head_auc_mean"]
        print(f"| {a} | {v['tokens_to_target']:.0f} | {v['seconds_to_target']:.0f} | "
              f"{v['reached']}/{v['seeds']} | {v['final_pass1']:.3f} | "
              f"{'–' if delta is None else f'{delta:+.3f}'} | {v['mixed_share']:.3f} | "
              f"{v['forks']:.0f} | {v['prefix_saved']:.0f} | {v['abort_rate']:.3f} | "
              f"{v['group_size']:.1f} | {'–' if auc is None else f'{auc:.2f}'} |")
    if out.get("search"):
        s = out["search"]
        print(f"\ndora: held-out search accuracy {s['dora_acc']:.3f} against solution-level "
              f"{s['solution_acc']:.3f} (medians), {s['directions']:.2f} directions a prompt")
    method_tables(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="rollwise bench methods", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=CONFIG, help="run config (\"\": the defaults)")
    p.add_argument("--arms", type=arm_list, default=["latr", "arrol", "duet50"],
                   help=f"comma- or space-separated, from: {','.join(ARMS)}")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--tokens", type=float, default=40_000,
                   help="generated-token budget of each run (DUET-50: half)")
    p.add_argument("--eval-tokens", type=float, default=8_000,
                   help="evaluate after each further this many decoded tokens")
    p.add_argument("--gain", type=float, default=0.1,
                   help="target: the warm start's held-out pass@1 plus this")
    p.add_argument("--pool", type=int, default=64,
                   help="recurring prompt pool of the dynamic and dps arms (task.train_size)")
    p.add_argument("--search-budget", type=int, default=16,
                   help="the dora arm: rollouts per held-out prompt (run.eval_samples)")
    p.add_argument("--sgpo-prompts", type=int, default=64,
                   help="prompts sGPO profiles (its pass counts in its budget)")
    p.add_argument("--profile-prompts", type=int, default=64,
                   help="training prompts of the profiling pass on the warm start")
    p.add_argument("--init", help="warm-start model folder (default: the config's model, or "
                                  "its SFT warm start)")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs side by side in this many processes (one torch thread each)")
    p.add_argument("--root", default="runs/bench-methods")
    p.add_argument("--fresh", action="store_true", help="ignore the runs already in the log")
    p.add_argument("--json", action="store_true")
    p.add_argument("--report", metavar="JSON",
                   help="print the tables of a saved --json output and exit (runs nothing)")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = p.parse_args(argv)
    # `--arms a b` (as the other benches take them): b lands among the overrides
    loose = [o for o in args.overrides if "=" not in o]
    unknown = [o for o in loose if o not in ARMS]
    if unknown:
        p.error(f"{', '.join(map(repr, unknown))}: neither an arm ({','.join(ARMS)}) nor an "
                "override section.key=value")
    args.arms = args.arms + [o for o in loose if o not in args.arms]
    args.overrides = [o for o in args.overrides if "=" in o]
    if args.report:
        out = json.loads(Path(args.report).read_text())
        table(out)
        return print_keys_and_failures(out, HEADLINE, out["failed"], lambda r: r["arm"])
    config = args.config or None
    base = BENCH_RUN + args.overrides
    init = warm_start_of(config, base, args.root, args.init)
    prof = cached_profile(Path(args.root) / "profile.json", config, base, init,
                          args.profile_prompts)
    print("profile: " + json.dumps(prof["stats"]), file=sys.stderr, flush=True)
    arms = with_baselines(args.arms)
    threads = ["run.threads=1"] if args.jobs > 1 else []
    per_arm = {a: BENCH_RUN + ARMS[a][1]
               + ([ttrl_reward(config, base)] if a in TTRL_ARMS else [])
               + [o for m in ARMS[a][2] for o in prof["overrides"][m]]
               + ([f"task.train_size={args.pool}"] if a in POOLED else [])
               + ([f"control.sgpo.profile_prompts={args.sgpo_prompts}"] if a == "sgpo" else [])
               + ([f"run.eval_samples={args.search_budget}"] if a in TEST_TIME else [])
               + args.overrides + arm_last(a, config, base)
               for a in arms}  # the command's overrides win, but for arm_last
    # a run's thread count is how it ran, like its machine, not what it ran: runs side by side
    # (--jobs) and one at a time reuse each other's
    settings = {a: settings_key(config, per_arm[a], args.tokens, args.eval_tokens, args.gain,
                                init) for a in arms}
    log = Path(args.root) / "runs.jsonl"
    done = [] if args.fresh else load_finished(log, settings)
    have = {(r["arm"], r["seed"]) for r in done}
    jobs = [(config, per_arm[a] + threads, a, s, args.tokens, args.eval_tokens, args.gain,
             args.root, init, settings[a]) for a in arms for s in args.seeds if (a, s) not in have]
    if done:
        print(f"reusing {len(done)} finished run(s) from {log}", file=sys.stderr, flush=True)
    new, failed = execute(_run, jobs, args.jobs, log,
                          lambda j: {"arm": j[2], "seed": j[3]}, append=not args.fresh)
    runs = [r for r in done + new if r["arm"] in arms and r["seed"] in args.seeds]
    for r in runs:
        if r.get("distinct_correct") is None and r["arm"] not in TEST_TIME:
            r["distinct_correct"] = store_diversity(Path(args.root) / f"{r['arm']}-{r['seed']}")
    out = {"config": args.config, "tokens": args.tokens, "eval_tokens": args.eval_tokens,
           "gain": args.gain, "init": init, "seeds": args.seeds, "arms": arms,
           "overrides": args.overrides, "per_arm": per_arm, "profile": prof,
           **summarize(runs, args.seeds), "runs": runs, "failed": failed}
    if args.json:
        print(json.dumps(out, indent=2))
        return 1 if failed else 0
    table(out)
    return print_keys_and_failures(out, HEADLINE, failed, lambda r: r["arm"])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
