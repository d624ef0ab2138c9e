"""What a run started by rollwise.train() was given as Python objects (a model, a dataset, a
reward function), recorded in its directory: the command line cannot give them back, so a stop
says how to resume in Python, and `rollwise train --resume` refuses such a run before any work.
No torch here: the CLI reads it first.
"""

from __future__ import annotations

import json
from pathlib import Path

from rollwise.errors import ConfigError

PYTHON_INPUTS = "python-inputs.json"  # {"dataset": "dataset (2500 rows)", ...}


def python_inputs(run_dir: str | Path) -> dict[str, str]:
    path = Path(run_dir) / PYTHON_INPUTS
    return json.loads(path.read_text()) if path.is_file() else {}


def resume_hint(run_dir: Path) -> str:
    """How to continue the run in `run_dir`: the CLI command, or rollwise.train(...,
    resume=True) with the same objects for a run started with Python objects."""
    given = python_inputs(run_dir)
    if not given:
        return f"'rollwise train --resume {run_dir}'"
    return (f"rollwise.train(..., resume=True) given the same {', '.join(given)} "
            f"(run.root={str(run_dir.parent)!r}, run.name={run_dir.name!r})")


def refuse_cli_resume(run_dir: Path) -> None:
    """A ConfigError naming the objects, for a run the command line cannot resume."""
    given = python_inputs(run_dir)
    if given:
        raise ConfigError(f"--resume {run_dir}: this run was started by rollwise.train() with "
                          f"Python objects the command line cannot give: "
                          f"{'; '.join(given.values())}. Resume it in Python: "
                          f"rollwise.train(..., resume=True) with the same {', '.join(given)} "
                          f"and run.name={run_dir.name!r}")
