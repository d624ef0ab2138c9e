"""The files a config names, checked on its raw data before validation: validation may import
reasoning-gym or torch (seconds), and a wrong path should be said at once. Each check reads
only the file system; values of the wrong type are left to validation to name.
"""

from __future__ import annotations

from pathlib import Path

from rollwise import presets
from rollwise.catalog import resolve_model_path
from rollwise.errors import ConfigError


def _get(data: dict, dotted: str):
    node = data
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _model(key: str, value: str) -> None:
    try:
        resolve_model_path(value)
    except FileNotFoundError as e:
        raise ConfigError(f"{key}: {e}") from None


def _data_file(key: str, value: str) -> None:
    if not Path(value).expanduser().is_file():
        raise ConfigError(f"{key} = {value!r}: no such file (a .jsonl or .parquet of rows)")


def _text_file(key: str, value: str) -> None:
    if not presets.side_file(value).is_file():
        raise ConfigError(f"{key} = {value!r}: no such file (a path, or the name of a file "
                          f"shipped with the presets)")


CHECKS = {
    "model.path": _model,
    "run.init": _model,
    "task.path": _data_file,
    "task.eval_path": _data_file,
    "generate.nudge.contexts_file": _text_file,
}


def check_paths(data: dict) -> None:
    """A ConfigError for the first path in `data` that does not exist (or is not what its key
    takes), before any of the config is validated."""
    for key, check in CHECKS.items():
        value = _get(data, key)
        if isinstance(value, (str, Path)) and str(value):
            check(key, str(value))
