"""The built-in tools: `calculator` (arithmetic, evaluated on its syntax tree, never by eval)
and `python` (a program run in rollwise's sandbox, rollwise.stages.filter.sandbox)."""

from __future__ import annotations

import ast
import operator

from rollwise.stages.filter.sandbox import run_python

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 9**9**9 would take the process for minutes
MAX_DIGITS = 100
MAX_LENGTH = 200


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        out = _BINARY[type(node.op)](left, right)
        if isinstance(out, int) and len(str(abs(out))) > MAX_DIGITS:
            raise ValueError(f"result has more than {MAX_DIGITS} digits")
        return out
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, "
                     f"not {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers, + - * / // % ** and parentheses, e.g. "(17 + 5) * 3".
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _eval(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


calculator.bounded = True  # its limits bound its work: it runs without a child process


def python(code: str) -> str:
    """Run a Python program and return what it prints.

    Args:
        code: The program; its standard output is the result.
    """
    r = run_python(code)
    if r.ok:
        return r.stdout
    detail = (r.stderr.strip().splitlines() or [r.reason])[-1]
    return f"{r.stdout}[{r.status}: {detail}]"


BUILTIN = {"calculator": calculator, "python": python}
