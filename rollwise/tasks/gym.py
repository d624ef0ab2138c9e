"""reasoning-gym datasets as tasks, with their generator settings and weighted mixes.

    task.name=gym:chain_sum task.gym.chain_sum.max_terms=3          # one dataset, its settings
    task.name=gym task.gym='{chain_sum: {weight: 2}, products: {max_digits: 1}}'   # a mix

`task.gym` maps a dataset to its settings (the fields of its reasoning-gym config class) and an
optional `weight` (1 by default). Problems are drawn as reasoning-gym's composite dataset draws
them: each index picks a dataset in proportion to the weights. Every setting is checked against
the dataset's config class, and one problem is generated, before any work; a wrong name or value
is a ConfigError that lists what is allowed. The held-out prompts are distinct and never among
the training prompts; each problem's tier is its dataset, so pass@1 is reported per dataset.
Scored by the configured verifier (math: math-verify on the extracted answer; gym: the
dataset's own `score_answer`).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Iterator

from rollwise.config import ConfigError, TaskConfig
from rollwise.tasks.base import Task, draw_unique
from rollwise.tasks.extract import task_extractor
from rollwise.types import Problem

# reasoning-gym seeds item i of a dataset with seed + i, so seeds s and s + 1 give the same
# problems one index apart: the held-out set's seed lies beyond any training index.
EVAL_SEED_OFFSET = 10**9


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    weight: float
    settings: dict[str, Any]


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
    try:  # the dataset's own checks, then one problem, so a bad value fails here, not later
        config = config_cls(seed=0, size=1, **_tuples(settings, config_cls))
        config.validate()
        dataset_cls(config)[0]
    except Exception as e:  # reasoning-gym reports with assert, ValueError or TypeError
        raise ConfigError(f"{where}: reasoning-gym rejects {settings} "
                          f"({type(e).__name__}: {e})") from None
    return Spec(dataset, float(weight), settings)


def _tuples(settings: dict[str, Any], config_cls) -> dict[str, Any]:
    """YAML lists as tuples where the config's default is a tuple (operators, ...)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    return {k: tuple(v) if isinstance(v, list) and isinstance(defaults.get(k), tuple) else v
            for k, v in settings.items()}


def make_dataset(chosen: list[Spec], size: int, seed: int):
    """reasoning-gym's composite dataset over `chosen` (its draw: a dataset per index by
    weight, then that dataset's item)."""
    # reasoning-gym: only for gym tasks (it imports many datasets)
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.factory import DATASETS
    return reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=[
        DatasetSpec(s.name, s.weight, _tuples(s.settings, DATASETS[s.name][1])) for s in chosen])


class GymTask(Task):
    def __init__(self, cfg: TaskConfig):
        self._extract = task_extractor(cfg.answer_format)
        self.specs = specs(cfg.name, cfg.gym)
        what = f"task {cfg.name} ({', '.join(s.name for s in self.specs)})"
        seen: set[str] = set()
        held = make_dataset(self.specs, 100 * cfg.eval_size + 1000, cfg.seed + EVAL_SEED_OFFSET)
        self.dataset = make_dataset(self.specs, 100 * cfg.train_size + 1000, cfg.seed)
        try:
            self.eval = draw_unique(cfg.eval_size, _drawer(held, "eval"), seen, "eval", what)
            self.train = draw_unique(cfg.train_size, _drawer(self.dataset, "train"), seen,
                                     "train", what)
        except ValueError as e:  # a problem space smaller than the held-out set
            raise ConfigError(f"{e}, or widen the settings in task.gym") from None

    def score_fn(self, response: str, problem: Problem) -> float:
        return float(self.dataset.score_answer(self.extract_answer(response), problem.data))

    def extract_answer(self, response: str) -> str | None:
        return self._extract(response)


def _drawer(dataset, split: str):
    """draw(_) for draw_unique: the dataset's entries in index order (a skipped duplicate
    moves on to the next index)."""
    entries: Iterator[int] = iter(range(len(dataset)))

    def draw(_: int) -> Problem:
        i = next(entries)
        entry = dataset[i]
        return Problem(id=f"{split}-{i}", prompt=entry["question"], answer=str(entry["answer"]),
                       tier=entry["metadata"]["source_dataset"], data=entry)
    return draw
