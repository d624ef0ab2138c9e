"""The trainer: groups of scored samples -> advantages -> importance correction ->
minibatched policy-gradient steps (with gradient accumulation over micro-batches).

Log-probabilities are recomputed by the trainer: the proximal ("old") policy once at the start
of the update, the current one per micro-batch, and, with `train.correction.snapshots`, the
policy of the version that sampled each stale token. The engine's behaviour log-probabilities
travel in the Batch; rollwise.training.correction turns them into loss weights and masks.

Every choice is a name in TrainConfig: advantage, token_shaping, loss, loss_agg, kl_estimator,
correction.mode/level/anchor. Metrics come back under train/ (adv/, correction/, dropped_tokens/).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rollwise.config import TrainConfig
from rollwise.devices import keep_freed_memory, release_freed_memory
from rollwise.training import correction as corr
from rollwise.training import lora, packed_attention
from rollwise.training.advantages import (
    AdvantageInputs,
    compute_advantages,
    get_token_shaping,
    no_shaping,
)
from rollwise.training.broad import mass_balance, subsample_rows
from rollwise.training.compiled import compile_block_parts
from rollwise.training.confidence import echo_clip, policy_token_stats
from rollwise.training.downsample import keep_fraction, sample_keep, token_keep
from rollwise.training.head import captured_head, chunk_tokens, fusable
from rollwise.training.losses import (
    ZERO_AT_ZERO_ADVANTAGE,
    LossParams,
    aggregate,
    get_kl,
    get_policy_loss,
    masked_mean,
)
from rollwise.training.microbatch import auto_token_budget
from rollwise.training.packing import pack, packed_token_logprobs, worth_packing
from rollwise.training.precision import MasterWeights, adamw_kernel
from rollwise.types import Batch, Group, Sample, Status


def token_logprobs(model, batch: Batch, entropy_grad: bool = False, chunk: int | None = None):
    """log p(target) and entropy per position, (B, T-1) each, from one forward pass.
    The entropy carries a gradient only when entropy_grad (the entropy bonus needs it).
    chunk: from the last hidden state, that many tokens at a time (rollwise.training.head),
    at the response targets only (every real target when the batch has no prompt lengths);
    other columns hold 0. None: through the full logits, at every column."""
    return _padded_pass(model, batch, entropy_grad, chunk)[0]


@torch.no_grad()
def chunked_and_full(model, batch: Batch, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) (B, T-1) through the chunked head, and through the model's own logits,
    from one forward pass."""
    (logp, _), logits = _padded_pass(model, batch, False, chunk, keep_logits=True)
    full = _from_logits(logits, batch.input_ids.to(logits.device), False)[0]
    return logp, full.to(batch.input_ids.device)


def _padded_pass(model, batch: Batch, entropy_grad: bool, chunk: int | None,
                 keep_logits: bool = False):
    """((log p, entropy), the model's logits if chunk and keep_logits)."""
    dev, home = model.device, batch.input_ids.device  # the model's device; the batch stays home
    ids = batch.input_ids.to(dev)
    run = lambda: model(input_ids=ids, attention_mask=batch.attention_mask.to(dev),  # noqa: E731
                        use_cache=False)  # no KV cache: it only copies keys and values
    if not chunk:
        logp, ent = _from_logits(run().logits, ids, entropy_grad)
        return (logp.to(home), ent.to(home)), None
    at = target_columns(batch).nonzero(as_tuple=True)
    with captured_head(model, lambda h: h[:, :-1][at[0].to(dev), at[1].to(dev)],
                       batch.input_ids[:, 1:][at], chunk, entropy_grad, keep_logits) as got:
        logits = run().logits
    return tuple(torch.zeros(batch.loss_mask.shape, dtype=x.dtype).index_put(at, x.to(home))
                 for x in got["out"]), logits if keep_logits else None


def _from_logits(logits: torch.Tensor, ids: torch.Tensor, entropy_grad: bool):
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return _from_logits_chunked(logits, ids)
    logp_all = logits[:, :-1].float().log_softmax(-1)
    logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad):
        ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


@torch.no_grad()
def _from_logits_chunked(logits: torch.Tensor, ids: torch.Tensor):
    """_from_logits without a gradient, a few tokens at a time: the fp32 log-softmax and its
    products over every position would take several times the logits' own memory (about
    2.7 GiB over 4,096 tokens of a 49k vocabulary, more than the rest of an update)."""
    B, T, V = logits.shape
    logp = torch.empty(B, T - 1, device=logits.device)
    ent = torch.empty_like(logp)
    step = chunk_tokens(V, device=logits.device.type)
    for b in range(B):  # row by row: flattening the (B, T-1) slice would copy the logits
        for i in range(0, T - 1, step):
            part = logits[b, i:min(i + step, T - 1)].float().log_softmax(-1)
            logp[b, i:i + step] = part.gather(-1, ids[b, i + 1:i + 1 + len(part), None]).squeeze(-1)
            ent[b, i:i + step] = -(part.exp() * part).sum(-1)
    return logp, ent


CHECK_TOKENS = 4096  # padded tokens of the fast paths' one-time check


def check_rows(batch: Batch) -> torch.Tensor:
    """The first rows, at least two, whose padded size fits CHECK_TOKENS."""
    longest = batch.attention_mask.sum(1).cummax(0).values
    fits = (longest * torch.arange(1, batch.size + 1) <= CHECK_TOKENS).sum()
    return torch.arange(min(batch.size, max(2, int(fits))))


def target_columns(batch: Batch) -> torch.Tensor:
    """(B, T-1) bool: the columns whose target is a response token (a real token after a real
    one where the batch has no prompt lengths)."""
    real = batch.attention_mask[:, 1:].bool() & batch.attention_mask[:, :-1].bool()
    if batch.prompt_lens is None:
        return real
    cols = torch.arange(real.shape[1])
    return real & (cols[None] >= batch.prompt_lens[:, None] - 1)


def enable_checkpointing(model) -> None:
    """Activation checkpointing of a Hugging Face model (transformers >= 5 renamed it)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError("train.gradient_checkpointing: this model has no activation "
                         "checkpointing switch; use a Hugging Face model or turn it off")


@dataclass
class Prepared:
    """Everything an update needs per token, computed once before the minibatch loop."""
    batch: Batch
    anchor: torch.Tensor  # (B, T-1) denominator of the PPO ratio (no grad)
    weights: torch.Tensor  # (B, T-1) importance weights of the loss (no grad)
    mask: torch.Tensor  # (B, T-1) final loss mask after every drop
    token_adv: torch.Tensor  # (B, T-1)
    ref: torch.Tensor | None  # (B, T-1) reference log-probs for the KL loss term
    seq_log_w: torch.Tensor  # (B,) log pi_prox/mu summed over each sequence's kept tokens
    norm_length: int
    # (rows, logp, entropy) of the first minibatch's moving rows, from a pass with gradient
    # taken before the update: the first optimizer step reuses it instead of a second forward
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # sequences and tokens of the step's dropped groups that count in the loss's denominators
    # (train.loss_denominator = generated), spread over the minibatches by their share of rows
    absent: tuple[float, float] = (0.0, 0.0)
    clip: torch.Tensor | None = None  # (B, 1) per-sequence clip eps (train.adaptive_clip)
    before: torch.Tensor | None = None  # (B, T-1) the pre-update log-probs (train.mass_balance)
    # (B,) the rows counted in the loss's denominators (None: all); NudgeRL's distillation
    # rows are not: their term adds to the policy term as the paper's does
    counted: torch.Tensor | None = None
    source: torch.Tensor | None = None  # (B,) the sample each row is (a distillation row's)

    def rows(self, idx: torch.Tensor, T: int) -> dict[str, torch.Tensor | None]:
        cut = lambda x: None if x is None else x[idx][:, :T]  # noqa: E731
        return {"anchor": cut(self.anchor), "weights": cut(self.weights),
                "mask": cut(self.mask), "adv": cut(self.token_adv), "ref": cut(self.ref)}


def _logprob_mean(sample: Sample) -> float:
    """The mean behaviour log-probability of a sample's trained tokens (0 with none)."""
    values = [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m]
    return sum(values) / len(values) if values else 0.0


class Trainer:
    def __init__(self, model, cfg: TrainConfig, *, pad_id: int, seed: int = 0):
        if cfg.lora.rank:
            model = lora.wrap(model, cfg.lora, seed)
        self.adapters = lora.adapter_spec(model) if cfg.lora.rank else None
        # the base never moves under LoRA: its fingerprint, taken once, goes into checkpoints
        self._base = lora.base_fingerprint(model) if self.adapters else None
        self.model = model
        on_cpu = next(model.parameters()).device.type == "cpu"
        if on_cpu:
            keep_freed_memory()  # activations and log-softmax temporaries reuse freed memory
        self._trims = on_cpu and cfg.trim_microbatches
        self.cfg = cfg
        self.pad_id = pad_id
        self.seed = seed
        self.version = 0
        self.loss_fn = get_policy_loss(cfg.loss)
        self.shaping = get_token_shaping(cfg.token_shaping)
        self.kl_fn = get_kl(cfg.kl_estimator)
        self.loss_params = LossParams(cfg.clip_low, cfg.clip_high, cfg.dual_clip_c)
        if cfg.gradient_checkpointing:
            enable_checkpointing(model)
        self.master = MasterWeights.of(model)  # fp32 copies when the parameters are bf16/fp16
        self.optimizer = torch.optim.AdamW(self.params(), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay,
                                           **adamw_kernel(self.params()))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg, s))
        self.ref_model = None  # with LoRA the reference is the model with adapters disabled
        if cfg.kl_coef > 0 and not self.adapters:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if cfg.compile_blocks and not compile_block_parts(model):
            warnings.warn(f"train.compile_blocks: no decoder blocks found in "
                          f"{type(model).__name__}; the model runs eager", RuntimeWarning)
        self._pack = cfg.pack_prompts  # off if the model disagrees
        self._segments = False  # packed rows attended by segments (set by the first check)
        self.token_budget = self._token_budget(model)  # tokens per forward pass, or None
        self._chunk = self._head_chunk(model)  # tokens per head chunk; None: the full logits
        self._checked = False  # the fast paths against the plain one, on the first batch
        self._snapshots: dict[int, dict[str, torch.Tensor]] = {}  # version -> weights
        self._scratch = None  # a model copy that snapshots are loaded into
        self.shard: tuple[int, int] | None = None  # (rank, world): one rank of an FSDP2 trainer

    # ------------------------------------------------------------------ data preparation

    @staticmethod
    def rewards(samples: list[Sample]) -> torch.Tensor:
        """The scalar rewards the estimator sees: Sample.reward, final after Filter."""
        return torch.tensor([float(s.reward) for s in samples], dtype=torch.float)

    def advantage_inputs(self, groups: list[Group], rewards: torch.Tensor) -> AdvantageInputs:
        samples = [s for g in groups for s in g.samples]
        gidx = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
        channels, partial = {}, {}  # every reward channel: those all samples have, and not
        for name in dict.fromkeys(k for s in samples for k in s.rewards):
            missing = [s.uid for s in samples if name not in s.rewards]
            if missing:
                partial[name] = missing[0]
            else:
                channels[name] = torch.tensor([s.rewards[name] for s in samples])
        tokens = torch.tensor([float(sum(s.loss_mask)) for s in samples])
        return AdvantageInputs(rewards, gidx, channels, dict(self.cfg.reward_weights),
                               [s.meta for s in samples], tokens, partial,
                               torch.tensor([_logprob_mean(s) for s in samples]),
                               (self.cfg.sharpen.scale, self.cfg.sharpen.cap),
                               self.cfg.nudge.inter_weight)

    def _version_logprobs(self, batch: Batch, prox: torch.Tensor):
        """pi_v per token from kept snapshots, and where it is known, (B, T-1) each."""
        V, versions, mask = self.version, batch.versions, batch.loss_mask
        newer = versions[mask > 0] > V
        if newer.any():
            raise ValueError(f"a token carries policy version {int(versions[mask > 0].max())}, "
                             f"newer than the trainer's {V}: samples from another run?")
        known = (versions == V) | (mask == 0)
        if not self._snapshots:
            return None, known
        out = prox.clone()
        for v in sorted(set(versions[mask > 0].unique().tolist()) - {V}):
            if v not in self._snapshots:
                continue
            if self._scratch is None:
                self._scratch = copy.deepcopy(self.model).eval().requires_grad_(False)
            self._load_policy(self._scratch, self._snapshots[v])
            rows = (versions == v).any(-1).nonzero().squeeze(-1)
            sub = batch.select(rows)
            lp, _ = self.logprobs(self._scratch, sub)
            full = torch.zeros(len(rows), prox.shape[1])
            full[:, :lp.shape[1]] = lp
            here = versions[rows] == v
            out[rows] = torch.where(here, full, out[rows])
            known[rows] |= here
        return out, known

    def params(self) -> list[torch.Tensor]:
        """What the optimizer steps: the fp32 master copies, or the model's trainable
        parameters (with LoRA, the adapters)."""
        if self.master:
            return self.master.params()
        return [p for p in self.model.parameters() if p.requires_grad]

    def has_reference(self) -> bool:
        return self.cfg.kl_coef > 0

    def reference_logprobs(self, batch: Batch) -> torch.Tensor:
        """The initial policy's log-probabilities: the kept copy, or with LoRA the model with
        its adapters disabled (the base weights never move)."""
        if self.adapters:
            was_training = self.model.training
            self.model.eval()  # no adapter dropout in the reference either
            try:
                with self.model.disable_adapter():
                    return self.logprobs(self.model, batch)[0]
            finally:
                self.model.train(was_training)
        return self.logprobs(self.ref_model, batch)[0]

    def policy_state(self, model=None) -> dict[str, torch.Tensor]:
        """The weights the update moves: the model's, or with LoRA its adapters."""
        model = self.model if model is None else model
        if self.adapters:
            return lora.adapter_state(model)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def _load_policy(self, model, state: dict[str, torch.Tensor]) -> None:
        if self.adapters:
            lora.load_adapter_state(model, state)
        else:
            model.load_state_dict(state)

    def logprobs(self, model, batch: Batch, entropy_grad: bool = False):
        """token_logprobs, through shared-prompt packing where it is on and saves tokens; a
        pass without gradient over more than the token budget is cut in rows."""
        chunks = [] if torch.is_grad_enabled() else self.token_chunks(batch,
                                                                      torch.arange(batch.size))
        if len(chunks) > 1:
            W = batch.input_ids.shape[1] - 1
            logp, ent = torch.zeros(batch.size, W), torch.zeros(batch.size, W)
            for rows in chunks:
                lp, e = self._logprobs(model, batch.select(rows), entropy_grad)
                logp[rows, :lp.shape[1]], ent[rows, :e.shape[1]] = lp, e
            return logp, ent
        return self._logprobs(model, batch, entropy_grad)

    def token_chunks(self, batch: Batch, rows: torch.Tensor) -> list[torch.Tensor]:
        """rows in order, cut so each piece's padded size (rows x longest) fits the token
        budget (train.max_tokens_per_microbatch); a row longer than the budget goes alone."""
        budget = self.token_budget
        if budget is None or len(rows) == 0:
            return [rows]
        lengths = batch.attention_mask[rows].sum(-1).tolist()
        out, start, longest = [], 0, 0
        for i, n in enumerate(lengths):
            if i > start and max(longest, n) * (i - start + 1) > budget:
                out.append(rows[start:i])
                start, longest = i, 0
            longest = max(longest, n)
        out.append(rows[start:])
        return out

    def _token_budget(self, model) -> int | None:
        budget = self.cfg.max_tokens_per_microbatch
        if budget != "auto":
            return budget
        return auto_token_budget(model, checkpointing=self.cfg.gradient_checkpointing,
                                 reference=self.cfg.kl_coef > 0 and not self.adapters)

    def _head_chunk(self, model) -> int | None:
        if not self.cfg.chunked_logits:
            return None
        why = fusable(model)
        if why is not None:
            warnings.warn(f"train.chunked_logits: {why}; log-probabilities go through the full "
                          f"logits (more memory)", RuntimeWarning)
            return None
        head = model.get_output_embeddings()
        return chunk_tokens(head.out_features, self.cfg.logit_chunk_tokens,
                            head.weight.device.type)

    def _logprobs(self, model, batch: Batch, entropy_grad: bool = False):
        if not self._checked:
            self._check_fast_paths(model, batch)
        if self._pack and batch.prompt_lens is not None:
            packed = pack(batch, fill=True)
            if worth_packing(batch, packed):
                if self._segments:  # idempotent: the reference model is switched on first use
                    packed_attention.enable(model)
                return packed_token_logprobs(model, batch, packed, entropy_grad, self._chunk)
        return token_logprobs(model, batch, entropy_grad, self._chunk)

    @torch.no_grad()
    def _check_fast_paths(self, model, batch: Batch) -> None:
        """Once, on the first batch: packing and the chunked head against the padded pass
        through the model's own logits. A model whose attention ignores custom 4D masks or
        position ids, or whose logits are not its head's output, disagrees, and that path is
        turned off. The first rows suffice (they hold whole groups, so responses share packed
        rows), up to CHECK_TOKENS: a padded pass over a whole batch costs as much as the rest
        of an update, and its full logits would set the update's peak memory."""
        self._checked = True
        sub = batch.select(check_rows(batch))
        if self._chunk:
            chunked, plain = chunked_and_full(model, sub, self._chunk)
            if not self._close(model, sub, chunked, plain, "train.chunked_logits", "chunking"):
                self._chunk = None
        elif self._pack:
            plain = token_logprobs(model, sub)[0]
        if self._pack and sub.prompt_lens is not None:
            self._pack = self._check_packing(model, sub, plain)

    def _check_packing(self, model, sub: Batch, plain: torch.Tensor) -> bool:
        """Packed rows attended by segments (no dense mask) where the model's attention takes
        the layout and agrees; else through the dense mask where that agrees; else no
        packing."""
        packed = pack(sub, fill=True)
        self._segments = self.cfg.packed_attention != "mask" and packed_attention.enable(model)
        asked = self.cfg.packed_attention == "segments"
        if asked and not self._segments:
            warnings.warn(f"train.packed_attention=segments: the model attends with "
                          f"{getattr(model.config, '_attn_implementation', '?')}, not SDPA; "
                          f"packed rows are attended through the dense mask", RuntimeWarning)
        if self._segments:
            try:
                logp = packed_token_logprobs(model, sub, packed, chunk=self._chunk)[0]
                self._segments = self._close(model, sub, logp, plain,
                                             "train.packed_attention=segments",
                                             "attention by segments", quiet=not asked)
            except NotImplementedError as e:  # sliding-window or soft-capped attention
                if asked:
                    warnings.warn(f"train.packed_attention=segments: {e}; packed rows are "
                                  f"attended through the dense mask", RuntimeWarning)
                self._segments = False
            if not self._segments:
                packed_attention.disable(model)
        if self._segments:
            return True
        return self._close(model, sub, packed_token_logprobs(model, sub, packed,
                                                             chunk=self._chunk)[0],
                           plain, "train.pack_prompts", "packing")

    @staticmethod
    def _close(model, sub: Batch, logp: torch.Tensor, plain: torch.Tensor, setting: str,
               what: str, quiet: bool = False) -> bool:
        gaps = (logp[:, :plain.shape[1]] - plain).abs()[sub.loss_mask.bool()]
        # Float rounding only, or a model that ignores the mask (off by O(1) on most tokens). In
        # fp32 every token agrees to 1e-3. In bf16 the two layouts round differently: on
        # SmolLM2-135M a mean of 0.03 (largest 0.22) against 1.3 for a model ignoring the mask,
        # so the mean is what tells them apart there.
        fp32 = next(model.parameters()).dtype == torch.float32
        gap, how, tol = ((float(gaps.max()), "at most", 1e-3) if fp32
                         else (float(gaps.mean()), "on average", 0.1))
        if gap <= tol:
            return True
        if quiet:
            return False
        warnings.warn(f"{setting}: log-probabilities differ from the padded pass through the "
                      f"full logits by {gap:.2g} {how} with this model; training without "
                      f"{what}", RuntimeWarning)
        return False

    def _keep_snapshot(self) -> None:
        n = self.cfg.correction.snapshots
        if n <= 0:
            return
        self._snapshots[self.version] = self.policy_state()
        for v in [v for v in self._snapshots if v <= self.version - n]:
            del self._snapshots[v]

    def _drop(self, mask, keep, reason, metrics) -> torch.Tensor:
        new = mask * keep
        metrics[f"dropped_tokens/{reason}"] = float((mask - new).sum())
        return new

    def _first_rows(self, batch: Batch, first_mb: torch.Tensor | None,
                    advantages: torch.Tensor | None) -> torch.Tensor | None:
        """The rows of the first minibatch that its optimizer step will forward, when they
        are known before the old log-probs are (None: take no shortcut). The weights have not
        moved yet, so these rows' old log-probs are that step's own, detached."""
        cfg = self.cfg
        if self.shard is not None:
            return None  # each rank forwards its own share of the micro-batches
        if first_mb is None or advantages is None:
            return None  # advantages None: they (hence the moving rows) need the old log-probs
        if self.cfg.downsample == "d3s":
            return None  # D³S reads every row's entropy and decides the moving rows after
        if (cfg.micro_batch_size and cfg.micro_batch_size < len(first_mb)) or \
                len(self.token_chunks(batch, first_mb)) > 1:
            return None  # holding every micro-batch's graph would defeat micro-batching
        if not self._skips_zero_advantage():
            return first_mb
        if self.shaping is not no_shaping:
            return None  # shaping may move a zero-advantage row's tokens
        return first_mb[advantages[first_mb] != 0]

    def _advantages(self, groups: list[Group], rewards: torch.Tensor):
        return compute_advantages(self.cfg.advantage, self.advantage_inputs(groups, rewards),
                                  self.cfg.advantage_clip)

    def _old_logprobs(self, batch: Batch, first: torch.Tensor | None, m: dict[str, float]):
        """(prox, entropy, Prepared.first): the policy before the update on every row, the
        rows `first` through a pass that keeps its graph for the first optimizer step; the
        others from a no-grad pass, or the engine's where it is checked to be the policy."""
        if first is None or len(first) == 0:
            return (*self.logprobs(self.model, batch), None)
        B, W = batch.size, batch.loss_mask.shape[1]
        prox, ent = torch.zeros(B, W), torch.zeros(B, W)
        with torch.enable_grad():
            logp, e = self.logprobs(self.model, batch.select(first),
                                    entropy_grad=self.cfg.entropy_coef > 0)
        prox[first, :logp.shape[1]], ent[first, :e.shape[1]] = logp.detach(), e.detach()
        rest = torch.ones(B, dtype=torch.bool)
        rest[first] = False
        rest = rest.nonzero().squeeze(-1)
        if len(rest) and self._engine_is_policy(batch, first, logp.detach(), m):
            prox[rest] = batch.behaviour_logprobs[rest]  # the same policy: skip the pass
            if batch.entropies is not None:
                ent[rest] = batch.entropies[rest]
        elif len(rest):
            lp, er = self.logprobs(self.model, batch.select(rest))
            prox[rest, :lp.shape[1]], ent[rest, :er.shape[1]] = lp, er
        return prox, ent, (first, logp, e)

    def _engine_is_policy(self, batch: Batch, first: torch.Tensor, logp: torch.Tensor,
                          m: dict[str, float]) -> bool:
        """True when the engine's behaviour log-probs may stand for the trainer's old ones:
        train.old_logprobs_from_engine, no TIS/MIS correction (they measure the mismatch on
        every token), every trained token sampled at the trainer's version,
        and the first minibatch's rows, forwarded anyway, within train.old_logprobs_tolerance
        of the engine on every trained token. A dtype, kernel or sampling difference shows on
        any rows; a mismatch confined to a few rows may not, and the correction metrics then
        see the first minibatch's rows only."""
        m["old_logprobs_from_engine"] = 0.0
        trained = batch.loss_mask > 0
        if not self.cfg.old_logprobs_from_engine or self.cfg.correction.mode != "none" or \
                (batch.versions[trained] != self.version).any():
            return False  # TIS/MIS measure the mismatch on every token: they need the pass
        W = logp.shape[1]
        gap = (logp - batch.behaviour_logprobs[first, :W]).abs()[trained[first, :W]]
        if gap.numel() == 0:
            return False
        m["old_logprobs_engine_gap_max"] = float(gap.max())
        m["old_logprobs_from_engine"] = float(gap.max() <= self.cfg.old_logprobs_tolerance)
        return bool(m["old_logprobs_from_engine"])

    @torch.no_grad()
    def prepare(self, groups: list[Group], first_mb: torch.Tensor | None = None,
                distill: list[tuple[int, Sample]] = ()) -> tuple[Prepared, dict[str, float]]:
        """Old/reference/version log-probs, advantages, masks and weights for one update.
        first_mb: the rows of the first minibatch, whose pass with gradient is taken here and
        kept for its optimizer step where that is possible (see _first_rows). distill:
        NudgeRL's distillation rows, (index of the sample they copy, row), after the
        samples' own rows."""
        cfg, m = self.cfg, {}
        samples = [s for g in groups for s in g.samples]
        n = len(samples)
        source = torch.tensor(list(range(n)) + [i for i, _ in distill], dtype=torch.long)
        rows = samples + [d for _, d in distill]
        gidx = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples], dtype=torch.long)
        batch = Batch.from_samples(rows, [0.0] * len(rows), self.pad_id,
                                   gidx[source].tolist())
        rewards = self.rewards(samples)
        kl_reward = self.has_reference() and cfg.kl_mode == "reward"
        adv = None if kl_reward else self._advantages(groups, rewards)
        scalar = adv is not None and not adv.segments  # per-turn credit: a row's scalar may be 0
        # tokens no policy sampled (a corrector's; every token of a distillation row): the
        # pre-update policy stands in for their behaviour, so no behaviour correction applies
        unsampled = token_positions(rows, batch.loss_mask.shape, "off_policy")
        unsampled[n:] = 1.0
        exact = not unsampled.any()
        prox, ent, first_pass = self._old_logprobs(batch, self._first_rows(
            batch, first_mb if exact else None, adv.advantages if scalar else None), m)
        if not exact:
            batch.behaviour_logprobs = torch.where(unsampled > 0, prox, batch.behaviour_logprobs)
            m["off_policy_tokens"] = float((unsampled[:n] * batch.loss_mask[:n]).sum())
        if distill:
            m["nudge/distill_rows"], m["nudge/distill_tokens"] = \
                float(len(distill)), float(batch.loss_mask[n:].sum())
        m["entropy"] = float(masked_mean(ent, batch.loss_mask))  # the policy before the update
        ref = self.reference_logprobs(batch) if self.has_reference() else None
        version_logp, known = self._version_logprobs(batch, prox)
        self._keep_snapshot()
        if kl_reward:  # the KL penalty on the reward, then the advantages
            seq_kl = (self.kl_fn(prox, ref) * batch.loss_mask).sum(-1)[:n]
            m["kl_ref"] = float((seq_kl.sum() / batch.loss_mask[:n].sum().clamp_min(1)))
            rewards = rewards - cfg.kl_coef * seq_kl
            adv = self._advantages(groups, rewards)
        adv.advantages, adv.keep = adv.advantages[source], adv.keep[source]
        batch.advantages = adv.advantages
        m.update({f"adv/{k}": v for k, v in adv.metrics.items()})
        m["reward_mean"] = float(rewards.mean())
        mask = self._drop(batch.loss_mask, adv.keep.float()[:, None], "pivot", m)
        if cfg.overlong_filter:  # DAPO: a response cut at the length budget leaves the loss
            kept = [s.status != Status.TRUNCATED for s in rows]
            mask = self._drop(mask, torch.tensor(kept).float()[:, None], "overlong", m)
        if cfg.chosen_tokens == "mask":
            mask = self._drop(mask, 1 - token_positions(rows, mask.shape, "chosen"), "chosen", m)
        if cfg.downsample == "d3s":
            mask = self._d3s(batch, ent, mask, m)
        absent, row_w = (0.0, 0.0), None
        if cfg.subsample:  # BroRL: an unbiased k of each group, the rest in the denominators
            gen = torch.Generator().manual_seed(self.seed * 7919 + self.version)
            keep, row_w = subsample_rows(batch.group_index, cfg.subsample, gen)
            left = (mask.sum(-1) > 0) & ~keep
            absent = (float(left.sum()), float(mask[left].sum()))
            mask = self._drop(mask, keep.float()[:, None], "subsample", m)
        anchor, weights, mask = self._correct(batch, prox, version_logp, known, mask, m)
        if row_w is not None:
            weights = weights * row_w[:, None]
        sample_w = torch.tensor([s.weight for s in rows], dtype=weights.dtype)
        if (sample_w != 1).any():  # a sample kept with probability q counts 1/q times (DUET)
            weights = weights * sample_w[:, None]
            m["sample_weight_max"] = float(sample_w.max())
        clip = self._policy_stats(batch, m)
        token_adv = self.shaping(turn_credit(batch, adv.segments), batch)
        norm = cfg.norm_length or max(int(batch.loss_mask.sum(-1).max()), 1)
        seq_log_w = corr.sequence_log_ratio(prox - batch.behaviour_logprobs, mask)
        counted = (source == torch.arange(len(rows))) if distill else None
        return Prepared(batch, anchor, weights, mask, token_adv, ref, seq_log_w, norm,
                        first_pass, absent=absent, clip=clip,
                        before=prox if cfg.mass_balance else None, counted=counted,
                        source=source), m

    def _d3s(self, batch: Batch, entropy: torch.Tensor, mask: torch.Tensor,
             m: dict[str, float]) -> torch.Tensor:
        """D³S: each group's max-variance subset, then the tokens with the largest |A| H (H the
        pre-update policy's entropy), at this update's shares (rollwise.training.downsample)."""
        c = self.cfg.d3s
        rs = keep_fraction(self.version, c.sample_start, c.relax_steps)
        rt = keep_fraction(self.version, c.token_start, c.relax_steps)
        keep = sample_keep(batch.advantages, batch.group_index, rs)
        mask = self._drop(mask, keep.float()[:, None], "d3s_sample", m)
        score_adv = batch.advantages[:, None].expand_as(mask)
        mask = self._drop(mask, token_keep(score_adv, entropy, mask, rt), "d3s_token", m)
        m["d3s/sample_share"], m["d3s/token_share"] = rs, rt
        return mask

    @torch.no_grad()
    def _mass_balance(self, prep: Prepared, groups: list[Group]) -> dict[str, float]:
        """BroRL's diagnostic: the responses' own-token probabilities before and after this
        update, correct and wrong, trained and left out (rollwise.training.broad)."""
        after, _ = self.logprobs(self.model, prep.batch)
        correct = torch.tensor([s.reward >= 1.0 for g in groups for s in g.samples])[prep.source]
        trained = prep.mask.sum(-1) > 0
        return mass_balance(prep.before, after, prep.batch.loss_mask, correct, trained)

    def _policy_stats(self, batch: Batch, m: dict[str, float]) -> torch.Tensor | None:
        """The pre-update policy's entropy and top-5 confidence on the batch, where the token
        shaping or the clip reads them; returns the per-sequence clip eps, or None."""
        wanted = getattr(self.shaping, "needs_policy_stats", False)
        if not wanted and self.cfg.adaptive_clip == "none":
            return None
        batch.policy_entropy, batch.policy_confidence = policy_token_stats(
            self.model, batch, self.token_chunks(batch, torch.arange(batch.size)))
        m["policy_confidence"] = float(masked_mean(batch.policy_confidence, batch.loss_mask))
        if self.cfg.adaptive_clip == "none":
            return None
        clip = echo_clip(batch.policy_confidence, batch.loss_mask)
        m["clip_eps_mean"] = float(clip.mean())
        return clip

    def _correct(self, batch: Batch, prox, version_logp, known, mask, m):
        """Staleness limit, anchor choice and TIS/MIS weights -> (anchor, weights, mask),
        every dropped token counted by its reason, ratio statistics and ESS into m."""
        cc = self.cfg.correction
        mu = batch.behaviour_logprobs
        mask = self._drop(mask, corr.staleness_keep(batch.versions, self.version, mask,
                                                    cc.max_staleness), "stale", m)
        anchor = prox
        if cc.anchor == "version":
            mask = self._drop(mask, known.float(), "no_snapshot", m)
            anchor = torch.where(known, version_logp, prox) if version_logp is not None else prox
        isw = corr.importance_weights(anchor - mu, mask, cc.mode, cc.level, cc.low, cc.high)
        mask = self._drop(mask, isw.keep, "mis", m)
        stale = corr.staleness(batch.versions, self.version)
        m.update({f"correction/{k}": v for k, v in isw.metrics.items()})
        m.update({f"correction/{k}": v for k, v in corr.ratio_metrics(
            prox, mu, version_logp, known, stale, mask).items()})
        m.update({f"correction/{k}": v for k, v in corr.carried_kv_metrics(
            prox, mu, batch.versions, self.version, batch.loss_mask).items()})
        live = mask.sum(-1) > 0
        ess = corr.effective_sample_size(corr.sequence_log_ratio(prox - mu, mask)[live])
        m["correction/ess"], m["correction/ess_frac"] = ess, ess / max(int(live.sum()), 1)
        m["behaviour_gap_max"] = float(((prox - mu).abs() * batch.loss_mask).max())
        return anchor, isw.weights * mask, mask

    # ----------------------------------------------------------------------- the update

    def update(self, groups: list[Group], dropped: list[Group] = ()) -> dict[str, float]:
        """One policy update on these groups; bumps the policy version. `dropped`: the groups
        the step generated but Filter left out (their advantages are all 0); with
        train.loss_denominator = generated they count in the loss's denominators, as if they
        were in the batch, at no compute."""
        unscored = [s.uid for g in groups for s in g.samples if s.status == Status.FAILED]
        if unscored:  # Filter's scored_part leaves them out; a caller that did not is a bug
            raise RuntimeError(f"{len(unscored)} sample(s) no verifier could score reached the "
                               f"trainer (e.g. {unscored[0]}); train on scored samples only")
        self.model.train()
        metrics: dict[str, float] = {"train/samples": float(sum(len(g.samples) for g in groups))}
        groups = [g for g in groups if g.samples]
        if not groups:
            self._step_schedule()
            return metrics
        distill = distillation_rows(groups, self.cfg.nudge.distill_coef)
        size = sum(len(g.samples) for g in groups) + len(distill)
        gen = torch.Generator().manual_seed(self.seed * 100003 + self.version)
        orders = [torch.randperm(size, generator=gen) for _ in range(self.cfg.epochs)]
        n_chunks = min(self.optimizer_steps(len(groups)), size)
        prep, m = self.prepare(groups, orders[0].chunk(n_chunks)[0], distill)
        if self.cfg.loss_denominator == "generated":
            lengths = [sum(s.loss_mask) for g in dropped for s in g.samples]
            dropped_seqs = float(sum(n > 0 for n in lengths))
            prep.absent = (prep.absent[0] + dropped_seqs, prep.absent[1] + float(sum(lengths)))
            m["loss_denominator_dropped_samples"] = dropped_seqs
        metrics.update({f"train/{k}": v for k, v in m.items()})
        sums: dict[str, float] = {}
        n_mb = 0
        for order in orders:
            for idx in order.chunk(n_chunks):
                mb_metrics = self._optimizer_step(prep, idx)
                for k, v in mb_metrics.items():
                    sums[k] = _combine(k, sums.get(k), v)
                n_mb += 1
        metrics.update({f"train/{k}": (v if k.endswith(("_max", "_min")) else v / n_mb)
                        for k, v in sums.items()})
        if prep.before is not None:
            metrics.update({f"train/{k}": v for k, v in self._mass_balance(prep, groups).items()})
        metrics["train/tokens"] = float(prep.mask.sum())
        metrics["train/minibatches"] = float(n_mb)
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        self._step_schedule()
        if self.cfg.release_grads:  # (kept between an update's minibatches, reused there)
            self.release_grads()
        return metrics

    def release_grads(self) -> None:
        """Free every gradient buffer until the next update writes them afresh."""
        for p in self.params():
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_steps(self, n_groups: int) -> int:
        """Optimizer steps of an update on n_groups groups, before each epoch repeats them."""
        per = self.cfg.minibatch_groups
        return self.cfg.minibatches if per is None else -(-n_groups // per)

    def _optimizer_step(self, prep: Prepared, idx: torch.Tensor) -> dict[str, float]:
        """One optimizer step on rows idx, accumulating gradients over micro-batches. The
        aggregation divides by the whole minibatch's token and sequence counts, so the
        accumulated gradient equals the one of a single pass over the minibatch."""
        first, prep.first = prep.first, None  # only the update's first step has one
        mask = prep.mask[idx]
        if mask.sum() == 0:  # everything was dropped: no step (Adam would still move)
            return {"skipped_frac": 1.0}
        num_tokens, num_seqs = denominators(mask, None if prep.counted is None
                                            else prep.counted[idx])
        share = len(idx) / prep.batch.size  # this minibatch's share of the dropped groups
        num_seqs, num_tokens = num_seqs + prep.absent[0] * share, \
            num_tokens + prep.absent[1] * share
        if self.master is None:  # the masters' gradients are overwritten by each step
            self.optimizer.zero_grad(set_to_none=True)
        size = self.cfg.micro_batch_size or len(idx)
        acc: dict[str, float] = {}
        total, counted = 0.0, 0.0
        moving = self._rows_with_gradient(prep, idx)
        micros = [c for m in moving.split(size) for c in self.token_chunks(prep.batch, m)]
        if first is not None:  # its pass was taken along with the old log-probs
            if not torch.isin(moving, first[0]).all():
                raise RuntimeError("trainer: the kept first pass misses a moving row")
            micros = (first[0],)  # its other rows are masked out: they add nothing
        for micro, mine in self._share(micros):
            if self._trims:
                release_freed_memory()
            n = float(prep.mask[micro].sum()) if mine else 0.0
            if n == 0 and self.shard is None:
                continue
            loss, m = self._micro_loss(prep, micro, num_tokens, num_seqs,
                                       first[1:] if first is not None else None)
            # a rank with fewer micro-batches runs padding passes (loss 0): FSDP2's collectives
            # need the same number of forward and backward passes on every rank. FSDP2 averages
            # the ranks' gradients; their losses are parts of one sum, hence the world factor.
            (loss * (self.shard[1] if self.shard else 1) if mine else loss * 0).backward()
            if n == 0:
                continue
            total += loss.item()  # micro-batch losses sum to the minibatch loss
            counted += n
            for k, v in m.items():  # token-weighted means; maxima and minima as such
                acc[k] = _combine(k, acc.get(k), v if k.endswith(("_max", "_min")) else v * n)
        if self.shard is not None:
            total, counted, acc = _gather_sums(total, counted, acc)
        out = {k: (v if k.endswith(("_max", "_min")) else v / counted) for k, v in acc.items()}
        if self.master:
            self.master.grads_to_master()
        params = self.params()
        for p in params:  # no row had a gradient: AdamW still steps on zeros
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):  # sharded parameters: the norm is a DTensor
            grad_norm = grad_norm.full_tensor()
        if not math.isfinite(float(grad_norm)):
            raise FloatingPointError("non-finite gradient norm; lower train.lr")
        scale = self._lr_scale(prep.seq_log_w[idx], mask)
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] *= scale
        self.optimizer.step()
        if self.master:
            self.master.master_to_model()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        out.update(loss=total, grad_norm=float(grad_norm), lr_scale=scale, skipped_frac=0.0)
        return out

    def _share(self, micros: list) -> list[tuple[torch.Tensor, bool]]:
        """(micro-batch, is it this rank's): all of them on one rank; on rank r of W, every
        W-th from r, padded with passes over one row to the same count on every rank."""
        if self.shard is None:
            return [(m, True) for m in micros]
        rank, world = self.shard
        mine = [(m, True) for m in micros[rank::world]]
        count = -(-len(micros) // world)
        return mine + [(micros[0][:1], False)] * (count - len(mine))

    def _skips_zero_advantage(self) -> bool:
        cfg = self.cfg
        return (cfg.skip_zero_advantage and cfg.loss in ZERO_AT_ZERO_ADVANTAGE
                and cfg.entropy_coef == 0
                and not (self.has_reference() and cfg.kl_mode == "loss"))

    def _rows_with_gradient(self, prep: Prepared, idx: torch.Tensor) -> torch.Tensor:
        """The rows of idx whose loss can move the weights (see train.skip_zero_advantage).
        Skipped rows change no metric but the clip fractions and ratio statistics, which are
        then over tokens with a nonzero advantage."""
        if not self._skips_zero_advantage():
            return idx
        moving = ((prep.token_adv[idx] != 0) & (prep.mask[idx] > 0)).any(-1)
        return idx[moving]

    def _lr_scale(self, seq_log_w: torch.Tensor, mask: torch.Tensor) -> float:
        if not self.cfg.correction.vcpo_lr:
            return 1.0
        live = mask.sum(-1) > 0
        ess = corr.effective_sample_size(seq_log_w[live])
        return corr.vcpo_lr_scale(ess / max(int(live.sum()), 1), self.cfg.correction.vcpo_rho0)

    def _micro_loss(self, prep: Prepared, micro, num_tokens, num_seqs, taken=None):
        """taken: this micro-batch's (logp, entropy), when its pass was already taken."""
        cfg = self.cfg
        mb = prep.batch.select(micro)
        c = prep.rows(micro, mb.loss_mask.shape[1])
        mask = c["mask"]
        logp, ent = taken or self.logprobs(self.model, mb, entropy_grad=cfg.entropy_coef > 0)
        p = self.loss_params if prep.clip is None else dataclasses.replace(
            self.loss_params, clip_low=prep.clip[micro], clip_high=prep.clip[micro])
        token_loss, m = self.loss_fn(logp, c["anchor"], c["adv"], mask, p)
        token_loss = token_loss * c["weights"]
        if cfg.entropy_coef > 0:
            token_loss = token_loss - cfg.entropy_coef * ent
        if c["ref"] is not None and cfg.kl_mode == "loss":
            kl = self.kl_fn(logp, c["ref"])
            token_loss = token_loss + cfg.kl_coef * kl
            m["kl_ref"] = masked_mean(kl.detach(), mask).item()
        loss = aggregate(token_loss, mask, cfg.loss_agg, num_tokens=num_tokens,
                         num_seqs=num_seqs, norm_length=prep.norm_length)
        return loss, m

    def _step_schedule(self) -> None:
        # the schedule follows RL steps, so an update with no groups (every group filtered out)
        # advances it without an optimizer step; torch warns about that order, needlessly here
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()
        self.version += 1

    def close(self) -> None:
        """Nothing to release in this process (sharded ranks have their own)."""

    def state_dict(self) -> dict:
        """Model (with LoRA: the adapters and the base weights' fingerprint), optimizer,
        scheduler, policy version, kept snapshots, reference model and fp32 master weights:
        what a checkpoint keeps."""
        ref = self.ref_model
        return {"model": self.model.state_dict() if not self.adapters else self.policy_state(),
                "base": self._base,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "version": self.version,
                "snapshots": self._snapshots,
                "ref_model": ref.state_dict() if ref is not None else None,
                "master": self.master.state_dict() if self.master else None}

    def load_state_dict(self, state: dict) -> None:
        if bool(self.adapters) != (state.get("base") is not None):
            raise ValueError("the checkpoint was written with train.lora.rank "
                             f"{'> 0' if state.get('base') is not None else '= 0'}, this run "
                             f"has {self.cfg.lora.rank}: resume with the same train.lora")
        if self.adapters:
            lora.check_base(self._base, state["base"])
        self._load_policy(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version, self._snapshots = state["version"], state["snapshots"]
        if state["ref_model"] is not None and self.ref_model is not None:
            self.ref_model.load_state_dict(state["ref_model"])
        if state.get("master") is not None and self.master:
            self.master.load_state_dict(state["master"])

    def weights(self) -> dict[str, torch.Tensor]:
        """What weight sync sends: every tensor, or with LoRA the adapters alone."""
        if self.adapters:
            return lora.adapter_tensors(self.model, self.adapters)
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def _gather_sums(total: float, counted: float, acc: dict[str, float]):
    """The ranks' loss, token count and metric sums, combined (every rank gets the result)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (total, counted, acc))
    out: dict[str, float] = {}
    for _, _, a in parts:
        for k, v in a.items():
            out[k] = _combine(k, out.get(k), v)
    return sum(p[0] for p in parts), sum(p[1] for p in parts), out


def turn_credit(batch: Batch, segments: dict[int, list[tuple[int, float]]]) -> torch.Tensor:
    """(B, T-1) per-token advantages: each sample's scalar, replaced from each segment's first
    response token on by that segment's advantage (AdvantageOutput.segments)."""
    out = batch.advantages[:, None].expand_as(batch.loss_mask).clone()
    for row, segs in segments.items():
        first = int(batch.prompt_lens[row]) - 1  # the column that predicts response token 0
        for (start, a), (end, _) in zip(segs, [*segs[1:], (out.shape[1], 0.0)]):
            out[row, first + start:first + end] = a
    return out


def token_positions(samples: list[Sample], shape, field: str) -> torch.Tensor:
    """(B, T-1) float, 1 at the target column of every response index a sample lists in
    `field` (chosen: picked by a tree, not sampled; off_policy: written by a corrector)."""
    out = torch.zeros(shape)
    for i, s in enumerate(samples):
        at = getattr(s, field)
        if at:
            out[i, torch.tensor(at) + len(s.prompt_ids) - 1] = 1.0
    return out


def denominators(mask: torch.Tensor, counted: torch.Tensor | None):
    """(tokens, sequences) a minibatch's loss is divided by: those of its counted rows (all
    when None, or when it holds none, so that the division stays defined)."""
    if counted is not None and (mask[counted].sum() > 0):
        mask = mask[counted]
    return mask.sum(), (mask.sum(-1) > 0).sum()


def distillation_rows(groups: list[Group], coef: float) -> list[tuple[int, Sample]]:
    """NudgeRL's distillation: every nudged response again, as the answer to its plain
    prompt (the group's problem), weighted coef; (index of the nudged sample, row)."""
    if coef <= 0:
        return []
    out, i = [], 0
    for g in groups:
        plain = getattr(g.problem, "prompt_ids", None)
        for s in g.samples:
            if plain and s.meta.get("nudge", -1) >= 0:
                out.append((i, dataclasses.replace(s, prompt_ids=list(plain),
                                                   weight=coef * s.weight)))
            i += 1
    return out


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """The learning rate at RL step `step`, as a multiple of train.lr: a linear warmup over
    train.warmup_steps times a linear decay to train.lr_end_factor over train.steps."""
    total = max(cfg.steps, 1)
    decay = 1 - (1 - cfg.lr_end_factor) * min(step, total) / total
    return decay * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else decay


def _combine(key: str, old: float | None, new: float) -> float:
    if old is None:
        return new
    if key.endswith("_max"):
        return max(old, new)
    if key.endswith("_min"):
        return min(old, new)
    return old + new
