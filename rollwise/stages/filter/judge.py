"""Generative judge: ask a model, through the engine, to grade a response against a rubric,
and parse its verdict.

Two-way (default): correct -> 1, wrong -> 0. With `fapo`, FAPO's three-way outcome
(Ding et al. 2025, flawed-aware policy optimisation; reward_fn.py in yyDing1/FAPO):
correct -> +1, correct but flawed (right answer, wrong reasoning) -> 0, wrong -> -1.
The verdict is the first of the words correct / flawed / wrong / incorrect after "verdict"
(or anywhere when the judge does not say "verdict"); no such word fails the sample
(cause `bad_verdict`), so a confused judge never hands out reward.

The judge runs in-process on the whole batch (one batched greedy generate call). Its model is
`filter.judge.model` (a Hugging Face folder), or the engine the loop attaches with
`FilterStage.attach_engine(engine, tokenizer)` (the policy judging itself).
"""

from __future__ import annotations

import re

from rollwise.stages.filter.base import Item, Verdict, Verifier

BAD_VERDICT = "bad_verdict"
DEFAULT_RUBRIC = (
    "Grade the response to the problem. The reference answer is given.\n"
    "Problem: {prompt}\nReference answer: {answer}\nResponse: {response}\n"
    "Reply 'verdict: correct' if the final answer is right and the reasoning sound, "
    "{flawed}'verdict: wrong' otherwise.\nverdict:")
_FLAWED = "'verdict: flawed' if the final answer is right but a step is wrong, "
_WORD = re.compile(r"\b(incorrect|correct|flawed|wrong)\b")
REWARDS = {False: {"correct": 1.0, "flawed": 1.0, "wrong": 0.0},
           True: {"correct": 1.0, "flawed": 0.0, "wrong": -1.0}}


def parse_verdict(text: str) -> str | None:
    low = text.lower()
    at = low.rfind("verdict")
    m = _WORD.search(low, at if at >= 0 else 0) or _WORD.search(low)
    if not m:
        return None
    return "wrong" if m.group(1) == "incorrect" else m.group(1)


class JudgeVerifier(Verifier):
    isolated = False

    def __init__(self, rubric: str | None = None, fapo: bool = False, model: str | None = None,
                 max_new_tokens: int = 64, name: str = "judge"):
        self.rubric = rubric or DEFAULT_RUBRIC
        self.fapo, self.model_path, self.name = fapo, model, name
        self.max_new_tokens = max_new_tokens
        self.engine = self.tokenizer = None

    def attach(self, engine, tokenizer) -> None:
        self.engine, self.tokenizer = engine, tokenizer

    def _ensure_engine(self) -> None:
        if self.engine is not None:
            return
        if not self.model_path:
            raise ValueError("the judge has no model: set filter.judge.model=<HF model folder> "
                             "or attach the policy engine with FilterStage.attach_engine")
        from rollwise import models  # torch: not in the verifier workers, which never judge
        from rollwise.engine import BuiltinEngine
        model, tok = models.load_model(self.model_path)
        self.attach(BuiltinEngine(model, copy_model=False), tok)

    def prompt(self, it: Item) -> str:
        return self.rubric.format(prompt=it.problem.prompt, answer=it.problem.answer,
                                  response=it.text, flawed=_FLAWED if self.fapo else "")

    def score(self, items: list[Item]) -> list[Verdict]:
        from rollwise.engine import Request, SamplingParams
        self._ensure_engine()
        tok = self.tokenizer
        params = SamplingParams(temperature=0.0, max_new_tokens=self.max_new_tokens,
                                stop_ids=(tok.eos_token_id,))
        requests = [Request(tok(self.prompt(it))["input_ids"], params, i)
                    for i, it in enumerate(items)]
        out = []
        for c in sorted(self.engine.generate(requests), key=lambda c: c.request_id):
            text = tok.decode(c.token_ids, skip_special_tokens=True)
            verdict = parse_verdict(text)
            if verdict is None:
                out.append(Verdict.failure(BAD_VERDICT, f"judge said {text[:80]!r}"))
            else:
                out.append(Verdict({self.name: REWARDS[self.fapo][verdict]},
                                   f"judge: {verdict}"))
        return out

    def metrics(self) -> dict[str, float]:
        return {}
