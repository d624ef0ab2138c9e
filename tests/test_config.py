import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from rollwise.cli import main
from rollwise.config import Config, ConfigError, defaults_yaml, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_default_yaml_matches_the_built_in_defaults():
    assert load_config(ROOT / "configs" / "default.yaml") == Config()


def _model_keys(model, prefix: str = "") -> list[str]:
    """Every leaf key of the config classes, dotted."""
    keys = []
    for name, field in model.model_fields.items():
        nested = isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        keys += _model_keys(field.annotation, f"{prefix}{name}.") if nested else [prefix + name]
    return keys


def _lookup(data: dict, dotted: str):
    for part in dotted.split("."):
        data = data[part]
    return data


def test_default_yaml_is_generated_from_the_config_classes_and_lists_every_key():
    text = (ROOT / "configs" / "default.yaml").read_text()
    assert text == defaults_yaml(), ("configs/default.yaml drifted from rollwise/config.py: "
                                     "python3 -m rollwise config defaults > configs/default.yaml")
    listed, keys = yaml.safe_load(text), _model_keys(Config)
    defaults = Config().model_dump()
    for key in keys:  # present, at its default (a missing key would raise KeyError here)
        assert _lookup(listed, key) == _lookup(defaults, key), key
    for key in ("run.device", "task.chat_template", "generate.latr.eta", "control.arrol.keep",
                "engine.kv_budget_bytes"):
        assert key in keys
    # a field's docstring is its comment, right above it
    assert "    # Groups in flight per group wanted.\n    over_provision: 2.0\n" in text


def test_config_defaults_command_prints_the_file(capsys):
    assert main(["config", "defaults"]) == 0
    assert capsys.readouterr().out == (ROOT / "configs" / "default.yaml").read_text()
    assert main(["config", "defaults", "train.lr=1"]) == 2


@pytest.mark.parametrize("old, new", [
    ("control.arrol_keep=0.4", "control.arrol.keep"),
    ("control.duet_marker=x", "control.duet.marker"),
    ("control.over_provision=3", "control.april.over_provision"),
    ("control.dps_prior=flat", "control.dps.prior"),
    ("control.dars_max=4", "control.dars.max"),
    ("control.profile_samples=4", "control.sgpo.profile_samples"),
    ("control.group_min=3", "control.sgpo.group_min or control.duet.group_min"),
    ("control.decay=0.7", "control.dps.decay or control.thompson.decay"),
])
def test_a_flat_control_key_that_moved_names_its_new_key(old, new, tmp_path):
    with pytest.raises(ConfigError, match="is now " + new.replace(".", r"\.")):
        load_config(None, [old])
    key, value = old.split("=")
    path = tmp_path / "old.yaml"
    path.write_text(f"control:\n  {key.split('.')[1]}: {value}\n")
    with pytest.raises(ConfigError, match=new.split(" ")[0].replace(".", r"\.")):
        load_config(path)


def test_method_sections_reach_their_methods():
    from rollwise.stages.control.abort_duet import Duet
    from rollwise.stages.control.alloc_sgpo import SGPO
    from rollwise.stages.control.april import April
    from rollwise.stages.control.prune_arrol import Arrol
    from rollwise.stages.control.select_dps import DPSSelector
    from rollwise.stages.control.select_thompson import ThompsonSelector
    cfg = load_config(None, ["control.duet.group_min=3", "control.duet.group_max=5",
                             "control.sgpo.group_min=4", "control.april.over_provision=3",
                             "control.arrol.keep=0.25", "control.dps.decay=0.7",
                             "control.dps.candidate_ratio=8", "control.thompson.decay=0.9"])
    duet, sgpo = Duet(cfg), SGPO(cfg)
    assert (duet.lo, duet.hi, sgpo.lo, sgpo.hi) == (3, 5, 4, 16)
    assert April(cfg).over == 3 and Arrol(cfg).kappa == 0.25
    dps, thompson = DPSSelector.build(cfg), ThompsonSelector.build(cfg)
    assert (dps.decay, dps.candidate_ratio, thompson.decay) == (0.7, 8, 0.9)
    with pytest.raises(ConfigError, match="control.duet.group_min = 6 > control.duet.group_max"):
        load_config(None, ["control.duet.group_min=6", "control.duet.group_max=5"])


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["train.lr=1e-4", "run.name=abc", "task.tiers={add2: 1.0}",
                             "filter.drop_equal_reward_groups=false"])
    assert cfg.train.lr == 1e-4 and cfg.run.name == "abc"
    assert cfg.task.tiers == {"add2": 1.0} and cfg.filter.drop_equal_reward_groups is False


def test_an_override_that_is_not_yaml_is_its_text():
    """A prompt template such as '{prompt} Put the answer in \\boxed{}.' is not YAML (and
    '{prompt}' is a YAML mapping): a text field takes the text as written; null stays null,
    and a field that is not text still refuses it, naming the key."""
    template = r"{prompt} Put the final answer in \boxed{}."
    cfg = load_config(None, [f"task.prompt_template={template}", "run.name=007",
                             "task.system_prompt=null"])
    assert cfg.task.prompt_template == template and cfg.run.name == "007"
    assert cfg.task.system_prompt is None
    assert load_config(None, ["task.prompt_template={prompt}"]).task.prompt_template == "{prompt}"
    with pytest.raises(ConfigError, match=r"task.tiers = '\{add2: \[\}'.*dictionary"):
        load_config(None, ["task.tiers={add2: [}"])


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
    with pytest.raises(ConfigError, match="no such file, and no preset"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(tmp_path / "list.yaml")
    assert main(["config", "show", "train.lr=oops"]) == 2
    assert "train.lr = 'oops'" in capsys.readouterr().err


def test_overrides_after_the_config_file_are_taken_in_any_order(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text("train:\n  lr: 0.5\n  steps: 7\n")
    for argv in (["config", "show", "--config", str(tmp_path / "c.yaml"), "train.lr=0.02"],
                 ["config", "show", "train.lr=0.02", "--config", str(tmp_path / "c.yaml")]):
        assert main(argv) == 0
        shown = Config.model_validate(yaml.safe_load(capsys.readouterr().out))
        assert (shown.train.lr, shown.train.steps) == (0.02, 7)
    with pytest.raises(SystemExit):  # anything else unknown is still refused
        main(["config", "show", "--config", str(tmp_path / "c.yaml"), "--bogus"])


def test_a_check_that_names_its_key_is_not_prefixed_twice(capsys):
    assert main(["config", "show", "generate.strategy=nopkg.mod:thing"]) == 2
    err = capsys.readouterr().err
    assert err.count("generate.strategy = 'nopkg.mod:thing'") == 1
    assert "Value error" not in err and "cannot import nopkg.mod:thing" in err


@pytest.mark.parametrize("override, expected", [
    ("generate.strategy=nopkg.mod:thing", "cannot import nopkg.mod:thing"),
    ("task.gym.chain_sum.max_digitz=2", "max_digitz: not a setting"),
    ("filter.reward=math", "filter.reward=gym"),
])
def test_train_says_a_config_error_before_importing_torch(tmp_path, override, expected):
    """The training stack (torch and the rest) is imported only once the config and the
    task's settings are known to be good: a mistake is said in a second or two."""
    import subprocess
    import sys
    task = "task.name=gym:countdown" if "reward" in override else "task.name=gym:chain_sum"
    code = ("import sys; from rollwise.cli import main; "
            f"rc = main(['train', 'run.root={tmp_path}', '{task}', '{override}']); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.split() == ["2", "False"], out.stderr
    assert expected in out.stderr and not any(tmp_path.iterdir())


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
    ("replay.strategy", "replay"), ("engine.backend", "engine"), ("filter.reward", "verifier"),
    ("generate.scope.verifier", "process_verifier")])
def test_every_seam_takes_a_known_name_or_a_dotted_path_and_lists_the_known_ones(key, kind):
    """A dotted path is imported when the config is loaded, before any work: a misspelt
    module or attribute, or an object that is not a class or function, stops there."""
    from rollwise import registry
    needs = {"mssr": ["control.baseline=running"],  # a name that needs a companion setting
             "nudge": ["generate.nudge.contexts=[a hint]"]}
    for name in registry.names(kind):  # every built-in name validates, imports nothing
        load_config(None, [f"{key}={name}", *needs.get(name, [])])
    assert load_config(None, [f"{key}=fractions:Fraction"])  # any class or function imports
    for wrong, says in (("my_pkg.mod:Thing", "cannot import my_pkg.mod:Thing "
                                             "(ModuleNotFoundError"),
                        ("fractions:NoSuchThing", "has no attribute 'NoSuchThing'"),
                        ("math:pi", "is float 3.14")):
        with pytest.raises(ConfigError, match=re.escape(f"{key} = {wrong!r}")) as err:
            load_config(None, [f"{key}={wrong}"])
        assert says in str(err.value)
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


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_dtype_takes_bf16_only_where_the_device_has_it(monkeypatch, native, expected):
    import rollwise.devices as devices
    seen = []
    monkeypatch.setattr(devices, "native_bf16", lambda d: seen.append(d) or native)
    cfg = load_config(None, ["model.dtype=auto", "run.device=cpu"])
    assert (cfg.model.dtype, seen) == (expected, ["cpu"])
    assert "dtype: " + expected in dump_config(cfg)  # a run's saved config says which
    assert load_config(None, ["model.dtype=float16"]).model.dtype == "float16"  # asked: kept


@pytest.mark.parametrize("caps, expected", [
    ({"avx512_bf16": True, "amx_bf16": False}, True),
    ({"avx512_bf16": False, "amx_bf16": True}, True),
    ({"avx512_bf16": False, "amx_bf16": False, "avx512_f": True}, False),  # emulated: slower
    ({}, False)])
def test_native_bf16_on_a_cpu_reads_its_instruction_sets(monkeypatch, caps, expected):
    import torch

    from rollwise.devices import native_bf16
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    assert native_bf16("cpu") is expected


@pytest.mark.parametrize("caps, expected", [
    ({"cpu_name": "AMD EPYC", "avx512_bf16": True}, "AMD EPYC, 4 cores, avx512_bf16"),
    ({"cpu_name": "Intel Xeon", "amx_bf16": True, "avx512_bf16": True},
     "Intel Xeon, 4 cores, amx_bf16"),
    ({}, "CPU, 4 cores")])
def test_a_cpu_machine_is_named_by_its_model_cores_and_bf16_path(monkeypatch, caps, expected):
    import os

    import torch

    from rollwise.devices import machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    machine.cache_clear()
    try:
        assert machine() == expected
    finally:
        machine.cache_clear()


@pytest.mark.parametrize("overrides,match", [
    (["loop.carried_kv=keep", "engine.backend=vllm"], "engine.backend=vllm prefills"),
    (["loop.carried_kv=keep", "loop.backend=ray"], "loop.backend=ray prefills"),
    (["loop.carried_kv=recompute", "loop.mode=async", "loop.backend=ray"],
     "only the built-in engine"),
])
def test_carried_kv_an_engine_cannot_honour_is_refused_naming_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_carried_kv_choices_resolve_by_loop():
    assert not load_config(None, []).keeps_carried_kv()  # auto: carried answers recompute
    assert load_config(None, ["loop.carried_kv=keep"]).keeps_carried_kv()
    assert not load_config(None, ["loop.mode=async"]).recomputes_in_flight()  # auto: keep
    assert load_config(None, ["loop.mode=async",
                              "loop.carried_kv=recompute"]).recomputes_in_flight()
