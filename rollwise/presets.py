"""Built-in config presets: the YAML files (and their side files) shipped inside the package,
so `--config smollm2` works the same in a checkout and after `pip install`.

    resolve("smollm2")              -> .../rollwise/configs/smollm2.yaml
    resolve("my/run.yaml")          -> my/run.yaml (a path that exists is taken as it is)
    side_file("nudge-arithmetic.txt") -> the shipped file, where no such path exists here
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rollwise.errors import ConfigError
from rollwise.oneline import first_sentence

PRESETS = Path(__file__).resolve().parent / "configs"


def names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def path_of(name: str) -> Path:
    """A preset's file by name; a ConfigError listing the presets for an unknown one."""
    path = PRESETS / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        raise ConfigError(f"no preset {name!r}; the presets are {', '.join(names())} "
                          f"('rollwise configs list' says what each is)")
    return path


def resolve(spec: str | Path) -> Path:
    """The config file `spec` names: an existing path as it is, else a preset by name (also
    as 'configs/NAME.yaml', the checkout's path, so commands written for a checkout work after
    pip install). A ConfigError names both readings when neither exists."""
    path = Path(spec)
    if path.is_dir():
        raise ConfigError(f"config {spec}: a folder, not a YAML file")
    if path.is_file():
        return path
    if path.parent in (Path("."), Path("configs")) and path.suffix in ("", ".yaml"):
        if (PRESETS / f"{path.stem}.yaml").is_file():
            return PRESETS / f"{path.stem}.yaml"
    raise ConfigError(f"config {spec}: no such file, and no preset of that name; the presets "
                      f"are {', '.join(names())} ('rollwise configs list')")


def side_file(spec: str) -> Path:
    """A file a config names (e.g. generate.nudge.contexts_file): the path where it exists,
    else the preset folder's file of that name (presets name their side files so)."""
    path = Path(spec)
    if path.exists() or path.is_absolute():
        return path
    shipped = PRESETS / path.name
    return shipped if shipped.is_file() else path


def about(name: str) -> str:
    """A preset's one-line description: the first sentence of its header comment."""
    lines = []
    for line in path_of(name).read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return first_sentence(" ".join(lines), colon=False)


def copy(name: str, dest: str | Path) -> Path:
    """Copy a preset to `dest` (a file, or a folder to hold NAME.yaml) to edit; never over an
    existing file."""
    src = path_of(name)
    out = Path(dest)
    if out.is_dir():
        out = out / src.name
    if out.exists():
        raise ConfigError(f"{out} exists already; give another path or remove it first")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent}: no such folder")
    shutil.copyfile(src, out)
    return out
