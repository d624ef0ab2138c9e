"""SCOPE: step-wise rectification of failed rollouts (Ren et al. 2026, "Recycling Failures";
docs/methods.md#scope). generate.scope.verifier turns it on, with any generation strategy.

After a round is scored, a process verifier (rollwise.stages.filter.process) finds the first
wrong step of failed rollouts in groups that are mostly wrong. Such a rollout's tokens before
that step are kept as they were sampled (on-policy, with their behaviour log-probs and
versions); the corrector's step follows as off-policy tokens (Sample.off_policy, behaviour
log-prob 0, the current version); then the policy continues from the corrected prefix
(on-policy again). The rectified rollout is scored and takes the failed one's place in its
group when it scores higher; the failed one is still stored. Prefixes are cut at token
boundaries: the kept tokens are those whose text lies before the wrong step, and the text
between them and the step is written by the corrector with the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollwise.stages.filter.process import MAX_RESPONSE_CHARS, StepFix, build_process_verifier
from rollwise.types import Group, Sample, Status, new_uid


@dataclass
class Rectification:
    group: Group
    failed: Sample
    sample: Sample  # the rectified rollout: prefix, corrected step, then the policy's tokens
    fix: StepFix


class Scope:
    def __init__(self, cfg, tokenizer):
        c = cfg.generate.scope
        self.verifier = build_process_verifier(c.verifier, cfg)
        self.per_group, self.max_solved = c.per_group, c.max_solved
        self.max_new_tokens = cfg.generate.max_new_tokens
        self.tokenizer = tokenizer

    def propose(self, groups: list[Group], version: int) -> list[Rectification]:
        """The rectified rollouts to generate: per eligible group, its failed rollouts with a
        located wrong step and room left to continue, the longest right prefix first."""
        out = []
        for g in groups:
            scored = [s for s in g.samples if s.status != Status.FAILED]
            if not scored or sum(s.reward >= 1.0 for s in scored) > self.max_solved * len(scored):
                continue
            found = []
            for s in scored:
                if s.reward >= 1.0 or g.problem is None:
                    continue
                fix = self.verifier.first_error(self._text(s.response_ids), g.problem)
                new = self.rectified(s, fix, version) if fix is not None else None
                if new is not None:
                    found.append(Rectification(g, s, new, fix))
            found.sort(key=lambda r: -r.fix.start)
            out += found[:self.per_group]
        return out

    def rectified(self, s: Sample, fix: StepFix, version: int) -> Sample | None:
        """s's tokens before the wrong step, the corrected step as off-policy tokens, ready to
        continue; None when the corrected prefix leaves no room in generate.max_new_tokens."""
        text = self._text(s.response_ids)
        k = self._tokens_before(s.response_ids, text, fix.start)
        written = text[len(self._text(s.response_ids[:k])):fix.start] + fix.text
        ids = list(self.tokenizer(written, add_special_tokens=False)["input_ids"])
        if not ids or k + len(ids) >= self.max_new_tokens:
            return None
        new = Sample(prompt_id=s.prompt_id, prompt_ids=list(s.prompt_ids), uid=new_uid(),
                     group_id=s.group_id, parent_uid=s.uid, branch_point=k, step=s.step,
                     meta={**s.meta, "scope": {"step": fix.step, "kept": k,
                                               "written": len(ids)}})
        new.extend(s.response_ids[:k], s.logprobs[:k], s.versions[:k],
                   s.entropies[:k] if len(s.entropies) == s.num_tokens else None)
        new.loss_mask[:k] = s.loss_mask[:k]
        new.extend(ids, [0.0] * len(ids), [version] * len(ids),
                   [0.0] * len(ids) if new.entropies else None)
        new.off_policy = list(range(k, k + len(ids)))
        new.chosen = [i for i in s.chosen if i < k]
        new.status = Status.PAUSED  # continued by the engine from here
        return new

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)[:MAX_RESPONSE_CHARS]

    def _tokens_before(self, ids: list[int], text: str, start: int) -> int:
        """The most leading tokens whose text is a prefix of text[:start] (binary search on
        the decoded length, then back off while the decoded prefix differs)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._text(ids[:mid])) <= start:
                lo = mid
            else:
                hi = mid - 1
        while lo > 0 and not text[:start].startswith(self._text(ids[:lo])):
            lo -= 1
        return lo


def merge(rectified: list[Rectification]) -> tuple[list[Group], dict[str, float]]:
    """Each rectified rollout takes its failed one's place in the group when it was scored
    and scores higher. Returns what is stored but never trained, each as a group of one
    with its problem (the replaced rollouts, and the rectified ones that did not score
    higher), and the counts."""
    aside, off, replaced = [], 0, 0
    for r in rectified:
        new, old = r.sample, r.failed
        new.meta["scope"]["replaced"] = new.status != Status.FAILED and new.reward > old.reward
        if not new.meta["scope"]["replaced"]:
            aside.append(Group(r.group.prompt_id, [new], r.group.problem))
            continue
        i = next(j for j, s in enumerate(r.group.samples) if s is old)
        r.group.samples[i] = new
        aside.append(Group(r.group.prompt_id, [old], r.group.problem))
        replaced += 1
        off += len(new.off_policy)
    return aside, {"generate/scope/proposed": float(len(rectified)),
                   "generate/scope/replaced": float(replaced),
                   "generate/scope/off_policy_tokens": float(off)}


def distinct_correct(groups: list[Group]) -> float:
    """Distinct correct responses (token sequences) per group, averaged over the groups: the
    rollout diversity SCOPE reports."""
    if not groups:
        return 0.0
    return sum(len({tuple(s.response_ids) for s in g.samples
                    if s.status != Status.FAILED and s.reward >= 1.0})
               for g in groups) / len(groups)
