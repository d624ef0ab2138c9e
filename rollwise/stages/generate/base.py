"""What a generation strategy is. `generate` proposes trajectories; the other methods are what
the rest of a run needs from a strategy, with defaults for one whose samples are plain
responses. A strategy whose samples are something else (agent episodes, Connect-the-Dots
packs) overrides them, so evaluation, the warm start and the task check never ask for a
strategy by name."""

from __future__ import annotations

import abc

from rollwise.evaluate import evaluate
from rollwise.stages.generate.rollout import Rollout
from rollwise.tasks.base import solution_examples
from rollwise.tasks.prompts import Prompter, end_of_turn_id
from rollwise.types import Problem


class Generator(abc.ABC):
    produces = "responses"
    """What a sample is; a task whose `played_as` is not 'responses' needs a generator that
    produces the same ('episodes', 'packs')."""
    multi_turn = False
    """True: a sample's next request extends its last one (agent turns), so the engine's
    prefix cache pays (engine.prefix_cache_tokens=auto turns it on)."""
    runs_to_end = False
    """True: every sample must run to its end in the round that started it, so only
    control.inflight=none (RunToEnd) may drive it, never one that pauses or carries samples."""

    @abc.abstractmethod
    def generate(self, rollout: Rollout, problems: list[Problem], step: int) -> None:
        """Add a group per problem to the rollout (rollout.add) and run it (rollout.run,
        optionally with an event hook of its own, e.g. a tree's branching)."""

    def evaluate(self, engine, prompter, problems: list[Problem], cfg, scorer
                 ) -> dict[str, float]:
        """Held-out metrics (eval/pass1 at least) of the engine's policy on `problems`, played
        as this strategy plays them. Default: one response per prompt, scored by `scorer`,
        greedy or sampled as run.eval_samples and run.eval_temperature say."""
        return evaluate(engine, prompter, problems, scorer, cfg.generate.max_new_tokens,
                        cfg.run.eval_samples, cfg.run.eval_temperature)

    def warm_start_examples(self, cfg, task, tokenizer) -> list[tuple]:
        """The supervised warm start's examples, (token ids, prompt length[, loss mask over
        the response]). Default: the task's worked solutions with cfg.sft.noise, after the
        prompts as the run renders them (a chat model's template, ended by its end of turn)."""
        prompter = Prompter.for_task(cfg.task, tokenizer, task)
        stop = end_of_turn_id(tokenizer) if prompter.chat else None
        return solution_examples(task, tokenizer, cfg.sft.noise, cfg.run.seed,
                                 encode=prompter.encode, stop_id=stop)

    def bind(self, prompter=None, **_) -> None:
        """What the run has for it once built: the prompter (renders prompts of its own,
        e.g. NudgeRL's nudged ones). Default: nothing."""

    def close(self) -> None:
        """Release what the strategy holds beside the run (an agent strategy's server)."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the strategy between steps (none by default)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
