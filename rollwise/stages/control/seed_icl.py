"""XRPO's in-context seeding (Bamba et al. 2025; docs/methods.md#xrpo): a training prompt whose
groups keep scoring zero gets solved exemplars put before it, so that its next rollouts can
find a rewarded answer to learn from. control.icl_seeding.exemplars > 0 turns it on, with any
selector and group sizer.

A prompt is stuck once `after` of its groups in a row had no solved rollout. The exemplars are
the task's own training problems the policy has solved during the run, never a held-out one:
each enters the bank with the task's worked solution where the task has one, otherwise with
the policy's own correct response. A stuck prompt is given the `exemplars` bank entries whose
prompts read most like it (prompt_features.py), as earlier user/assistant turns of its
conversation; exemplars are dropped, least similar first, until the rendered prompt has at
most max_prompt_tokens tokens and leaves generate.max_new_tokens of the model's context. The
exemplars are prompt tokens: only the response is trained. The prompt keeps its id, so its
statistics go on; once one of its groups has a solved rollout it is asked plain again.
"""

from __future__ import annotations

import dataclasses

from rollwise.stages.control.prompt_features import features, prompt_text
from rollwise.types import Group, Problem


class IclSeeder:
    def __init__(self, cfg):
        c = cfg.control.icl_seeding
        self.exemplars, self.after, self.max_tokens = c.exemplars, c.after, c.max_prompt_tokens
        self.max_new_tokens = cfg.generate.max_new_tokens
        self.streak: dict[str, int] = {}  # prompt id -> groups in a row with no solved rollout
        self.bank: dict[str, list] = {}  # prompt id -> [prompt, worked solution]
        self.held_out: set[str] = set()
        self.train: dict[str, Problem] = {}
        self.prompter = None
        self.last: dict[str, float] = {}

    def bind(self, task=None, prompter=None, policy=None, **_) -> None:
        """The task (its held-out ids are never exemplars), the prompter (lengths, texts) and
        the policy (its context: a seeded prompt leaves generate.max_new_tokens of room)."""
        positions = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        if positions:
            self.max_tokens = min(self.max_tokens, max(positions - self.max_new_tokens, 0))
        if task is not None:
            self.held_out = {p.id for p in task.eval}
            self.train = {p.id: p for p in task.train if p.id not in self.held_out}
        self.prompter = prompter if prompter is not None else self.prompter

    def stuck(self, pid: str) -> bool:
        return self.streak.get(pid, 0) >= self.after

    def transform(self, problems: list[Problem]) -> list[Problem]:
        """The problems, the stuck ones as copies with exemplars before their prompt."""
        out, seeded = [], 0
        for p in problems:
            shots = self.pick(p) if self.stuck(p.id) else []
            seeded_p = self.seeded(p, shots) if shots else None
            out.append(seeded_p or p)
            seeded += seeded_p is not None
        self.last = {"control/icl_seeding/seeded": float(seeded),
                     "control/icl_seeding/stuck": float(sum(self.stuck(p.id) for p in problems)),
                     "control/icl_seeding/bank": float(len(self.bank))}
        return out

    def pick(self, p: Problem) -> list[list]:
        """The bank entries most like p (itself excluded), most similar first."""
        ids = [k for k in self.bank if k != p.id and k not in self.held_out]
        if not ids:
            return []
        feats = features([prompt_text(p.prompt)] + [prompt_text(self.bank[k][0]) for k in ids])
        sims = (feats[1:] @ feats[0]).tolist()
        order = sorted(range(len(ids)), key=lambda i: (-sims[i], ids[i]))[:self.exemplars]
        return [self.bank[ids[i]] for i in order]

    def seeded(self, p: Problem, shots: list[list]) -> Problem | None:
        """p with the exemplars as earlier turns; fewer while the prompt is too long; None
        when not even one fits."""
        while shots:
            turns = [m for q, a in shots for m in (*self._question(q),
                                                    {"role": "assistant", "content": a})]
            msgs = _as_messages(p.prompt, "user")
            head = 1 if msgs[0]["role"] == "system" else 0
            prompt = msgs[:head] + turns + msgs[head:]
            if self.prompter is None:
                return dataclasses.replace(p, prompt=prompt, prompt_ids=None)
            ids = self.prompter.encode(prompt)
            if len(ids) <= self.max_tokens:
                return dataclasses.replace(p, prompt=prompt, prompt_ids=ids)
            shots = shots[:-1]
        return None

    def _question(self, prompt) -> list[dict]:
        """An exemplar's own turns (its system message left out), its last user message
        under task.prompt_template as the stuck prompt's will be."""
        msgs = [m for m in _as_messages(prompt, "user") if m["role"] != "system"]
        template = self.prompter.cfg.prompt_template if self.prompter is not None else None
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if template and users:
            msgs[users[-1]]["content"] = template.replace("{prompt}", msgs[users[-1]]["content"])
        return msgs

    def observe(self, scored: list[Group], step: int) -> None:
        for g in scored:
            solved = [s for s in g.samples if s.reward >= 1.0]
            self.streak[g.prompt_id] = 0 if solved else self.streak.get(g.prompt_id, 0) + 1
            original = self.train.get(g.prompt_id)
            if not solved or original is None:  # a training problem, never a held-out one
                continue
            if original.solution is not None:
                self.bank[g.prompt_id] = [original.prompt, original.solution]
            elif self.prompter is not None:  # the text of the policy's own correct answer
                self.bank[g.prompt_id] = [original.prompt, self._text(solved[0].response_ids)]

    def _text(self, ids: list[int]) -> str:
        return self.prompter.tokenizer.decode(ids, skip_special_tokens=True)

    def metrics(self) -> dict[str, float]:
        return dict(self.last)

    def state_dict(self) -> dict:
        return {"streak": dict(self.streak), "bank": {k: list(v) for k, v in self.bank.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.streak = dict(state["streak"])
        self.bank = {k: list(v) for k, v in state["bank"].items()}


def _as_messages(prompt: str | list[dict], role: str) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": role, "content": prompt}]
    return [dict(m) for m in prompt]
