"""Core record types: one prompt of a task (Problem), one trajectory (Sample), the samples of
one prompt (Group), and the columnar Batch the trainer consumes.

A Sample keeps token-level truth: token ids (never re-tokenized text), the behaviour
log-probability the engine sampled each response token with, the policy version that produced
each token, and a loss mask. Partial, stale, replayed and branched rollouts are then all
corrected exactly later on, instead of being treated as on-policy.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # torch is imported where a Batch is built: records alone do not need it
    import torch


class Status(str, enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"  # ended on a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens
    ABORTED = "aborted"
    FAILED = "failed"  # scoring or generation failed; reason in reward_info


def new_uid() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class Problem:
    """One prompt of a task, with the answer its verifiers check."""
    id: str
    prompt: str | list[dict]  # text, or chat messages [{"role", "content"}, ...]
    answer: str
    tier: str = "all"
    solution: str | None = None  # worked response for the supervised warm start
    data: dict[str, Any] = field(default_factory=dict)  # source row, for custom verifiers
    prompt_ids: list[int] | None = None  # made once by rollwise.tasks.prompts.Prompter
    group_size: int | None = None  # samples Control wants for it this round; None: the default


Scorer = Callable[[str, Problem], tuple[float, str]]
"""score(response text, problem) -> (reward, why): held-out evaluation's per-sample scorer."""


@dataclass
class Sample:
    """One trajectory: a prompt and one sampled response, at token level."""

    prompt_id: str  # the dataset row this came from
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # behaviour log p of each response token
    versions: list[int] = field(default_factory=list)  # policy version that sampled each token
    loss_mask: list[int] = field(default_factory=list)  # 1 = train on this token (0: tool/obs)
    entropies: list[float] = field(default_factory=list)
    status: Status = Status.RUNNING
    rewards: dict[str, float] = field(default_factory=dict)  # named reward channels
    reward: float = 0.0  # the scalar the optimizer uses
    reward_info: str = ""  # extracted answer, or why scoring failed
    weight: float = 1.0  # the whole sample's weight in the loss (DUET's 1/q for a kept tail)
    # lineage
    uid: str = field(default_factory=new_uid)
    group_id: str = ""
    parent_uid: str | None = None  # tree parent (fork) or the paused sample this resumes
    root_uid: str | None = None  # the tree's first sample (None: this sample is a root)
    branch_point: int | None = None  # response index where this branched off its parent
    step: int = -1  # training step whose batch this sample was generated for (birth step)
    chosen: list[int] = field(default_factory=list)
    """Response indices of tokens chosen by a tree (LATR's second-best token, ECHO's top-w
    alternatives) rather than sampled. Their behaviour log-probability is still that of the
    distribution they came from; train.chosen_tokens decides how the loss treats them."""
    off_policy: list[int] = field(default_factory=list)
    """Response indices of tokens no policy sampled: written by a corrector (SCOPE's
    corrected step). Their behaviour log-probability is 0 (a deterministic writer); the
    trainer takes the pre-update policy's in its place, so no behaviour correction applies."""
    meta: dict[str, Any] = field(default_factory=dict)  # task data: answer, tier, text

    def extend(self, tokens: list[int], logprobs: list[float], versions: list[int],
               entropies: list[float] | None = None, trainable: bool = True) -> None:
        """Append response tokens with their behaviour log-probabilities and versions (the one
        way a sample grows: engine events, completions, resumed and forked requests)."""
        self.response_ids += tokens
        self.logprobs += logprobs
        self.versions += versions
        self.loss_mask += [int(trainable)] * len(tokens)
        if entropies is not None:
            self.entropies += entropies

    def cut(self, n: int) -> None:
        """Keep the first n response tokens (and their columns): a limit an in-flight
        controller names in tokens, applied after the engine ran past it."""
        for name in ("response_ids", "logprobs", "versions", "loss_mask", "entropies"):
            setattr(self, name, getattr(self, name)[:n])
        self.chosen = [i for i in self.chosen if i < n]
        self.off_policy = [i for i in self.off_policy if i < n]

    def fork(self) -> "Sample":
        """A child that continues from this sample's current end (its lineage: this parent
        and the branch point); the per-token columns are copied, not shared."""
        return dataclasses.replace(
            self, uid=new_uid(), parent_uid=self.uid, root_uid=self.root_uid or self.uid,
            branch_point=self.num_tokens, response_ids=list(self.response_ids),
            logprobs=list(self.logprobs), versions=list(self.versions),
            loss_mask=list(self.loss_mask), entropies=list(self.entropies),
            chosen=list(self.chosen), off_policy=list(self.off_policy), rewards={},
            meta=dict(self.meta))

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, str, numbers): what checkpoints, the store and buffers keep. The
        lists are the sample's own, not copies (dataclasses.asdict's deep copy of every token
        list costs the store tens of milliseconds a step)."""
        d = {name: getattr(self, name) for name in _SAMPLE_FIELDS}
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        return cls(**{k: (Status(v) if k == "status" else v) for k, v in d.items()
                      if k in _SAMPLE_FIELDS})

    @property
    def finished(self) -> bool:
        return self.status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED, Status.ABORTED)

    @property
    def num_tokens(self) -> int:
        return len(self.response_ids)

    def check(self) -> None:
        """Raise if the per-token columns disagree in length (a bug, never user input)."""
        n = len(self.response_ids)
        for name in ("logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"sample {self.uid}: {name} has {len(getattr(self, name))} "
                                 f"entries for {n} response tokens")


_SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))


@dataclass
class Group:
    """The samples of one prompt; advantages are computed within a group."""

    prompt_id: str
    samples: list[Sample]
    problem: Any = None  # the task's Problem (prompt text, answer) the samples answer
    unscored: int = 0  # samples left out because no verifier could score them (Filter)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    def to_dict(self) -> dict[str, Any]:
        problem = self.problem
        if dataclasses.is_dataclass(problem):
            problem = dataclasses.asdict(problem)
        return {"prompt_id": self.prompt_id, "samples": [s.to_dict() for s in self.samples],
                "problem": problem}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Group":
        problem = d["problem"]
        if isinstance(problem, dict):
            problem = Problem(**problem)
        return cls(d["prompt_id"], [Sample.from_dict(s) for s in d["samples"]], problem)

    @property
    def is_mixed(self) -> bool:
        """True when the rewards of its scored samples differ, i.e. the group carries a
        learning signal (an unscored sample's 0 is no reward)."""
        r = [s.reward for s in self.samples if s.status != Status.FAILED]
        return len(r) > 1 and max(r) != min(r)


@dataclass
class Batch:
    """Columnar, right-padded form of a list of samples for the trainer.

    Sequences are prompt + response. Per-token columns are aligned to the *targets*: column t
    describes token t+1 of input_ids, so logits[:, t] predicts input_ids[:, t+1].
    """

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T-1) float, 1 on trained response targets
    behaviour_logprobs: torch.Tensor  # (B, T-1) float
    versions: torch.Tensor  # (B, T-1) long, -1 outside the response
    advantages: torch.Tensor  # (B,) float, one per sample (broadcast over its tokens)
    group_index: torch.Tensor  # (B,) long
    entropies: torch.Tensor | None = None  # (B, T-1) engine entropy per response target
    prompt_lens: torch.Tensor | None = None  # (B,) long; lets the trainer pack shared prompts
    # the policy before the update, per response target, where a token shaping or clip asks
    # for them (Trainer.prepare): full-vocabulary entropy and mean top-5 probability (ECHO)
    policy_entropy: torch.Tensor | None = None  # (B, T-1)
    policy_confidence: torch.Tensor | None = None  # (B, T-1)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def from_samples(cls, samples: list[Sample], advantages: list[float], pad_id: int,
                     group_index: list[int] | None = None) -> "Batch":
        # One tensor per column for the whole batch, scattered into place: a Python loop of
        # small tensor copies per sample costs more than the trainer's forward pass here.
        import torch
        P = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
        N = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
        B, T = len(samples), int((P + N).max())
        rows = torch.arange(B)
        input_ids = torch.full((B, T), pad_id, dtype=torch.long)
        seq_rows = rows.repeat_interleave(P + N)
        input_ids[seq_rows, concat_ranges(P + N)] = torch.tensor(
            [t for s in samples for t in (*s.prompt_ids, *s.response_ids)], dtype=torch.long)
        attention = (torch.arange(T)[None] < (P + N)[:, None]).long()
        # response token j sits at position p+j and is predicted from column p+j-1
        at = (rows.repeat_interleave(N), (P - 1).repeat_interleave(N) + concat_ranges(N))

        def column(values: list, dtype, fill=0, where=at) -> torch.Tensor:
            if len(values) != len(where[0]):
                for s in samples:
                    s.check()  # names the sample whose columns disagree
            out = torch.full((B, T - 1), fill, dtype=dtype)
            out[where] = torch.tensor(values, dtype=dtype)
            return out
        loss_mask = column([x for s in samples for x in s.loss_mask], torch.float)
        behaviour = column([x for s in samples for x in s.logprobs], torch.float)
        versions = column([x for s in samples for x in s.versions], torch.long, -1)
        # engine entropy per response target, for per-token advantage shaping (ECHO)
        has_ent = torch.tensor([len(s.entropies) == len(s.response_ids) for s in samples])
        tok_ent = has_ent.repeat_interleave(N)
        entropies = column([x for s in samples if len(s.entropies) == len(s.response_ids)
                            for x in s.entropies], torch.float,
                           where=(at[0][tok_ent], at[1][tok_ent]))
        gi = torch.tensor(group_index if group_index is not None else list(range(B)))
        return cls(input_ids, attention, loss_mask, behaviour, versions,
                   torch.tensor(advantages, dtype=torch.float), gi, entropies, P)

    def select(self, idx: torch.Tensor) -> "Batch":
        """Rows idx, trimmed to the longest remaining sequence."""
        T = int(self.attention_mask[idx].sum(1).max())
        cut = lambda x: None if x is None else x[idx, :T - 1]  # noqa: E731
        return Batch(self.input_ids[idx, :T], self.attention_mask[idx, :T],
                     self.loss_mask[idx, :T - 1], self.behaviour_logprobs[idx, :T - 1],
                     self.versions[idx, :T - 1], self.advantages[idx], self.group_index[idx],
                     cut(self.entropies), None if self.prompt_lens is None else
                     self.prompt_lens[idx], cut(self.policy_entropy),
                     cut(self.policy_confidence))


def concat_ranges(n: torch.Tensor) -> torch.Tensor:
    """0..n[0]-1, 0..n[1]-1, ... concatenated."""
    import torch
    starts = torch.cumsum(n, 0) - n
    return torch.arange(int(n.sum())) - starts.repeat_interleave(n)
