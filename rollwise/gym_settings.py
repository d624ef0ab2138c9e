"""reasoning-gym datasets as the config names them (task.name, task.gym), checked before any
work: each dataset and setting against reasoning-gym, a few problems generated, and the
verifier asked to score them. No torch here: config validation runs these checks (Config),
before anything imports the training stack, so a wrong setting is said in a second or two.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from typing import Any

from rollwise.errors import ConfigError

ANSWERS_SEEN = 8  # problems generated per dataset by the checks
# a reference math-verify can compare safely: a number (an integer, a decimal, a fraction)
PLAIN_NUMBER = re.compile(r"\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?(\s*/\s*\d+)?\s*")
MATH_VERIFIERS = ("math", "math_verify")


def precheck(task_name: str, gym: dict, reward: str | dict[str, float]) -> None:
    """The checks of a gym task's config (task.name, task.gym, filter.reward) that need
    reasoning-gym but not the training stack; nothing for other tasks."""
    if task_name == "gym" or task_name.startswith("gym:"):
        check_reward(specs(task_name, gym), reward)


def check_reward(chosen: list[Spec], reward: str | dict[str, float]) -> None:
    """math-verify compares by value: where a dataset's reference is an expression that
    reaches a target (countdown: '(3+4)*5' for 35), restating the target would score 1, and
    where it is a form (a simplified fraction), any equal value would. Only datasets whose
    references are plain numbers may be scored by it; the others by their own scorer."""
    names = [reward] if isinstance(reward, str) else list(reward)
    math = [n for n in names if n in MATH_VERIFIERS]
    bad = {s.name: a for s in chosen for a in s.answers if not PLAIN_NUMBER.fullmatch(a)}
    if math and bad:
        which = ", ".join(f"{k} (e.g. {v!r})" for k, v in bad.items())
        raise ConfigError(f"filter.reward = {math[0]}: the references of {which} are not plain "
                          f"numbers; math-verify compares by value, so it would accept any "
                          f"answer of equal value (for countdown, the target itself) where the "
                          f"dataset asks for this form. Score them with the dataset's own "
                          f"scorer: filter.reward=gym")


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    weight: float
    settings: dict[str, Any]
    answers: tuple[str, ...] = ()  # a few of its problems' reference answers


def specs(name: str, gym: dict[str, dict[str, Any]]) -> list[Spec]:
    """The datasets task.name and task.gym ask for, each checked against reasoning-gym."""
    import reasoning_gym  # noqa: F401 (deferred on purpose: a second to import, gym tasks only)
    from reasoning_gym.factory import DATASETS
    if name == "gym":
        if not gym:
            raise ConfigError("task.name = gym draws from the datasets of task.gym, which is "
                              "empty: e.g. task.gym='{chain_sum: {}, products: {weight: 2}}', "
                              "or task.name=gym:<dataset> for one")
        chosen = gym
    else:
        one = name.split(":", 1)[1]
        others = sorted(set(gym) - {one})
        if others:
            raise ConfigError(f"task.name = {name} uses one dataset, but task.gym also has "
                              f"{', '.join(others)}: set task.name=gym to mix them")
        chosen = {one: gym.get(one) or {}}
    where = "task.gym.{}" if name == "gym" else f"task.name = {name}: task.gym.{{}}"
    out = [_spec(ds, settings or {}, DATASETS, where.format(ds)) for ds, settings in
           chosen.items()]
    if len(out) > 1 and any(s.name == "composite" for s in out):
        raise ConfigError("task.gym: 'composite' is a mix itself; list its datasets instead")
    return out


def _spec(dataset: str, settings: dict[str, Any], registry: dict, where: str) -> Spec:
    if dataset not in registry:
        guess = difflib.get_close_matches(dataset, list(registry), n=3)
        hint = f" Did you mean {', '.join(guess)}?" if guess else ""
        raise ConfigError(f"{where}: reasoning-gym has no dataset {dataset!r}.{hint} "
                          f"(reasoning_gym.factory.DATASETS lists {len(registry)})")
    if not isinstance(settings, dict):
        raise ConfigError(f"{where} must be a mapping of settings, got {settings!r}")
    settings = dict(settings)
    weight = settings.pop("weight", 1.0)
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
        raise ConfigError(f"{where}.weight = {weight!r}: give a number > 0")
    dataset_cls, config_cls = registry[dataset]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for key in settings:
        if key not in fields:
            guess = difflib.get_close_matches(key, fields, n=1)
            hint = f" Did you mean '{guess[0]}'?" if guess else ""
            raise ConfigError(f"{where}.{key}: not a setting of reasoning-gym's {dataset}."
                              f"{hint} Its settings: {', '.join(fields)}")
    try:  # the dataset's own checks, then a few problems: a bad value fails here, not later
        config = config_cls(seed=0, size=ANSWERS_SEEN, **tuples(settings, config_cls))
        config.validate()
        generated = dataset_cls(config)
        answers = tuple(str(generated[i]["answer"]) for i in range(ANSWERS_SEEN))
    except Exception as e:  # reasoning-gym reports with assert, ValueError or TypeError
        raise ConfigError(f"{where}: reasoning-gym rejects {settings} "
                          f"({type(e).__name__}: {e})") from None
    return Spec(dataset, float(weight), settings, answers)


def tuples(settings: dict[str, Any], config_cls) -> dict[str, Any]:
    """YAML lists as tuples where the config's default is a tuple (operators, ...)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    return {k: tuple(v) if isinstance(v, list) and isinstance(defaults.get(k), tuple) else v
            for k, v in settings.items()}
