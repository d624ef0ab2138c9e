"""What a user meets first, installed or cloned: presets by name from any folder, a version, a
`--help` that says what each command and option does, benchmarks listed, every config key
described, and wrong paths or keys said before any work (torch never imported for them)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest
from pydantic import BaseModel

import rollwise
from rollwise import presets
from rollwise.cli import build_parser, main
from rollwise.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """An empty working folder, as after pip install: no configs/ beside it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_preset_loads_by_name_from_an_empty_folder(elsewhere):
    names = presets.names()
    assert {"default", "smollm2", "smollm2-long", "dapo"} <= set(names)
    assert names == sorted(p.stem for p in (ROOT / "rollwise" / "configs").glob("*.yaml"))
    for name in names:
        by_name = load_config(name, check_files=False)
        assert by_name == load_config(presets.PRESETS / f"{name}.yaml", check_files=False)
        # the checkout's path, written in older commands, finds the preset too
        assert presets.resolve(f"configs/{name}.yaml") == presets.PRESETS / f"{name}.yaml"
        assert presets.about(name) and "\n" not in presets.about(name)
    assert load_config("default") == Config()


def test_a_file_here_wins_over_a_preset_and_a_missing_one_names_the_presets(elsewhere):
    (elsewhere / "smollm2.yaml").write_text("train: {steps: 3}\n")
    assert load_config("smollm2.yaml").train.steps == 3  # the user's own file
    assert load_config("smollm2", check_files=False).train.steps == 50  # the preset
    with pytest.raises(ConfigError, match=r"no such file, and no preset.*smollm2-long"):
        load_config("nosuch")
    with pytest.raises(ConfigError, match="a folder"):
        load_config(elsewhere)


def test_the_package_data_ships_every_preset_and_side_file():
    """pyproject's package-data patterns cover every file of rollwise/configs (the wheel CI
    stage checks the built wheel itself)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["rollwise"]
    for f in (ROOT / "rollwise" / "configs").iterdir():
        assert any(fnmatch(f"configs/{f.name}", p) for p in patterns), f.name
    assert presets.side_file("nudge-arithmetic.txt") == presets.PRESETS / "nudge-arithmetic.txt"


def test_configs_command_lists_shows_and_copies(elsewhere, capsys):
    assert main(["configs", "list"]) == 0
    listed = capsys.readouterr().out
    for name in presets.names():
        assert re.search(rf"^{re.escape(name)}\s+\S", listed, re.M), name
    assert main(["configs", "show", "dapo"]) == 0
    assert capsys.readouterr().out == (presets.PRESETS / "dapo.yaml").read_text()
    assert main(["configs", "copy", "dapo", "mine.yaml"]) == 0
    assert (elsewhere / "mine.yaml").read_text() == (presets.PRESETS / "dapo.yaml").read_text()
    assert main(["configs", "copy", "dapo", "mine.yaml"]) == 2  # never over a file
    assert "exists already" in capsys.readouterr().err
    assert main(["configs", "show", "nosuch"]) == 2
    assert "no preset 'nosuch'" in capsys.readouterr().err


def test_version_is_one_value_everywhere(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"rollwise {rollwise.__version__}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert pyproject["dynamic"]["version"]["attr"] == "rollwise.version.__version__"
    assert f"## {rollwise.__version__} " in (ROOT / "CHANGELOG.md").read_text()


def _subcommands(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_subcommand_and_option_says_what_it_does():
    subs = dict(_subcommands(build_parser()))
    assert {"train", "configs", "models", "generate", "bench", "eval"} <= set(subs)
    for name, p in subs.items():
        assert p.description and len(p.description) > 20, name
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"rollwise {name}: {action.dest} has no help"


def test_bench_lists_every_benchmark_and_a_wrong_name_lists_them(capsys):
    modules = sorted(p.stem for p in (ROOT / "rollwise" / "bench").glob("*.py")
                     if re.search(r"^def main\(", p.read_text(), re.M))
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    for m in modules:
        name = {"async_": "async"}.get(m, m)
        line = re.search(rf"^  {name}\s+(.+)$", out, re.M)
        assert line and len(line.group(1)) > 10, name
    assert main(["bench", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nosuch'" in err and "methods" in err


def test_every_config_key_is_described():
    undescribed = []

    def walk(model, prefix):
        for key, field in model.model_fields.items():
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                if not (field.description or kind.__doc__):
                    undescribed.append(prefix + key)
                walk(kind, f"{prefix}{key}.")
            elif not field.description:
                undescribed.append(prefix + key)
    walk(Config, "")
    assert undescribed == []


def test_public_functions_document_every_parameter():
    import inspect
    for fn in (rollwise.train, rollwise.load_config):
        doc = inspect.getdoc(fn)
        for name in inspect.signature(fn).parameters:
            assert re.search(rf"^\s+\**{name}:", doc, re.M), f"{fn.__name__}: {name}"


def test_a_bare_key_suggests_its_sectioned_names():
    with pytest.raises(ConfigError, match=r"did you mean train\.steps or sft\.steps"):
        load_config(None, ["steps=3"])
    with pytest.raises(ConfigError, match=r"Did you mean 'train'"):
        load_config(None, ["tran.steps=3"])


CHECK_BEFORE_WORK = """
import sys
from rollwise.cli import main
rc = main(sys.argv[1:])
heavy = [m for m in ("torch", "transformers", "reasoning_gym") if m in sys.modules]
print("rc", rc, "heavy", heavy)
"""


@pytest.mark.parametrize("argv, said", [
    (["train", "--config", "smollm2", "model.path=no/such/folder"], "model.path: no/such/folder"),
    (["train", "run.init=absent-folder"], "run.init: absent-folder"),
    (["train", "task.name=file", "task.path=absent.jsonl"], "task.path = 'absent.jsonl'"),
    (["train", "--config", "absent.yaml"], "config absent.yaml: no such file"),
    (["train", "--resume", "runs/absent"], "no config.yaml there"),
    (["export", "absent", "--merge"], "no such model folder"),
    (["eval", "--model", "absent"], "--model: absent"),
    (["train", "steps=3"], "train.steps or sft.steps"),
])
def test_wrong_paths_and_keys_are_said_before_the_training_stack_loads(elsewhere, argv, said):
    done = subprocess.run([sys.executable, "-c", CHECK_BEFORE_WORK, *argv], capture_output=True,
                          text=True, timeout=120, cwd=elsewhere,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                               "HOME": str(elsewhere)})
    assert said in done.stderr, done.stderr
    assert "rc 2 heavy []" in done.stdout, done.stdout


def test_a_listing_piped_to_head_ends_quietly(elsewhere):
    done = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -m rollwise bench "
                           f"| head -1"], capture_output=True, text=True, timeout=120,
                          cwd=elsewhere, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("rollwise bench NAME")
