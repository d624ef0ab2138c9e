"""reasoning-gym datasets as tasks: task.name='gym:<dataset>', scored by the dataset's own
`score_answer`. Train and eval are generated from different seeds."""

from __future__ import annotations

from rollwise.config import TaskConfig
from rollwise.stages.filter.extract import task_extractor
from rollwise.tasks import Problem


class GymTask:
    def __init__(self, cfg: TaskConfig):
        import reasoning_gym
        self._extract = task_extractor(cfg.answer_format)
        name = cfg.name.split(":", 1)[1]
        try:
            train = reasoning_gym.create_dataset(name, size=cfg.train_size, seed=cfg.seed)
            held = reasoning_gym.create_dataset(name, size=cfg.eval_size, seed=cfg.seed + 1)
        except Exception as e:
            raise ValueError(f"task.name={cfg.name!r}: reasoning-gym could not build it ({e})")
        self.dataset = train
        self.train = [self._problem(e, f"train-{i}") for i, e in enumerate(train)]
        self.eval = [self._problem(e, f"eval-{i}") for i, e in enumerate(held)]

    @staticmethod
    def _problem(entry: dict, pid: str) -> Problem:
        return Problem(id=pid, prompt=entry["question"], answer=str(entry["answer"]),
                       tier=str(entry.get("metadata", {}).get("difficulty", "all")), data=entry)

    def score_fn(self, response: str, problem: Problem) -> float:
        return float(self.dataset.score_answer(self.extract_answer(response), problem.data))

    def extract_answer(self, response: str) -> str | None:
        return self._extract(response)
