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

from typing import Iterator

from rollwise.config import ConfigError, TaskConfig
from rollwise.gym_settings import Spec, specs, tuples
from rollwise.tasks.base import Task, draw_unique
from rollwise.tasks.extract import task_extractor
from rollwise.types import Problem

# reasoning-gym seeds item i of a dataset with seed + i, so seeds s and s + 1 give the same
# problems one index apart: the held-out set's seed lies beyond any training index.
EVAL_SEED_OFFSET = 10**9


def make_dataset(chosen: list[Spec], size: int, seed: int):
    """reasoning-gym's composite dataset over `chosen` (its draw: a dataset per index by
    weight, then that dataset's item)."""
    # reasoning-gym: only for gym tasks (it imports many datasets)
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.factory import DATASETS
    return reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=[
        DatasetSpec(s.name, s.weight, tuples(s.settings, DATASETS[s.name][1])) for s in chosen])


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
