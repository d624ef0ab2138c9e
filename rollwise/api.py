"""The Python entry point: what `rollwise train` does, with Python objects where the CLI takes
paths and names.

    import rollwise
    summary = rollwise.train(model="models/qwen", dataset=rows, reward=my_reward,
                             train={"steps": 50}, task={"prompt_template": "{prompt} ..."})

`config`: a YAML path, a Config, a dict of sections, or None (the defaults). Overrides are
sections as dicts (`train={"lr": 1e-4}`) or dotted keys (`**{"train.lr": 1e-4}`). `model`: a
model folder or a loaded Hugging Face causal LM (with `tokenizer`, or loadable from its
name_or_path). `dataset` / `eval_dataset`: a list of dicts or a `datasets.Dataset` with
prompt and answer columns (prompts: text or chat messages). `reward`: a verifier name, a
function (rollwise's fn(response, problem) or TRL's fn(prompts, completions, **kw)), or a
list of them, or {name or function: weight}.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from rollwise.config import Config, ConfigError, load_config, validate
from rollwise.preflight import check_paths


def train(config: str | Path | Config | dict | None = None, *, model: Any = None,
          tokenizer: Any = None, dataset: Any = None, eval_dataset: Any = None,
          reward: Any = None, resume: bool = False, **overrides: Any) -> dict:
    """Run RL training, as `rollwise train` does, and return the run's summary.

    Args:
        config: the starting config: a preset's name (`"smollm2"`; `rollwise configs list`), a
            YAML path, a `Config`, a dict of sections (`{"train": {"steps": 50}}`), or None
            for the built-in defaults (the default embedded CPU run).
        model: a model folder, a catalog name (`rollwise models get NAME`) or a hub id, put in
            `model.path`; or a loaded Hugging Face causal LM, trained in place. None: the
            config's model (by default the built-in tiny model, warm-started first).
        tokenizer: the tokenizer of a loaded `model`; found from the model's folder when it
            was loaded from one.
        dataset: training rows, a list of dicts or a `datasets.Dataset`, with a prompt (text,
            or chat messages `[{"role": ..., "content": ...}]`) and an answer; the column
            names are `task.prompt_field` and `task.answer_field`. A `solution` column feeds
            the warm start. Sets `task.name = "file"`. None: the config's task.
        eval_dataset: held-out rows in the same form; None: `task.eval_size` rows are held
            out of `dataset`.
        reward: a verifier name (`"math"`, `"exact"`, ...); a function
            `fn(response: str, problem) -> float` (problem.answer, problem.prompt and the
            row's other columns in problem.data; it may also return (reward, info), a dict of
            reward channels or a Verdict); TRL's batch style `fn(prompts, completions, **kw)
            -> list[float | None]`; a list of these (summed), or `{name or fn: weight}`. A
            per-sample function runs in a worker process with `filter.timeout_s` per sample,
            sent by value when it is defined in a script or notebook; an exception or a hang
            fails that sample alone, which is never trained.
        resume: continue the run `run.root/run.name` from its newest intact checkpoint,
            given the same Python objects as the first call; the result is the one an
            uninterrupted run gives.
        **overrides: config sections as dicts (`train={"lr": 1e-4}`), merged into `config`;
            or dotted keys, as `**{"train.lr": 1e-4}` (or `train__lr=1e-4`).

    Returns:
        The summary (summary.json): held-out pass@1 at start and end (`eval_pass1_start`,
        `eval_pass1_end`, and every metric in `eval_start` / `eval_end`), token totals, wall
        seconds and `run_dir`. A run stopped by Ctrl-C or SIGTERM after a checkpoint returns
        `stopped_at` (the step) and `stopped_by` (the signal) instead, and says how to resume.

    Raises:
        ConfigError: a bad key, value or path, named with what is allowed, before any work.
    """
    # the loop (torch) loads on the first call: `import rollwise` stays light
    from rollwise.loop.run import Inputs
    from rollwise.loop.run import train as run_training
    data = _config_data(config)
    for key, value in overrides.items():
        _merge(data, key.replace("__", ".").split("."), value)
    inputs = Inputs()
    if isinstance(model, (str, Path)):
        data.setdefault("model", {})["path"] = str(model)
    elif model is not None:
        inputs.model, inputs.tokenizer = model, tokenizer or _tokenizer_of(model)
        inputs.given["model"] = f"model ({type(model).__name__})"
    if dataset is not None:
        data.setdefault("task", {})["name"] = "file"
        inputs.rows, inputs.eval_rows = dataset, eval_dataset
        inputs.given["dataset"] = f"dataset ({_rows_note(dataset)})"
        if eval_dataset is not None:
            inputs.given["eval_dataset"] = f"eval_dataset ({_rows_note(eval_dataset)})"
    if reward is not None:
        data.setdefault("filter", {})["reward"] = _reward_spec(reward)
        functions = [r for r in _rewards(reward) if not isinstance(r, str)]
        if functions:
            inputs.given["reward"] = "reward (" + ", ".join(
                getattr(f, "__name__", type(f).__name__) for f in functions) + ")"
    check_paths(data)  # a wrong path said before validation's imports
    return run_training(validate(data), resume=resume, inputs=inputs)


def _config_data(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, Config):
        return config.model_dump()
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, Path)):
        return load_config(config).model_dump()
    raise ConfigError(f"config: give a YAML path, a Config or a dict, not a "
                      f"{type(config).__name__}")


def _merge(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {'.'.join(parts)}: '{p}' is not a section")
    if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
        for k, v in value.items():
            _merge(node[parts[-1]], [k], v)
    else:
        node[parts[-1]] = value


def _rows_note(rows) -> str:
    try:
        return f"{len(rows)} rows"
    except TypeError:
        return type(rows).__name__


def _rewards(reward) -> list:
    if isinstance(reward, dict):
        return list(reward)
    return list(reward) if isinstance(reward, (list, tuple)) else [reward]


def _tokenizer_of(model):
    path = getattr(model, "name_or_path", "")
    if path and (Path(path) / "tokenizer_config.json").exists():
        # transformers: only for a model given by path
        from rollwise.models import load_tokenizer
        return load_tokenizer(path)
    raise ValueError("model: a loaded model needs its tokenizer; pass tokenizer=..., or give "
                     "the model's folder instead")


def _reward_spec(reward) -> str | dict[str, float]:
    """filter.reward for `reward`: functions are registered as verifiers under their names."""
    if isinstance(reward, str):
        return reward
    if isinstance(reward, dict):
        return {_reward_name(k): float(w) for k, w in reward.items()}
    if isinstance(reward, (list, tuple)):
        return {_reward_name(r): 1.0 for r in reward}
    return _reward_name(reward)


def _reward_name(reward) -> str:
    if isinstance(reward, str):
        return reward
    # the filter (torch) loads with the first reward function
    from rollwise import registry
    from rollwise.stages.filter.python_fn import CallableVerifier, reward_name
    CallableVerifier(reward)  # fails here, naming the problem, when it is not callable
    name = reward_name(reward)
    if name in registry.BUILTIN["verifier"]:  # never shadow a built-in verifier
        name += "_fn"
    registry.register("verifier", name, lambda cfg, task: CallableVerifier(reward, name))
    return name
