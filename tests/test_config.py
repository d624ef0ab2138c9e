from pathlib import Path

import pytest
import yaml

from rollwise.cli import main
from rollwise.config import Config, ConfigError, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_default_yaml_matches_the_built_in_defaults():
    assert load_config(ROOT / "configs" / "default.yaml") == Config()


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["train.lr=1e-4", "run.name=abc", "task.tiers={add2: 1.0}",
                             "filter.drop_equal_reward_groups=false"])
    assert cfg.train.lr == 1e-4 and cfg.run.name == "abc"
    assert cfg.task.tiers == {"add2": 1.0} and cfg.filter.drop_equal_reward_groups is False


@pytest.mark.parametrize("override, expected", [
    ("train.lrr=1", ["unknown key 'train.lrr'", "Did you mean 'lr'", "Allowed here"]),
    ("trian.lr=1", ["unknown key 'trian'", "Did you mean 'train'"]),
    ("train.lr=abc", ["train.lr = 'abc'", "valid number"]),
    ("generate.temperature=-1", ["generate.temperature = -1", "greater than 0"]),
    ("model.arch=gpt9", ["model.arch = 'gpt9'", "'qwen2' or 'llama'"]),
    ("train.steps", ["must look like section.key=value"]),
])
def test_bad_config_names_field_value_and_allowed(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    for text in expected:
        assert text in str(err.value)


def test_bad_file_and_cli_exit_code(tmp_path, capsys):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(tmp_path / "list.yaml")
    assert main(["config", "show", "train.lr=oops"]) == 2
    assert "train.lr = 'oops'" in capsys.readouterr().err


def test_config_show_round_trips(capsys):
    assert main(["config", "show", "train.lr=0.01"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert Config.model_validate(shown).train.lr == 0.01
    assert yaml.safe_load(dump_config(Config())) == Config().model_dump(mode="json")
