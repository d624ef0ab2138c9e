"""Counts that say how the package is put together, for a review of its structure:

    python3 scripts/code_counts.py [ROOT]

- strategy-name comparisons: a config's strategy name (generate.strategy, control.*,
  train.advantage, ...) compared with a literal outside the registry (rollwise/bench aside);
- capability probes: hasattr(...) and getattr(..., default) outside rollwise/bench;
- import cycles between modules and between packages (every import, deferred ones too);
- imports inside functions; the largest files and functions.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

STRATEGY = re.compile(r"(strategy|inflight|selector|group_size|advantage|token_shaping|"
                      r"replay\.strategy)\s*(==|!=|in \(|not in \()\s*[\"'(]|EPISODIC")


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for p in sorted((root / "rollwise").rglob("*.py")):
        name = ".".join(p.relative_to(root).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imported(mod: str, node, is_pkg: bool, known: dict) -> list[str]:
    """The modules an import statement loads (a name imported from a package: its submodule
    when there is one, else the package)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.module == "__future__":
        return []
    base = mod if is_pkg else mod.rsplit(".", 1)[0]
    if node.level:
        parts = base.split(".")
        base = ".".join(parts[:len(parts) - (node.level - 1)])
        target = base + ("." + node.module if node.module else "")
    else:
        target = node.module
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]


def owner(name: str, known: dict) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    sys.setrecursionlimit(10_000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def package(mod: str, known: dict) -> str:
    """rollwise.<part> for a module of a subpackage; a top-level module is its own."""
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or known[mod].name == "__init__.py" else mod


def import_edges(known: dict) -> tuple[dict, dict]:
    """module -> the modules it imports, and package -> packages (every import, deferred and
    TYPE_CHECKING ones too)."""
    edges, pkg_edges = defaultdict(set), defaultdict(set)
    for mod, path in known.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in imported(mod, node, path.name == "__init__.py", known):
                dep = owner(target, known)
                if dep and dep != mod:
                    edges[mod].add(dep)
                    if package(mod, known) != package(dep, known):
                        pkg_edges[package(mod, known)].add(package(dep, known))
    return edges, pkg_edges


def main(root: Path) -> None:
    known = modules(root)
    edges, pkg_edges = import_edges(known)
    probes, in_functions, functions, names = 0, 0, [], []
    for mod, path in known.items():
        src = path.read_text()
        tree = ast.parse(src)
        outside_bench = not mod.startswith("rollwise.bench")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{mod}:{node.name}"))
                in_functions += sum(isinstance(x, (ast.Import, ast.ImportFrom))
                                    for x in ast.walk(node))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and outside_bench:
                probes += node.func.id == "hasattr" or (node.func.id == "getattr"
                                                        and len(node.args) == 3)
        if outside_bench and mod != "rollwise.registry":
            names += [f"{path.relative_to(root)}:{i}" for i, line in enumerate(src.splitlines(), 1)
                      if STRATEGY.search(line) and "raise" not in line]
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root)))
                    for p in known.values()), reverse=True)
    print(f"strategy-name comparisons outside the registry: {len(names)}", *names)
    print(f"capability probes (hasattr, getattr with a default): {probes}")
    print(f"module import cycles: {cycles(edges)}")
    print(f"package import cycles: {cycles(pkg_edges)}")
    print(f"imports inside functions: {in_functions}")
    print(f"largest files: {sizes[:5]}")
    print(f"largest functions: {sorted(functions, reverse=True)[:5]}; over 60 lines: "
          f"{sum(n > 60 for n, _ in functions)} of {len(functions)}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve())
