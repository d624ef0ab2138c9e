"""The Filter stage: verifiers chosen and weighted by name in the config, run on whole groups.

    stage = build_filter(cfg.filter, task)
    metrics = stage.score(samples, problems, texts)   # sets rewards, reward, reward_info, status

Each configured verifier fills its channel in `sample.rewards`; `sample.reward` is the
weighted sum (the composite; GDPO reads the channels separately). A sample any of whose
verifiers failed (raised, hung, crashed, returned garbage) gets status FAILED, reward 0 and
the reason; the metrics count failures by cause as `filter/failed/<cause>`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rollwise import registry
from rollwise.stages.filter.base import (
    DEADLINE,
    ERROR,
    Item,
    Verdict,
    Verifier,
    clipped,
    score_checked,
)
from rollwise.stages.filter.code_verifier import CodeVerifier
from rollwise.stages.filter.exact import EnvRewardVerifier, ExactVerifier, TaskScoreVerifier
from rollwise.stages.filter.fmt import FormatVerifier, LengthVerifier
from rollwise.stages.filter.judge import JudgeVerifier
from rollwise.stages.filter.majority import MajorityVerifier
from rollwise.stages.filter.math_verifier import GymVerifier, MathVerifier
from rollwise.stages.filter.sandbox import SandboxLimits
from rollwise.stages.filter.user import user_verifier
from rollwise.tasks.extract import make_extractor
from rollwise.types import Status

CORRECTNESS = ("exact", "math", "math_verify", "gym", "code")
SHAPING = ("format", "length", "judge", "majority")


def make_verifier(name: str, cfg, task) -> Verifier:
    """The verifier `name` stands for (cfg: FilterConfig): a registered name (rollwise.registry,
    kind 'verifier') built as factory(cfg, task), or a user's 'package.module:attr' reward
    function or Verifier class (rollwise.stages.filter.user)."""
    if registry.is_dotted(name):
        return user_verifier(name)
    verifier = registry.resolve("verifier", name, "filter.reward")(cfg, task)
    return registry.conform(verifier, Verifier, "filter.reward")


def build_exact(cfg, task) -> Verifier:
    return TaskScoreVerifier(task) if task.score_fn else ExactVerifier()


def build_env(cfg, task) -> Verifier:
    return EnvRewardVerifier()


def build_math(cfg, task) -> Verifier:
    return MathVerifier(cfg.timeout_s)


def build_gym(cfg, task) -> Verifier:
    return GymVerifier()


def build_code(cfg, task) -> Verifier:
    s = cfg.sandbox
    limits = SandboxLimits(timeout_s=s.timeout_s, cpu_s=s.cpu_s, memory_mb=s.memory_mb,
                           max_processes=s.max_processes, max_output_kb=s.max_output_kb,
                           guard=s.guard)
    return CodeVerifier(limits, cfg.code_reward)


def build_format(cfg, task) -> Verifier:
    return FormatVerifier(cfg.format_pattern)


def build_length(cfg, task) -> Verifier:
    return LengthVerifier(cfg.length_max, cfg.length_buffer)


def build_judge(cfg, task) -> Verifier:
    j = cfg.judge
    return JudgeVerifier(j.rubric, j.fapo, j.model, j.max_new_tokens)


def build_majority(cfg, task) -> Verifier:
    return MajorityVerifier(min_ratio=cfg.majority_min_ratio)


def weights_of(reward: str | dict[str, float]) -> dict[str, float]:
    weights = {reward: 1.0} if isinstance(reward, str) else dict(reward)
    if not weights:
        raise ValueError("filter.reward = {}: name at least one verifier")
    return weights


@dataclass
class Channel:
    key: str  # the channel's name: the verifier's, or a user function's own name
    weight: float
    verifier: Verifier


class FilterStage:
    def __init__(self, channels: list[Channel], extract, workers: int = 0,
                 timeout_s: float = 10.0):
        self.channels, self.extract = channels, extract
        self.timeout_s = timeout_s
        isolated = {c.verifier.name: c.verifier for c in channels if c.verifier.isolated}
        self.pool = None
        if isolated and workers > 0:
            # deferred: pool.py is also each worker's main module (python -m ...pool), which
            # the package must not have imported already
            from rollwise.stages.filter.pool import VerifierPool
            self.pool = VerifierPool(isolated, workers, timeout_s)

    def unbounded(self) -> list[str]:
        """Channels whose user code runs in this process, where no timeout can stop it."""
        return [c.key for c in self.channels if c.verifier.user_code
                and (not c.verifier.isolated or self.pool is None)]

    def attach_engine(self, engine, tokenizer) -> None:
        """Give verifiers that generate (the judge) an engine, e.g. the policy's own."""
        for c in self.channels:
            c.verifier.attach(engine, tokenizer)

    def items(self, samples, problems, texts) -> list[Item]:
        out, group, last = [], -1, object()
        for s, p, text in zip(samples, problems, texts):
            gid = getattr(s, "group_id", None) or getattr(s, "prompt_id", None)
            if gid != last:
                group, last = group + 1, gid
            out.append(Item(text, p, None, getattr(s, "num_tokens", 0), group,
                            dict(getattr(s, "meta", None) or {})))
        return out

    def verdicts(self, items: list[Item], deadline: float | None = None,
                 on_progress=None) -> list[dict[str, Verdict]]:
        """Per item, each channel's verdict (extraction first, then every verifier). Past
        `deadline` (a monotonic time), what is not scored yet fails with DEADLINE; a pooled
        verifier reports on_progress(done, total) while it runs."""
        if deadline is not None and time.monotonic() > deadline:
            late = Verdict.failure(DEADLINE, "not scored before the deadline")
            return [{c.key: late for c in self.channels} for _ in items]
        bad_extract: dict[int, Verdict] = {}
        for i, it in enumerate(items):
            try:
                it.answer = self.extract(it.text)
            except Exception as e:
                bad_extract[i] = Verdict.failure(ERROR, f"extract: {type(e).__name__}: {e}")
        per_channel: dict[str, list[Verdict]] = {}
        pooled = [c for c in self.channels if c.verifier.isolated and self.pool is not None]
        for c in self.channels:
            if c in pooled:
                continue
            if c.verifier.isolated:  # no pool: still one item at a time, so one bad fails one
                per_channel[c.key] = [score_checked(c.verifier, [it])[0] for it in items]
            else:
                per_channel[c.key] = score_checked(c.verifier, items)
        if pooled:
            jobs = [(c.verifier.name, it) for c in pooled for it in items]
            flat = self.pool.run(jobs, deadline, on_progress)
            for k, c in enumerate(pooled):
                per_channel[c.key] = flat[k * len(items):(k + 1) * len(items)]
        return [{**{c.key: per_channel[c.key][i] for c in self.channels},
                 **({"extract": bad_extract[i]} if i in bad_extract else {})}
                for i in range(len(items))]

    def combine(self, verdicts: dict[str, Verdict]) -> tuple[dict[str, float], float, str, Any]:
        """(channels, weighted reward, info, failure cause or None) of one sample."""
        failed = [(k, v) for k, v in verdicts.items() if v.failed]
        if failed:
            why = "; ".join(f"{k} failed ({v.failed}): {v.info}" for k, v in failed)
            return {}, 0.0, clipped(why), failed[0][1].failed
        rewards: dict[str, float] = {}
        for c in self.channels:  # a verifier may add channels; its own is named c.key
            rewards.update(verdicts[c.key].rewards)
        reward = sum(c.weight * rewards[c.key] for c in self.channels)
        if len(self.channels) == 1:
            info = verdicts[self.channels[0].key].info
        else:
            info = "; ".join(f"{c.key}: {verdicts[c.key].info}" for c in self.channels)
        return rewards, reward, clipped(info), None

    def score(self, samples, problems, texts) -> dict[str, float]:
        t0 = time.perf_counter()
        items = self.items(samples, problems, texts)
        causes: Counter[str] = Counter()
        sums: Counter[str] = Counter()
        for s, verdicts in zip(samples, self.verdicts(items)):
            s.rewards, s.reward, s.reward_info, cause = self.combine(verdicts)
            if cause:
                s.status = Status.FAILED
                causes[cause] += 1
            else:
                sums.update({c.key: s.rewards[c.key] for c in self.channels})
        m: dict[str, float] = {f"filter/failed/{k}": float(v) for k, v in causes.items()}
        m["filter/failed"] = float(sum(causes.values()))
        ok = max(len(samples) - sum(causes.values()), 1)
        if len(self.channels) > 1:
            m.update({f"filter/reward/{c.key}": sums[c.key] / ok for c in self.channels})
        for c in self.channels:
            m.update(c.verifier.metrics() or {})
        m["perf/filter_seconds"] = time.perf_counter() - t0
        return m

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def build_filter(cfg, task) -> FilterStage:
    """The configured Filter stage (cfg: rollwise.config.FilterConfig)."""
    channels = []
    for spec, w in weights_of(cfg.reward).items():
        verifier = make_verifier(spec, cfg, task)
        if ":" not in spec:  # a user's verifier keeps its name ('pkg.mod:fn' fills 'fn')
            verifier.name = spec
        elif not verifier.name:
            verifier.name = spec.rsplit(":", 1)[-1]
        channels.append(Channel(verifier.name, float(w), verifier))
    names = [c.key for c in channels]
    if len(set(names)) < len(names):
        raise ValueError(f"filter.reward: two verifiers fill the same channel in {names}")
    return FilterStage(channels, make_extractor(cfg.extract, task), cfg.workers, cfg.timeout_s)
