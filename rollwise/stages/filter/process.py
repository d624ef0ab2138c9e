"""Process verifiers: find the first wrong step of a response and write the right one (SCOPE's
step checker and corrector; docs/methods.md#scope).

A process verifier is a Verifier whose unit is the step: `first_error(response, problem)`
returns where the first wrong step starts in the response text and what the step should have
said, or None when every step it can check is right (or it can check none). As a reward
channel (`score`) it gives 1 to a response with no wrong step and 0 otherwise. Built in,
chosen by `generate.scope.verifier` (rollwise.registry, kind 'process_verifier'):

- columns: the stepped tiers' scratchpads, "7+6+0=13;4+8+1=13;3+5+1=09;:339", every column
  step and the answer after ':' checked against the column addition of the prompt's numbers.
- equations: arithmetic in free text, every `a + b = c` (any chain of + - * / and x, ×, ÷
  between numbers) evaluated exactly; the step is the result, the correction the right value.
- worked (rollwise.tasks.worked): the worked task's step lines against the chain's running
  totals, the first wrong (or missing, or extra) line replaced by the right one.

A plug-in is 'package.module:attr', a factory called with the run's Config.
"""

from __future__ import annotations

import abc
import ast
import operator
import re
from dataclasses import dataclass
from fractions import Fraction

from rollwise import registry
from rollwise.stages.filter.base import Item, Verdict, Verifier
from rollwise.types import Problem

MAX_RESPONSE_CHARS = 20_000  # a response is model output: longer ones are checked this far
MAX_NUMBER_DIGITS = 30  # an equation with a longer number is left unchecked


@dataclass(frozen=True)
class StepFix:
    step: int  # index of the first wrong step
    start: int  # character offset in the response where that step begins
    text: str  # the corrected step: replaces the response from `start`, the policy goes on


class ProcessVerifier(Verifier):
    name = "process"

    @abc.abstractmethod
    def first_error(self, response: str, problem: Problem) -> StepFix | None:
        """The first wrong step of `response` and its correction; None when none is wrong."""

    def score(self, items: list[Item]) -> list[Verdict]:
        out = []
        for it in items:
            fix = self.first_error(it.text[:MAX_RESPONSE_CHARS], it.problem)
            out.append(Verdict({self.name: float(fix is None)},
                               "no wrong step" if fix is None else f"step {fix.step} wrong"))
        return out


def build_process_verifier(name: str, cfg) -> ProcessVerifier:
    factory = registry.resolve("process_verifier", name, "generate.scope.verifier")
    return registry.conform(factory(cfg), ProcessVerifier, "generate.scope.verifier")


# ------------------------------------------------------------------ the stepped scratchpads

class ColumnSteps(ProcessVerifier):
    """The column-by-column scratchpad of `a+b=` (rollwise.tasks.arith.scratchpad): a prompt
    of another form is not checked."""

    def __init__(self, cfg=None):
        pass

    def first_error(self, response: str, problem: Problem) -> StepFix | None:
        steps = reference_steps(problem)
        if steps is None:
            return None
        pos = 0
        for i, want in enumerate(steps):
            last = i == len(steps) - 1
            # a column step runs to its ';' (or to where the answer or the text begins);
            # the answer step is the rest of the response
            end = len(response) if last else _step_end(response, pos)
            written = response[pos:end]
            if (written.strip() if last else written) != want:
                return StepFix(i, pos, want)
            pos = end
        return None


def reference_steps(problem: Problem) -> list[str] | None:
    """The right column steps of an `a+b=` prompt and its answer step (':' and the sum's
    digits, least significant first); None for a prompt of another form."""
    from rollwise.tasks.arith import scratchpad
    text = problem.prompt if isinstance(problem.prompt, str) else ""
    m = re.fullmatch(r"\s*(\d{1,18})\+(\d{1,18})=\s*", text)
    if not m:
        return None
    pad = scratchpad(int(m.group(1)), int(m.group(2)))
    columns, answer = pad.rsplit(":", 1)
    return [c + ";" for c in columns.split(";") if c] + [":" + answer]


def _step_end(text: str, pos: int) -> int:
    """Where the column step starting at pos ends: after its ';', or before a ':' or the end."""
    for j in range(pos, len(text)):
        if text[j] == ";":
            return j + 1
        if text[j] == ":":
            return j
    return len(text)


# ------------------------------------------------------------------ equations in free text

NUMBER = r"-?\$?\d++(?:\.\d++)?+"
OP = r"[-+*/×x÷]"
# the expression before an '=' sign, read in a bounded window that ends at it; possessive
# repetitions, so that a long run of digits and operators costs linear time, not quadratic
EXPRESSION = re.compile(rf"(?:{NUMBER}\s*+{OP}\s*+)++{NUMBER}\s*+$")
RESULT = re.compile(r"\s*(\$?)(-?\d+(?:\.\d+)?)")
CHAIN = re.compile(r"[\d\s.$+\-*/×x÷]*+")  # what an expression's characters can be
MAX_EXPRESSION_CHARS = 120  # a longer expression is left unchecked
MAX_EQUALS = 500  # '=' signs looked at per response
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}


class EquationSteps(ProcessVerifier):
    """Every `a op b [op c ...] = r` in the response, in order; the first whose r is not the
    expression's value (to the decimals written) is the first wrong step, and the correction
    is the right value in its place."""

    def __init__(self, cfg=None):
        pass

    def first_error(self, response: str, problem: Problem) -> StepFix | None:
        text, step = response[:MAX_RESPONSE_CHARS], 0
        for eq in [i for i, c in enumerate(text) if c == "="][:MAX_EQUALS]:
            start = max(eq - MAX_EXPRESSION_CHARS, 0)
            expr, result = EXPRESSION.search(text, start, eq), RESULT.match(text, eq + 1)
            if expr is None or result is None or (start > 0 and CHAIN.fullmatch(
                    text, start, expr.start())):
                continue  # not arithmetic, or it may go on before the window
            value = evaluate(expr.group(0))
            if value is None:
                continue
            written = result.group(2)
            if not agrees(written, value):
                return StepFix(step, result.start(2), format_value(value, written))
            step += 1
        return None


def evaluate(expr: str) -> Fraction | None:
    """The exact value of a chain of numbers and + - * / (x, × and ÷ read as * and /), with
    the usual precedence; None when it is not one (a division by zero, a huge number)."""
    text = expr.replace("$", "").replace("×", "*").replace("x", "*").replace("÷", "/")
    if any(len(d) > MAX_NUMBER_DIGITS for d in re.findall(r"\d+", text)):
        return None
    try:
        return _value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ZeroDivisionError, ValueError):
        return None


def _value(node) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    raise ValueError("not arithmetic")


def agrees(written: str, value: Fraction) -> bool:
    """The written number equals the value rounded to as many decimals as were written."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    return abs(Fraction(written) - value) <= Fraction(1, 2 * 10 ** decimals)


def format_value(value: Fraction, written: str) -> str:
    """The right value, as an integer when it is one, else to the decimals written (2 at
    least)."""
    if value.denominator == 1:
        return str(value.numerator)
    decimals = max(len(written.split(".")[1]) if "." in written else 0, 2)
    return f"{float(value):.{decimals}f}"
