"""User datasets: rows with a prompt and an answer (column names configurable), from a JSONL or
Parquet file, or in memory (a list of dicts or a `datasets.Dataset`, from rollwise.train).

A prompt is a non-empty string or a list of chat messages ({"role", "content"}); the answer
field may be a dotted path into a nested column (verl's `reward_model.ground_truth`). A
malformed row is reported with its line (or row) number and skipped; the count of skipped rows
is kept in `skipped`. The held-out split is task.eval_path (or the eval rows given), else
task.eval_size rows (at most a fifth) drawn at random (task.seed) from the whole file, so a
sorted file's held-out rows are not its tail; the train rows keep the file's order.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Iterable

from rollwise.config import TaskConfig
from rollwise.tasks.base import Task
from rollwise.tasks.extract import task_extractor
from rollwise.tasks.prompts import check_messages
from rollwise.types import Problem

log = logging.getLogger(__name__)


def _file_rows(path: Path):
    """(line number, row dict or error text) for each record of a .jsonl or .parquet file."""
    if path.suffix == ".parquet":
        # pyarrow: only for a Parquet file
        import pyarrow.parquet as pq
        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
        return
    with open(path) as f:
        for i, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                yield i, f"not valid JSON ({e.msg})"
                continue
            yield i, row if isinstance(row, dict) else "not a JSON object"


def _field(row: dict, path: str) -> Any:
    """row[path], or the dotted path into nested mappings; None where a part is missing."""
    if path in row:
        return row[path]
    node: Any = row
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _prompt_error(prompt: Any, field: str) -> str | None:
    """Why a prompt value is unusable, or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else f"field {field!r} is an empty string"
    if isinstance(prompt, list):
        why = check_messages(prompt)
        return None if why is None else f"field {field!r}: {why}"
    return (f"field {field!r} must be a non-empty string or a list of chat messages "
            f"(got {type(prompt).__name__})")


def parse_rows(rows: Iterable[tuple[int, Any]], where: str, prompt_field: str,
               answer_field: str, split: str) -> tuple[list[Problem], list[str]]:
    """Problems from (line number, row) pairs; errors name `where:line` and what is wrong."""
    problems, errors = [], []
    for line, row in rows:
        if isinstance(row, str):
            errors.append(f"{where}:{line}: {row}")
            continue
        prompt, answer = _field(row, prompt_field), _field(row, answer_field)
        missing = [k for k, v in ((prompt_field, prompt), (answer_field, answer)) if v is None]
        if missing:
            errors.append(f"{where}:{line}: missing field(s) {missing} (set task.prompt_field / "
                          f"task.answer_field if your columns are named differently)")
            continue
        why = _prompt_error(prompt, prompt_field)
        if why:
            errors.append(f"{where}:{line}: {why}")
            continue
        problems.append(Problem(id=f"{split}-{line}", prompt=prompt, answer=str(answer).strip(),
                                tier=str(row.get("tier", "all")),
                                solution=row.get("solution"), data=row))
    for e in errors:
        log.warning("skipped row %s", e)
    return problems, errors


def read_problems(path: str | Path, prompt_field: str, answer_field: str,
                  split: str) -> tuple[list[Problem], list[str]]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task.path: {path} does not exist")
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"task.path: {path} must be a .jsonl or .parquet file")
    return parse_rows(_file_rows(path), str(path), prompt_field, answer_field, split)


def memory_rows(rows: Any) -> list[tuple[int, Any]]:
    """(row number, dict) of a list of dicts or a datasets.Dataset (anything iterable of
    mappings); a row that is not a mapping is reported by its number."""
    if isinstance(rows, (str, bytes, dict)) or not hasattr(rows, "__iter__"):
        raise TypeError(f"dataset: give a list of dicts or a datasets.Dataset, not a "
                        f"{type(rows).__name__}")
    return [(i, dict(r) if hasattr(r, "keys") else "not a mapping")
            for i, r in enumerate(rows, start=1)]



def held_out_split(rows: list, n: int, seed: int) -> tuple[list, list]:
    """(train, held-out): n rows drawn at random by `seed`; both keep the rows' order."""
    held = set(random.Random(seed).sample(range(len(rows)), n))
    return ([r for i, r in enumerate(rows) if i not in held],
            [r for i, r in enumerate(rows) if i in held])

class FileTask(Task):

    def __init__(self, cfg: TaskConfig, rows: Any = None, eval_rows: Any = None):
        """rows / eval_rows: in-memory datasets in place of task.path / task.eval_path."""
        self._extract = task_extractor(cfg.answer_format)
        fields = (cfg.prompt_field, cfg.answer_field)
        if rows is not None:
            train, self.errors = parse_rows(memory_rows(rows), "dataset row", *fields, "train")
        elif cfg.path:
            train, self.errors = read_problems(cfg.path, *fields, "train")
        else:
            raise ValueError("task.name='file' needs task.path=<file.jsonl|file.parquet>")
        if eval_rows is not None:
            self.eval, errs = parse_rows(memory_rows(eval_rows), "eval row", *fields, "eval")
            self.errors += errs
            self.train = train
        elif cfg.eval_path:
            self.eval, errs = read_problems(cfg.eval_path, *fields, "eval")
            self.errors += errs
            self.train = train
        else:
            self.train, self.eval = held_out_split(train, min(cfg.eval_size, len(train) // 5),
                                                   cfg.seed)
        self.skipped = len(self.errors)
        if not self.train or not self.eval:
            raise ValueError(f"dataset {cfg.path or '(in memory)'}: no usable rows for "
                             f"train/eval ({self.skipped} skipped)")

    def extract_answer(self, response: str) -> str | None:
        return self._extract(response)
