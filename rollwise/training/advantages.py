"""Advantage estimators: pure functions of per-sample rewards and group membership, chosen by
name (`train.advantage`) through rollwise.registry.

    fn(AdvantageInputs) -> AdvantageOutput(advantages (N,), keep (N,) bool)

`keep` is False for a sample that must leave the loss (MC-GRPO's median pivot). An estimator
that credits a sample's turns apart (TRACE's tree) also returns `segments`: sample index ->
[(first response token, advantage), ...], each holding until the next. A second,
token-level hook (`train.token_shaping`) rescales the broadcast advantages per token; ECHO's
entropy-confidence scaling plugs in there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from rollwise import registry
from rollwise.training.cod import baseline_advantages, red_reweight
from rollwise.training.tree_credit import TreeRecord, tree_advantages


@dataclass
class AdvantageInputs:
    rewards: torch.Tensor  # (N,) float: the scalar reward of each sample
    group_index: torch.Tensor  # (N,) long: which prompt group each sample belongs to
    channels: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (N,), for GDPO
    channel_weights: dict[str, float] = field(default_factory=dict)  # missing name -> 1.0
    meta: list[dict] = field(default_factory=list)  # each sample's meta (CoD's keys, returns)
    tokens: torch.Tensor | None = None  # (N,) trained tokens per sample (CoD's RED weights)
    partial_channels: dict[str, str] = field(default_factory=dict)  # channel -> a sample
    # that lacks it (GDPO needs every channel on every sample)
    logprob_means: torch.Tensor | None = None  # (N,) mean behaviour log p of trained tokens
    sharpen: tuple[float, float] = (1.0, 0.5)  # XRPO's (lambda, kappa): train.sharpen
    nudge_inter: float = 1.1  # NudgeRL's lambda: train.nudge.inter_weight


@dataclass
class AdvantageOutput:
    advantages: torch.Tensor  # (N,)
    keep: torch.Tensor  # (N,) bool
    metrics: dict[str, float] = field(default_factory=dict)
    # sample index -> [(first response token, advantage), ...] in order: per-turn credit that
    # replaces the sample's advantage from each start on (the first start is 0)
    segments: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


def get_advantage(name: str):
    return registry.resolve("advantage", name, "train.advantage")


def get_token_shaping(name: str):
    return registry.resolve("token_shaping", name, "train.token_shaping")


# ---------------------------------------------------------------------------------- helpers

def group_stats(values: torch.Tensor, group_index: torch.Tensor):
    """Per-sample mean and (unbiased) std of the sample's group. values (N,) -> (N,), (N,).
    A group of one has std 0; a group of equal values has exactly their value as its mean and
    std 0, so r - mean is exactly 0 there (a float mean of six 0.3s misses by an ulp, and
    dividing that by an std below eps would give the group a signal it does not have)."""
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    k = len(counts)
    sums = torch.zeros(k, dtype=values.dtype).index_add_(0, inverse, values)
    lo = values.new_full((k,), math.inf).scatter_reduce_(0, inverse, values, "amin")
    hi = values.new_full((k,), -math.inf).scatter_reduce_(0, inverse, values, "amax")
    mean = torch.where(lo == hi, lo, sums / counts)
    sq = torch.zeros(k, dtype=values.dtype).index_add_(
        0, inverse, (values - mean[inverse]) ** 2)
    std = (sq / (counts - 1).clamp_min(1)).sqrt()
    return mean[inverse], std[inverse]


def flat_mean(values: torch.Tensor) -> torch.Tensor:
    """values.mean(), exactly the value when all are equal (see group_stats)."""
    return values[0] if values.numel() and bool((values == values[0]).all()) else values.mean()


def _groups(group_index: torch.Tensor) -> list[torch.Tensor]:
    """Indices of each group's samples, in order of first appearance."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    return [(inverse == k).nonzero().squeeze(-1) for k in range(int(inverse.max()) + 1)] \
        if len(group_index) else []


def whiten(values: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) / (std + eps) over the whole batch (unbiased std; one sample -> x - mean);
    equal values give exactly 0."""
    std = values.std() if values.numel() > 1 else values.new_zeros(())
    return (values - flat_mean(values)) / (std + eps)


def _out(adv: torch.Tensor, keep: torch.Tensor | None = None, **metrics) -> AdvantageOutput:
    keep = torch.ones_like(adv, dtype=torch.bool) if keep is None else keep
    return AdvantageOutput(adv, keep, {k: float(v) for k, v in metrics.items()})


# ------------------------------------------------------------------------------- estimators

def grpo(x: AdvantageInputs, eps: float = 1e-6) -> AdvantageOutput:
    """GRPO (Shao et al. 2024, DeepSeekMath, eq. 3 with outcome supervision, §4.1.2):
    A_i = (r_i - mean_g r) / (std_g r + eps), std unbiased as in TRL and verl.
    A group with equal rewards gets zeros."""
    r = x.rewards.float()
    mean, std = group_stats(r, x.group_index)
    return _out((r - mean) / (std + eps))


def dr_grpo(x: AdvantageInputs) -> AdvantageOutput:
    """Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", the Dr.GRPO objective):
    A_i = r_i - mean_g r, with no division by the group std. The other half of Dr.GRPO, no
    1/|o_i| length normalisation, is the loss aggregation `seq-mean-token-sum-norm`."""
    r = x.rewards.float()
    mean, _ = group_stats(r, x.group_index)
    return _out(r - mean)


def rloo(x: AdvantageInputs) -> AdvantageOutput:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): leave-one-out baseline
    A_i = r_i - 1/(G-1) sum_{j != i} r_j = G/(G-1) (r_i - mean_g r). A group of one gets 0."""
    r = x.rewards.float()
    mean, _ = group_stats(r, x.group_index)
    _, inverse, counts = torch.unique(x.group_index, return_inverse=True, return_counts=True)
    g = counts[inverse].float()
    scale = torch.where(g > 1, g / (g - 1).clamp_min(1), torch.zeros_like(g))
    return _out(scale * (r - mean))


def cod(x: AdvantageInputs) -> AdvantageOutput:
    """Connect-the-Dots (docs/methods.md#cod): each sample's reward-to-go over its pack
    (meta['cod_return']) minus the mean over the samples with the same (pack, episode type,
    index) (meta['cod_key']), then RED reweighting by trained tokens (rollwise.training.cod)."""
    missing = [i for i, m in enumerate(x.meta) if "cod_key" not in m or "cod_return" not in m]
    if missing or len(x.meta) != len(x.rewards):
        raise ValueError("train.advantage = 'cod' needs every sample's meta['cod_key'] (pack, "
                         "episode type, index) and meta['cod_return'] (its reward-to-go), as a "
                         "Connect-the-Dots generator writes them")
    adv = baseline_advantages([(tuple(m["cod_key"]), float(m["cod_return"])) for m in x.meta])
    tokens = x.tokens.tolist() if x.tokens is not None else [1] * len(adv)
    adv, t = red_reweight(adv, tokens)
    out = _out(torch.tensor(adv, dtype=torch.float))
    out.metrics["red_temperature"] = float(t) if t is not None else 0.0
    return out


def trace(x: AdvantageInputs) -> AdvantageOutput:
    """TRACE (docs/methods.md#trace): each reward minus the mean over the samples continued from
    the same prefix (meta['trace_anchor'], written by generate.strategy=trace)."""
    if len(x.meta) != len(x.rewards) or any("trace_anchor" not in m for m in x.meta):
        raise ValueError("train.advantage = 'trace' needs every sample's meta['trace_anchor'], "
                         "as generate.strategy=trace writes it")
    keys = [m["trace_anchor"] for m in x.meta]
    return _out(torch.tensor(baseline_advantages(list(zip(keys, x.rewards.tolist()))),
                             dtype=torch.float))


def trace_tree(x: AdvantageInputs) -> AdvantageOutput:
    """TRACE with per-turn credit from the whole tree (rollwise.agents.trace.tree_advantages):
    a root episode's turn k gets the value of the prefix after it less the value of the prefix
    before it, each estimated from every episode that passed through; a continuation gets its
    reward less its anchor's value. With no continuations below a root it equals `trace`."""
    if len(x.meta) != len(x.rewards) or any("trace_anchor" not in m for m in x.meta):
        raise ValueError("train.advantage = 'trace_tree' needs every sample's "
                         "meta['trace_anchor'] (and a root's meta['trace_cuts']), as "
                         "generate.strategy=trace writes them")
    records = [TreeRecord(m["trace_anchor"], r, [(int(o), k) for o, k in m.get("trace_cuts", ())])
               for m, r in zip(x.meta, x.rewards.tolist())]
    segs = tree_advantages(records)
    out = _out(torch.tensor([s[-1][1] for s in segs], dtype=torch.float))
    out.segments = {i: s for i, s in enumerate(segs) if len(s) > 1}
    return out


def reinforce_pp(x: AdvantageInputs, eps: float = 1e-6) -> AdvantageOutput:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): no critic, no group baseline;
    the outcome reward (minus the KL penalty when kl_mode='reward') is whitened over the
    whole batch: A_i = (r_i - mean_B r) / (std_B r + eps)."""
    return _out(whiten(x.rewards.float(), eps))


def reinforce_pp_baseline(x: AdvantageInputs, eps: float = 1e-6) -> AdvantageOutput:
    """REINFORCE++-baseline (Hu et al. 2025): subtract the group mean first, then whiten
    over the batch: A_i = whiten_B(r_i - mean_g r)."""
    r = x.rewards.float()
    mean, _ = group_stats(r, x.group_index)
    return _out(whiten(r - mean, eps))


def xrpo(x: AdvantageInputs) -> AdvantageOutput:
    """GRPO with XRPO's novelty-aware sharpening (Bamba et al. 2025; docs/methods.md#xrpo): a
    response with a positive advantage whose sequence likelihood is low for its group gets
    more, A + min(max(lambda (1 - eta), 0), kappa A), eta = exp(s - mean_group s), s its mean
    token log-probability under the policy that sampled it. Responses at or below their
    group's mean reward keep A, so a bonus never goes to a wrong answer, and is at most kappa A."""
    if x.logprob_means is None:
        raise ValueError("train.advantage = xrpo needs each sample's log-probabilities")
    base = grpo(x).advantages
    s = x.logprob_means.float()
    mean_s, _ = group_stats(s, x.group_index)
    lam, kappa = x.sharpen
    bonus = torch.minimum((lam * (1 - torch.exp(s - mean_s))).clamp(min=0), kappa * base)
    bonus = torch.where(base > 0, bonus, torch.zeros_like(base))
    return _out(base + bonus, sharpened=(bonus > 0).sum(), bonus_max=bonus.max())


def mssr(x: AdvantageInputs) -> AdvantageOutput:
    """Single-rollout advantage (MSSR; docs/methods.md#mssr): A_i = r_i - b_i, b_i the
    sample's group-free baseline from earlier steps (meta["baseline"], control.baseline), so a
    group of one still has a signal. Pair it with train.token_shaping=entropy, MSSR's bound."""
    if len(x.meta) != len(x.rewards) or any("baseline" not in m for m in x.meta):
        raise ValueError("train.advantage = mssr needs each sample's baseline (meta "
                         "'baseline'): set control.baseline = running or v0")
    b = torch.tensor([float(m["baseline"]) for m in x.meta])
    return _out(x.rewards.float() - b, baseline_mean=b.mean())


def nudge_split(r: torch.Tensor, contexts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One group's rewards split as r - mean = intra + inter: a nudged rollout's intra part is
    r less its context's mean, its inter part that mean less the group's; a plain rollout
    (context -1) is all intra. Both (G,)."""
    mean = flat_mean(r)
    intra, inter = r - mean, torch.zeros_like(r)
    for c in set(contexts) - {-1}:
        at = torch.tensor([k == c for k in contexts])
        intra[at] = r[at] - flat_mean(r[at])
        inter[at] = flat_mean(r[at]) - mean
    return intra, inter


def nudge(x: AdvantageInputs, eps: float = 1e-5) -> AdvantageOutput:
    """NudgeRL (strategy nudging; docs/methods.md#nudgerl, tally0818/NudgeRL): per group,
    A = intra + lambda inter (nudge_split, each rollout's context in meta["nudge"], -1 or
    absent for a plain one), then whitened within the group with the population std (eps
    added), as the public code does. lambda = 1 is GRPO's centring before whitening."""
    r = x.rewards.float()
    contexts = [int(m.get("nudge", -1)) for m in x.meta] if x.meta else [-1] * len(r)
    adv = torch.zeros_like(r)
    inter_abs = []
    for idx in _groups(x.group_index):
        intra, inter = nudge_split(r[idx], [contexts[i] for i in idx.tolist()])
        a = intra + x.nudge_inter * inter
        adv[idx] = (a - flat_mean(a)) / (a.std(unbiased=False) + eps)
        inter_abs.append(float(inter.abs().mean()))
    nudged = sum(c >= 0 for c in contexts) / max(len(contexts), 1)
    return _out(adv, nudged_share=nudged,
                inter_abs=sum(inter_abs) / max(len(inter_abs), 1))


def mc_grpo(x: AdvantageInputs, eps: float = 1e-3) -> AdvantageOutput:
    """MC-GRPO (median-centred GRPO; docs/methods.md#mc-grpo, lotusroot-kim/MC-GRPO):
    A_i = (r_i - median_g r) / (MAD_g + eps), MAD_g = median_g |r - median_g r|, and the
    pivot sample (the one at the median rank; the lower middle for an even group) is dropped
    from the loss, so G+1 rollouts give G gradients. With binary rewards MAD is often 0 and
    |A| = 1/eps = 1000: finite, but scale-sensitive; cap it with train.advantage_clip."""
    r = x.rewards.float()
    adv = torch.zeros_like(r)
    keep = torch.ones_like(r, dtype=torch.bool)
    mad_zero = 0
    for idx in _groups(x.group_index):
        g = r[idx]
        order = torch.argsort(g, stable=True)
        pivot = order[(len(g) - 1) // 2]  # torch.median's lower middle, as an index
        med = g[pivot]
        mad = (g - med).abs().median()
        mad_zero += int(mad == 0)
        adv[idx] = (g - med) / (mad + eps)
        if len(g) > 1:  # a lone sample is its own median; dropping it would leave nothing
            keep[idx[pivot]] = False
    return _out(adv, keep, mad_zero_groups=mad_zero)


def gdpo(x: AdvantageInputs, eps: float = 1e-4) -> AdvantageOutput:
    """GDPO (NVlabs, group reward-decoupled normalisation; docs/methods.md#gdpo): each reward
    channel k is normalised within its group, A_k = (r_k - mean_g r_k) / (std_g r_k + eps);
    the channels are summed with weights w_k and the sum is whitened over the batch,
    A = whiten_B(sum_k w_k A_k). GRPO normalises the *sum*, which maps distinct channel
    combinations with equal totals to one advantage; GDPO keeps them apart."""
    if x.partial_channels:
        name, uid = next(iter(x.partial_channels.items()))
        raise ValueError(f"train.advantage = 'gdpo': sample {uid} lacks reward channel "
                         f"{name!r}; every sample needs the same channels")
    if not x.channels:
        raise ValueError("train.advantage = 'gdpo' needs named reward channels "
                         "(Sample.rewards); none were given")
    unknown = set(x.channel_weights) - set(x.channels)
    if unknown:
        raise ValueError(f"train.reward_weights names channel(s) {sorted(unknown)} that the "
                         f"samples lack; they have {sorted(x.channels)}")
    total = torch.zeros_like(x.rewards, dtype=torch.float)
    for name, values in x.channels.items():
        mean, std = group_stats(values.float(), x.group_index)
        total = total + x.channel_weights.get(name, 1.0) * (values - mean) / (std + eps)
    return _out(whiten(total, eps))


# ------------------------------------------------------------------------- token shaping

def no_shaping(token_advantages: torch.Tensor, batch) -> torch.Tensor:
    """Identity: every response token carries its sample's advantage."""
    return token_advantages


ENTROPY_ALPHA, ENTROPY_KAPPA = 0.4, 2.0  # the entropy-based shaping's published constants


def entropy_shaping(token_advantages: torch.Tensor, batch) -> torch.Tensor:
    """Entropy-based advantage shaping (train.token_shaping=entropy; MSSR's stabiliser):
    A_t = A + min(alpha H_t, |A| / kappa), H_t the pre-update policy's entropy at the token
    (no gradient through it). The term is at most |A| / kappa, so a token's advantage never
    changes sign and its magnitude stays within (1 + 1/kappa) |A|, where high entropy would
    otherwise let a rare token's update grow without bound; A = 0 stays 0."""
    h = batch.policy_entropy[:, :token_advantages.shape[1]]
    bonus = torch.minimum(ENTROPY_ALPHA * h, token_advantages.abs() / ENTROPY_KAPPA)
    return token_advantages + bonus


entropy_shaping.needs_policy_stats = True  # Trainer.prepare fills Batch.policy_entropy


def compute_advantages(name: str, x: AdvantageInputs,
                       clip: float | None = None) -> AdvantageOutput:
    """Run the named estimator, optionally cap |A| at `clip`, and add summary metrics."""
    out = get_advantage(name)(x)
    adv = out.advantages
    if not torch.isfinite(adv).all() or any(
            not math.isfinite(a) for seg in out.segments.values() for _, a in seg):
        raise FloatingPointError(f"train.advantage = {name!r} produced non-finite advantages")
    if clip is not None:
        out.metrics["clipped"] = float((adv.abs() > clip).sum())
        adv = adv.clamp(-clip, clip)
        out.segments = {i: [(t, max(-clip, min(clip, a))) for t, a in seg]
                        for i, seg in out.segments.items()}
    kept = adv[out.keep]
    out.advantages = adv
    out.metrics.update(
        mean=float(kept.mean()) if kept.numel() else 0.0,
        abs_max=float(kept.abs().max()) if kept.numel() else 0.0,
        zero_frac=float((kept == 0).float().mean()) if kept.numel() else 0.0,
        dropped_samples=float((~out.keep).sum()))
    return out
