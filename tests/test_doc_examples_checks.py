"""The checks a documentation block gets when it is not run (tests/doc_examples.py) catch what
rots: a renamed config key or bench option, a bad value, a missing script or file, an excerpt
that no longer matches its source."""

from __future__ import annotations

import pytest

from tests.doc_examples import ROOT, Block, blocks, check_statically, commands, excerpt_problem


def _bash(code: str) -> Block:
    return Block(ROOT / "README.md", 1, "bash", code, "skip", "why")


@pytest.mark.parametrize("code", [
    "rollwise train train.lr=1e-4 run.name=x",
    "python3 -m rollwise train --config configs/smollm2.yaml train.lora.rank=4 \\\n  train.lr=1e-3",
    "rollwise train --config smollm2 train.steps=3",
    "OMP_NUM_THREADS=1 python -m rollwise bench sync --models 0.5b --steps 3 --json",
    "rollwise bench levers --config configs/smollm2.yaml --tokens 7000 --repeats 5 --json",
    "for b in builtin vllm; do rollwise train engine.backend=$b run.init=<warm start>; done",
    "rollwise train 'task.gym={chain_sum: {weight: 2}}' task.name=gym",
    "bash scripts/setup.sh && python3 scripts/hostile_bodies.py",
])
def test_valid_commands_pass(code):
    assert check_statically(_bash(code)) == []


@pytest.mark.parametrize("code, expected", [
    ("rollwise train train.lrr=1e-4", "unknown config key in 'train.lrr=1e-4'"),
    ("rollwise train train.lr=fast", "train.lr = 'fast'"),
    ("rollwise bench levers --tokenz 7000", "unknown option '--tokenz'"),
    ("rollwise bench nosuch --x 1", "no benchmark 'nosuch'"),
    ("rollwise trian", "does not parse"),
    ("rollwise train --config configs/nosuch.yaml", "no such file"),
    ("bash scripts/nosuch.sh", "scripts/nosuch.sh: no such file"),
    ("rollwise train --init <the model's folder>", "not a valid shell command line"),
    ("x=1 && time rollwise train --config configs/smollm2.yaml train.lora.rnk=4",
     "unknown config key"),
])
def test_rotten_commands_are_named(code, expected):
    problems = check_statically(_bash(code))
    assert any(expected in p for p in problems), problems


def test_python_must_compile():
    bad = Block(ROOT / "README.md", 1, "python", "def f(:\n  pass", "skip", "why")
    assert check_statically(bad) and not check_statically(
        Block(ROOT / "README.md", 1, "python", "import rollwise", "skip", "why"))


def test_commands_split_like_the_shell():
    code = "A=1 B=2 timeout 5 rollwise train x.y=1 && echo 'a;b' | cat  # done\nrollwise \\\n  eval"
    assert commands(code) == [["rollwise", "train", "x.y=1"], ["echo", "a;b"], ["cat"],
                              ["rollwise", "eval"]]


def test_excerpt_must_be_verbatim():
    source = (ROOT / "examples/calc_agent.py").read_text().splitlines()
    good = "\n".join(source[3:8])
    assert excerpt_problem(Block(ROOT, 1, "python", good, "excerpt", "examples/calc_agent.py")) \
        is None
    changed = good.replace("(", "[", 1) if "(" in good else good + "\nx = 1"
    assert excerpt_problem(Block(ROOT, 1, "python", changed, "excerpt",
                                 "examples/calc_agent.py")) is not None


def test_markers_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n<!-- examples: skip: slow page -->\n\n```bash\nrollwise train\n```\n\n"
                    "<!-- example: run -->\n```python\nx = 1\n```\n\n"
                    "<!-- example: instead: rollwise config show -->\n```bash\nrollwise train\n"
                    "```\n\n```text\nnot a block\n```\n")
    got = [(b.how, b.arg, b.lang) for b in blocks(page)]
    assert got == [("skip", "slow page", "bash"), ("run", "", "python"),
                   ("instead", "rollwise config show", "bash")]
    page.write_text("<!-- example: skip -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        blocks(page)
