"""Code: run the model's Python against the problem's tests in the sandbox.

Tests live in `problem.data`:
  tests:      [{"input": "...", "output": "..."}, ...]   stdin/stdout cases, one run each
  test_code:  "assert f(2) == 4\\n..."                   assert-style, appended to the program
Outputs are compared line by line with trailing whitespace removed. The program is the last
```python fenced block of the response, or the whole response when it has none.
"""

from __future__ import annotations

import re
from dataclasses import replace

from rollwise.stages.filter.base import Item, Verdict, Verifier
from rollwise.stages.filter.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def same_output(got: str, expected: str) -> bool:
    def lines(s: str) -> list[str]:
        out = [line.rstrip() for line in s.replace("\r\n", "\n").split("\n")]
        while out and not out[-1]:
            out.pop()
        return out
    return lines(got) == lines(expected)


def _short(s: str, n: int = 40) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


class CodeVerifier(Verifier):
    """`code` channel: 1 when every test passes (mode 'all') or the share passed ('fraction')."""

    name = "code"
    isolated = True

    def __init__(self, limits: SandboxLimits = SandboxLimits(), mode: str = "all",
                 name: str = "code"):
        if mode not in ("all", "fraction"):
            raise ValueError(f"filter.code_reward = {mode!r}: use 'all' or 'fraction'")
        self.limits, self.mode, self.name = limits, mode, name
        self.in_worker = False  # set by the pool: the worker supervises the sandbox itself

    def score(self, items: list[Item]) -> list[Verdict]:
        return [self.score_one(it) for it in items]

    def score_one(self, it: Item) -> Verdict:
        code = extract_code(it.text)
        data = it.problem.data
        cases, test_code = data.get("tests") or [], data.get("test_code")
        if not cases and not test_code:
            raise ValueError(f"problem {it.problem.id}: no 'tests' or 'test_code' in its data")
        passed, total, notes = 0, len(cases) + bool(test_code), []
        for i, case in enumerate(cases, 1):
            r = run_python(code, stdin=str(case.get("input", "")), limits=self.limits,
                           in_process=self.in_worker)
            if r.ok and same_output(r.stdout, str(case["output"])):
                passed += 1
                continue
            notes.append(f"test {i}: " + (f"wrong output {_short(r.stdout)}, expected "
                                          f"{_short(str(case['output']))}" if r.ok else
                                          f"{r.status} ({r.reason[:120]})"))
            if self.mode == "all":
                break
        if test_code and (self.mode == "fraction" or not notes):
            r = run_python(code + "\n\n" + test_code, limits=self.limits,
                           in_process=self.in_worker)
            if r.ok:
                passed += 1
            else:
                notes.append(f"asserts: {r.status} ({r.reason[:160]})")
        value = passed / total if self.mode == "fraction" else float(passed == total)
        info = f"passed {passed}/{total}" + (": " + "; ".join(notes) if notes else "")
        return Verdict({self.name: value}, info)

    def metrics(self) -> dict[str, float]:
        return {}

    def with_limits(self, **kw) -> "CodeVerifier":
        return CodeVerifier(replace(self.limits, **kw), self.mode, self.name)
