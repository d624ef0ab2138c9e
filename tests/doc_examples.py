"""The fenced `bash` and `python` blocks of the README, BENCHMARKS.md and the documentation
site, and how each is checked (tests/test_doc_examples.py runs them).

A block runs as written unless a comment on the line before its fence says otherwise:

    <!-- example: skip: REASON -->        not run (a GPU, vLLM, minutes of training)
    <!-- example: instead: COMMAND -->    a smaller variant of it is run instead
    <!-- example: excerpt: PATH -->       the block is an excerpt of PATH, verbatim
    <!-- example: fails: REASON -->       it shows an error: its commands must be refused
    <!-- example: run -->                 run, where the page says skip for all its blocks

and `<!-- examples: skip: REASON -->` anywhere in a page skips all its blocks but those marked
`run`. A block that is not run is still checked: its `rollwise` commands are parsed by the
command's own parser and their `section.key=value` overrides checked against the config, its
scripts must exist, and Python must compile. So a renamed option or command fails here.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from rollwise.bench import module_of

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w+)\s*$")
BLOCK_MARK = re.compile(r"^<!-- example: (skip|instead|excerpt|fails|run)(?::\s*(.*?))? -->$")
PAGE_MARK = re.compile(r"^<!-- examples: skip: (.*?) -->$", re.M)
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\$")


@dataclass
class Block:
    path: Path
    line: int  # the fence's line, 1-based
    lang: str
    code: str
    how: str  # run | skip | instead | excerpt
    arg: str = ""  # the reason, the command or the excerpt's file

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "bench-logs" not in p.parts)
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *docs]


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    page = PAGE_MARK.search(text)
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m.group(1) in ("bash", "python"):
            mark = BLOCK_MARK.match(lines[i - 1].strip()) if i else None
            how, arg = (mark.group(1), mark.group(2) or "") if mark else (
                ("skip", page.group(1)) if page else ("run", ""))
            if how in ("skip", "instead", "excerpt", "fails") and not arg:
                raise ValueError(f"{path}:{i + 1}: '{how}' needs a reason, command or path")
            out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:end]), how, arg))
        i = end + 1
    return out


# --- checks for a block that is not run -------------------------------------------------------

class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block, each as argv, leading VAR=value and wrappers
    (time, timeout N, for/do) dropped."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        argv: list[str] = []
        for token in [*lexer, ";"]:
            if token.strip(";&|"):
                argv.append(token)
                continue
            while argv and (re.match(r"^\w+=", argv[0]) or argv[0] in ("time", "do", "then")):
                argv = argv[1:]
            if argv[:1] == ["timeout"]:
                argv = argv[2:]
            if argv:
                out.append(argv)
            argv = []
    return out


def rollwise_args(argv: list[str]) -> list[str] | None:
    """The arguments after `rollwise` / `python -m rollwise`, or None for another command."""
    if argv[0] == "rollwise":
        return argv[1:]
    if re.search(r"python3?$", argv[0]) and argv[1:3] == ["-m", "rollwise"]:
        return argv[3:]
    return None


def check_statically(block: Block) -> list[str]:
    """What is wrong with a block that is not run: [] when nothing is."""
    if block.lang == "python":
        try:
            compile(block.code, block.name, "exec")
        except SyntaxError as e:
            return [f"does not compile: {e}"]
        return []
    problems = []
    try:
        argvs = commands(block.code)
    except ValueError as e:  # what bash would refuse too (an unclosed quote)
        return [f"not a valid shell command line: {e}"]
    for argv in argvs:
        args = rollwise_args(argv)
        if args is not None:
            problems += check_rollwise(args)
        elif argv[0] in ("bash", "sh") or re.search(r"python3?$", argv[0]):
            scripts = [a for a in argv[1:2] if a.endswith((".sh", ".py"))]
            problems += [f"{s}: no such file" for s in scripts if not (ROOT / s).is_file()]
    return problems


def check_rollwise(args: list[str]) -> list[str]:
    from rollwise import cli

    parser = cli.build_parser()
    try:
        ns, extra = parser.parse_known_args(args)
    except SystemExit:
        return [f"rollwise {' '.join(args)}: the command line does not parse"]
    problems = [f"unknown option {a!r}" for a in extra if a.startswith("-")]
    overrides = [a for a in [*getattr(ns, "overrides", []), *extra] if "=" in a]
    config = getattr(ns, "config", None)
    if ns.command == "bench":
        sub_options, sub_overrides, sub_config = bench_arguments(ns.name, ns.rest)
        if sub_options is None:
            return [f"no benchmark {ns.name!r}"]
        problems += [f"rollwise bench {ns.name}: unknown option {o!r}" for o in sub_options]
        overrides += sub_overrides
        config = config or sub_config
    problems += [f"unknown config key in {o!r}" for o in overrides if not config_key_exists(o)]
    if config and not PLACEHOLDER.search(config) and not _config_found(config):
        problems.append(f"--config {config}: no such file, and no preset of that name")
    if problems or any(PLACEHOLDER.search(a) for a in args):
        return problems
    if ns.command in ("train", "sft", "eval", "config") and not getattr(ns, "resume", None):
        problems += config_problems(config, overrides)
    return problems


def _config_path(config: str):
    """A command's --config as the CLI reads it: a file under the root, else a preset."""
    return ROOT / config if (ROOT / config).is_file() else config


def _config_found(config: str) -> bool:
    from rollwise import presets
    from rollwise.errors import ConfigError
    try:
        presets.resolve(_config_path(config))
        return True
    except ConfigError:
        return False


def config_problems(config: str | None, overrides: list[str]) -> list[str]:
    """The config's own validation of a command's --config and overrides (values too). A
    plugin the page names from the reader's own package (`mypkg.rewards:score`) cannot be
    imported here and is not an error of the page."""
    from rollwise.config import ConfigError, load_config

    try:
        # keys and values; a model the page fetches first need not be here
        load_config(_config_path(config) if config else None, overrides, check_files=False)
    except ConfigError as e:
        missing = re.search(r"No module named '([\w.]+)'", str(e))
        if not (missing and not missing.group(1).startswith("rollwise")):
            return [str(e)]
    return []


def bench_arguments(name: str, rest: list[str]):
    """(unknown options, overrides, --config) of `rollwise bench NAME REST`, from the bench's
    own parser; (None, ..) when there is no such bench."""
    try:
        module = importlib.import_module(f"rollwise.bench.{module_of(name)}")
    except ModuleNotFoundError:
        return None, [], None
    original = argparse.ArgumentParser.parse_args

    def capture(self, *a, **k):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        module.main(list(rest))
        return None, [], None  # a bench without argparse cannot be checked: say so
    except _Parsed as parsed:
        known = parsed.parser._option_string_actions
    finally:
        argparse.ArgumentParser.parse_args = original
    options = [a.split("=")[0] for a in rest if a.startswith("--") and a != "--"]
    unknown = [o for o in options if o not in known]
    overrides = [a for a in rest if "=" in a and not a.startswith("-")]
    config = next((rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--config"), None)
    return unknown, overrides, config


def config_key_exists(override: str) -> bool:
    from pydantic import BaseModel

    from rollwise.config import Config

    node: type[BaseModel] | None = Config
    for part in override.split("=", 1)[0].split("."):
        if node is None:  # below a dict-valued field (task.gym.<dataset>.<setting>)
            return True
        field = node.model_fields.get(part)
        if field is None:
            return False
        kind = field.annotation
        node = kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None
    return True


def excerpt_problem(block: Block) -> str | None:
    source = ROOT / block.arg
    if not source.is_file():
        return f"{block.arg}: no such file"
    want = [ln.rstrip() for ln in block.code.splitlines()]
    have = [ln.rstrip() for ln in source.read_text().splitlines()]
    starts = (i for i in range(len(have) - len(want) + 1) if have[i:i + len(want)] == want)
    return None if next(starts, None) is not None else f"not a verbatim excerpt of {block.arg}"
