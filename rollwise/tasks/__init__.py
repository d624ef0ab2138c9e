"""Tasks: problem sets with verifiable answers, split into train and held-out eval.

A task gives `train` and `eval` lists of Problem and `extract_answer(response_text)`, the
string the verifier compares with the problem's answer. Built in: `arith` (tiers of growing
difficulty), `calc` (multi-turn episodes with a calculator), `packs` (Connect-the-Dots packs),
`gym:<name>` and `gym` (reasoning-gym, one dataset or a weighted mix),
`file` (JSONL/Parquet rows of prompt and answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from rollwise.config import TaskConfig


@dataclass
class Problem:
    id: str
    prompt: str | list[dict]  # text, or chat messages [{"role", "content"}, ...]
    answer: str
    tier: str = "all"
    solution: str | None = None  # worked response for the supervised warm start
    data: dict[str, Any] = field(default_factory=dict)  # source row, for custom verifiers
    prompt_ids: list[int] | None = None  # made once by rollwise.tasks.prompts.Prompter
    group_size: int | None = None  # samples Control wants for it this round; None: the default


def draw_unique(n: int, draw: Callable[[int], Problem], exclude: set[str], split: str,
                what: str) -> list[Problem]:
    """n problems from draw(index), none whose prompt is in `exclude`; eval prompts are unique
    and join it (train may repeat, never an eval prompt). Built-in tasks draw with it."""
    out, tries = [], 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"{what} has too few distinct problems for {n} {split} prompts; "
                             "lower task.eval_size")
        p = draw(len(out))
        if p.prompt in exclude:
            continue
        if split == "eval":
            exclude.add(p.prompt)
        out.append(p)
    return out


class Task(Protocol):
    train: list[Problem]
    eval: list[Problem]

    def extract_answer(self, response: str) -> str | None: ...

    score_fn: Callable[[str, Problem], float] | None
    """Task's own scorer (reasoning-gym); None uses the configured verifier."""


def load_task(cfg: TaskConfig, rows: Any = None, eval_rows: Any = None) -> Task:
    """The configured task; rows / eval_rows: an in-memory dataset (list of dicts or a
    datasets.Dataset) used as task.name='file' rows."""
    if rows is not None:
        from rollwise.tasks.files import FileTask
        return FileTask(cfg, rows, eval_rows)
    if cfg.name == "arith":
        from rollwise.tasks.arith import ArithTask
        return ArithTask(cfg)
    if cfg.name == "calc":
        from rollwise.tasks.calc import CalcTask
        return CalcTask(cfg)
    if cfg.name == "packs":
        from rollwise.tasks.packs import PacksTask
        return PacksTask(cfg)
    if cfg.name == "gym" or cfg.name.startswith("gym:"):
        from rollwise.tasks.gym import GymTask
        return GymTask(cfg)
    if cfg.name == "file":
        from rollwise.tasks.files import FileTask
        return FileTask(cfg)
    raise ValueError(f"task.name = {cfg.name!r}: use 'arith', 'calc' (multi-turn, with a "
                     "calculator), 'packs' (Connect-the-Dots), 'gym:<reasoning-gym dataset>', "
                     "'gym' (the mix in task.gym) or 'file'")
