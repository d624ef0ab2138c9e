"""Supervised warm start on tool-using episodes: the task's teacher writes the model's turns
(`task.worked_actions(problem, rng, noisy) -> [text, ...]`), and the environment the episodes
run in answers them, so the transcripts are made of exactly the tokens an episode holds: the
prompt, each turn's tokens and its stop token (trained), and the environment's observation
tokens from the same turn rendering as rollwise.agents.episode (not trained).
"""

from __future__ import annotations

import random

from rollwise.agents.env import as_message, build_env_factory
from rollwise.agents.turns import turns_for
from rollwise.tasks.prompts import Prompter


def episode_examples(cfg, task, tokenizer, noise: float | dict[str, float],
                     seed: int) -> list[tuple[list[int], int, list[int]]]:
    """(token ids, prompt length, loss mask over the response) for every train problem."""
    make_env, turns = build_env_factory(cfg), turns_for(tokenizer)
    prompter = Prompter.for_task(cfg.task, tokenizer, task)
    stop = tokenizer.eos_token_id
    rng = random.Random(seed)
    out = []
    for p in task.train:
        share = noise.get(p.tier, 0.0) if isinstance(noise, dict) else noise
        actions = task.worked_actions(p, rng, noisy=share > 0 and rng.random() < share)
        out.append(transcript(p, actions, make_env(p), turns, prompter.ids(p), stop, tokenizer))
    if not out:
        raise ValueError("the task has no train problems to warm-start from")
    return out


def transcript(problem, actions: list[str], env, turns, prompt_ids: list[int], stop: int,
               tokenizer) -> tuple[list[int], int, list[int]]:
    """One episode played by the teacher's actions until the environment ends it."""
    messages = [{"role": "user", "content": problem.prompt}] \
        if isinstance(problem.prompt, str) else list(problem.prompt)
    first = env.reset(problem)
    if first is not None:  # the environment opens the episode itself
        messages = [as_message(first)]
        prompt_ids = turns.prompt_ids(messages)
    ids, mask = list(prompt_ids), []
    for action in actions:
        turn = tokenizer.encode(action, add_special_tokens=False) + [stop]
        ids += turn
        mask += [1] * len(turn)
        messages.append({"role": "assistant", "content": action})
        observation, _, done, _ = env.step(action)
        if done or observation is None:
            break
        obs = as_message(observation)
        obs_ids = turns.observation_ids(messages, turn, obs)
        if obs_ids is None:
            raise ValueError(f"problem {problem.id}: the chat template cannot extend the "
                             f"teacher's turn {action!r} exactly; its transcript cannot be "
                             "one sequence")
        messages.append(obs)
        ids += obs_ids
        mask += [0] * len(obs_ids)
    return ids, len(prompt_ids), mask
