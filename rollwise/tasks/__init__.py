"""Tasks: problem sets with verifiable answers, split into train and held-out eval.

A task (rollwise.tasks.base.Task) gives `train` and `eval` lists of Problem and
`extract_answer(response_text)`, the string the verifier compares with the problem's answer.
`task.name` picks one through rollwise.registry: `arith` (tiers of growing difficulty), `calc`
(multi-turn episodes with a calculator), `packs` (Connect-the-Dots packs), `gym:<name>` and
`gym` (reasoning-gym, one dataset or a weighted mix), `file` (JSONL/Parquet rows of prompt and
answer), or 'package.module:factory' called as factory(cfg). A registered name takes a
variant after a colon (`gym:chain_sum`): the factory reads it from cfg.name.
"""

from __future__ import annotations

from typing import Any

from rollwise import registry
from rollwise.config import TaskConfig
from rollwise.tasks.base import Task, draw_unique, solution_examples
from rollwise.tasks.files import FileTask
from rollwise.types import Problem

__all__ = ["Problem", "Task", "draw_unique", "load_task", "solution_examples", "task_name"]


def task_name(name: str) -> str:
    """The registry name task.name stands for: 'gym:chain_sum' is the task 'gym'."""
    head = name.split(":", 1)[0]
    return head if head in registry.names("task") else name


def load_task(cfg: TaskConfig, rows: Any = None, eval_rows: Any = None) -> Task:
    """The configured task; rows / eval_rows: an in-memory dataset (list of dicts or a
    datasets.Dataset) used as task.name='file' rows."""
    if rows is not None:
        return FileTask(cfg, rows, eval_rows)
    factory = registry.resolve("task", task_name(cfg.name), "task.name")
    return registry.conform(factory(cfg), Task, "task.name")
