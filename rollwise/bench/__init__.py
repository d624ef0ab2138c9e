"""Benchmarks: `rollwise bench NAME`; each module with a main(argv) -> int is one, and the first
sentence of its docstring says what it measures (`rollwise bench` lists them, without importing
any: several import torch)."""

from __future__ import annotations

import ast
from pathlib import Path

from rollwise.oneline import first_sentence

HERE = Path(__file__).resolve().parent
KEYWORDS = {"async_": "async"}  # modules named after a Python keyword, and their bench names


def module_of(name: str) -> str:
    return {v: k for k, v in KEYWORDS.items()}.get(name, name)


def benchmarks() -> dict[str, str]:
    """{bench name: what it measures}, read from the modules' source."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            found[KEYWORDS.get(path.stem, path.stem)] = first_sentence(
                ast.get_docstring(tree) or "")
    return found
