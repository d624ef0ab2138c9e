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


@pytest.mark.parametrize("key, kind", [
    ("train.advantage", "advantage"), ("train.loss", "policy_loss"),
    ("train.loss_agg", "aggregation"), ("train.kl_estimator", "kl"),
    ("train.token_shaping", "token_shaping"), ("control.selector", "selector"),
    ("control.inflight", "inflight"), ("generate.strategy", "generator"),
    ("replay.strategy", "replay"), ("engine.backend", "engine"), ("filter.reward", "verifier")])
def test_every_seam_takes_a_known_name_or_a_dotted_path_and_lists_the_known_ones(key, kind):
    from rollwise import registry
    for name in registry.names(kind):  # every built-in name validates, imports nothing
        load_config(None, [f"{key}={name}"])
    assert load_config(None, [f"{key}=my_pkg.mod:Thing"])  # imported when the run builds it
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=no_such_thing"])
    msg = str(err.value)
    assert f"{key} = 'no_such_thing'" in msg and f"unknown {kind}" in msg
    assert all(name in msg for name in registry.names(kind))


def test_a_plugin_registered_by_name_validates_and_resolves():
    from rollwise import registry
    registry.register("selector", "first_n_test", "rollwise.stages.control.select_uniform:"
                                                  "UniformSelector.build")
    cfg = load_config(None, ["control.selector=first_n_test"])
    assert registry.resolve("selector", cfg.control.selector)(cfg).select(
        [1, 2, 3], 2, __import__("random").Random(0))
