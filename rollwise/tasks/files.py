"""User datasets: JSONL or Parquet rows with a prompt and an answer column (names configurable).

A malformed row is reported with its line (or row) number and skipped; the count of skipped
rows is kept in `skipped`. The held-out split is task.eval_path, or the last task.eval_size
rows when no eval file is given.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rollwise.config import TaskConfig
from rollwise.tasks import Problem

log = logging.getLogger(__name__)


def _rows(path: Path):
    """(line number, row dict or error text) for each record of a .jsonl or .parquet file."""
    if path.suffix == ".parquet":
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


def read_problems(path: str | Path, prompt_field: str, answer_field: str,
                  split: str) -> tuple[list[Problem], list[str]]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task.path: {path} does not exist")
    if path.suffix not in (".jsonl", ".json", ".parquet"):
        raise ValueError(f"task.path: {path} must be a .jsonl or .parquet file")
    problems, errors = [], []
    for line, row in _rows(path):
        if isinstance(row, str):
            errors.append(f"{path}:{line}: {row}")
            continue
        missing = [k for k in (prompt_field, answer_field) if k not in row or row[k] is None]
        if missing:
            errors.append(f"{path}:{line}: missing field(s) {missing} (set task.prompt_field / "
                          f"task.answer_field if your columns are named differently)")
            continue
        if not isinstance(row[prompt_field], str) or not str(row[prompt_field]).strip():
            errors.append(f"{path}:{line}: field {prompt_field!r} must be a non-empty string")
            continue
        problems.append(Problem(id=f"{split}-{line}", prompt=row[prompt_field],
                                answer=str(row[answer_field]).strip(),
                                tier=str(row.get("tier", "all")),
                                solution=row.get("solution"), data=row))
    for e in errors:
        log.warning("skipped row %s", e)
    return problems, errors


class FileTask:
    score_fn = None

    def __init__(self, cfg: TaskConfig):
        if not cfg.path:
            raise ValueError("task.name='file' needs task.path=<file.jsonl|file.parquet>")
        rows, self.errors = read_problems(cfg.path, cfg.prompt_field, cfg.answer_field, "train")
        if cfg.eval_path:
            self.train = rows
            self.eval, errs = read_problems(cfg.eval_path, cfg.prompt_field, cfg.answer_field,
                                            "eval")
            self.errors += errs
        else:
            n = min(cfg.eval_size, len(rows) // 5)
            self.train, self.eval = rows[:len(rows) - n], rows[len(rows) - n:]
        self.skipped = len(self.errors)
        if not self.train or not self.eval:
            raise ValueError(f"task.path {cfg.path}: no usable rows for train/eval "
                             f"({self.skipped} skipped)")

    def extract_answer(self, response: str) -> str | None:
        text = response.strip()
        return text.splitlines()[-1].strip() if text else None
