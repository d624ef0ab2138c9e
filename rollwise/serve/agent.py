"""Agents written against the OpenAI client as a Generator (generate.strategy=agent,
generate.agent=package.module:function).

    def solve(problem, client):           # client: openai.OpenAI for this episode alone
        r = client.chat.completions.create(model=client.model, messages=[...], tools=[...])
        ...
        return 1.0        # a reward (filter.reward=env), or a str: the final answer, scored
                          # by the run's filter.reward like any response

Each round serves the run's engine on 127.0.0.1 (rollwise.serve.app) and plays
`group_size` episodes per prompt, each in its own thread with its own base URL
(/episodes/<token>/v1), at most generate.agent_concurrency at once; the engine batches the
calls of every episode. An episode's calls become samples by rollwise.serve.chat's rule:
consecutive calls that extend the conversation exactly are one sample, with the agent's and
tools' tokens masked out; a call that rewrites history starts a new one (counted as
decisions/agent/split/rewrite). Inside a training round the calls sample as the policy does
(generate.temperature and top_p, whatever the client asks); max_tokens, stop and n are the
client's. An agent that raises, returns nothing usable or runs past generate.agent_timeout_s
fails its episode: its samples are stored with the reason and never trained, and its later
calls are refused (404). Every token keeps the version that sampled it: in the asynchronous
loop the engine is stepped under the loop's weight gate, as any rollout is.
"""

from __future__ import annotations

import importlib
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field

from rollwise import models, registry
from rollwise.agents.transcripts import episode_examples
from rollwise.engine import SamplingParams
from rollwise.evaluate import EVAL_SEED
from rollwise.serve.app import build_app
from rollwise.serve.chat import Piece
from rollwise.serve.driver import EngineDriver
from rollwise.serve.server import BackgroundServer
from rollwise.serve.service import Policy, Service
from rollwise.stages.generate.base import Generator
from rollwise.stages.generate.group import new_sample
from rollwise.stages.ledger import Ledger
from rollwise.types import Group, Problem, Sample, Status

MODEL_NAME = "policy"  # what the agent's calls name as the model (also client.model)
EPISODE_STRIDE = 1_000_000  # seeds between two episodes of a round (1,000 calls each)


@dataclass
class AgentEpisode:
    problem: Problem
    token: str
    thread: threading.Thread | None = None
    started: float = 0.0
    result: object = None
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class AgentGenerator(Generator):
    produces = "episodes"  # multi-turn, with tools: what a task played as episodes wants
    multi_turn = True
    runs_to_end = True  # an episode's calls are served within its round

    def __init__(self, cfg, tokenizer):
        g = cfg.generate
        if not g.agent:
            raise ValueError("generate.strategy=agent needs the agent: set generate.agent="
                             "package.module:function, called as function(problem, client)")
        self.fn = registry.resolve("agent", g.agent, "generate.agent")
        self.tokenizer, self.group_size = tokenizer, g.group_size
        self.timeout_s, self.concurrency = g.agent_timeout_s, g.agent_concurrency
        self.service: Service | None = None
        self.server: BackgroundServer | None = None
        self.http = None  # the episodes' shared connection pool (_http)
        self.cfg = cfg

    # --- the Generator interface --------------------------------------------------------------
    def generate(self, rollout, problems: list[Problem], step: int) -> None:
        policy = Policy(rollout.params.temperature, rollout.params.top_p, rollout.params.top_k)
        seed = zlib.crc32(f"{self.cfg.run.seed}:{step}".encode()) << 24  # this step's own
        episodes = self.play(rollout.engine, rollout.params, problems, policy, rollout.gate,
                             rollout.ledger, seed=seed)
        by_problem: dict[str, Group] = {}
        for ep, pieces in episodes:
            g = by_problem.setdefault(ep.problem.id, Group(ep.problem.id, [], ep.problem))
            g.samples += episode_samples(ep, pieces, step)
        for g in by_problem.values():
            rollout.add(g)

    def evaluate(self, engine, prompter, problems, cfg, scorer) -> dict[str, float]:
        """pass@1 over run.eval_samples episodes per held-out problem, sampled as
        run.eval_temperature says (greedy by default): a reward counts when it is 1 or more,
        a final answer as `scorer` scores it."""
        policy = Policy(cfg.run.eval_temperature, 1.0)
        params = SamplingParams(temperature=cfg.run.eval_temperature,
                                max_new_tokens=cfg.generate.max_new_tokens,
                                stop_ids=prompter.stop_ids)
        ledger = Ledger()
        engine.reset_prefix_cache()  # its numbers never depend on an earlier round's K/V
        wins = []
        seed = EVAL_SEED if cfg.run.eval_temperature > 0 else None  # the same each time
        for ep, _ in self.play(engine, params, prompter.render(list(problems)), policy, None,
                               ledger, per_problem=cfg.run.eval_samples, seed=seed):
            wins.append(solved(ep, scorer))
        return {"eval/pass1": sum(wins) / max(len(wins), 1)}

    def warm_start_examples(self, cfg, task, tokenizer) -> list[tuple]:
        """A task played as episodes: its teacher's transcripts through generate.env (as the
        episode strategy's warm start); any other, its worked solutions."""
        if task.played_as == "episodes" and cfg.generate.env:
            return episode_examples(cfg, task, tokenizer, cfg.sft.noise, cfg.run.seed)
        return super().warm_start_examples(cfg, task, tokenizer)

    def close(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None
        if self.server is not None:
            self.server.close()
            self.server = None

    # --- episodes -----------------------------------------------------------------------------
    def play(self, engine, params, problems, policy: Policy, gate, ledger,
             per_problem: int | None = None, seed: int | None = None
             ) -> list[tuple[AgentEpisode, list[Piece]]]:
        """Every episode of the round to its end (or its timeout): (episode, its pieces).
        seed: the i-th episode's calls sample from seed + i x EPISODE_STRIDE on (where the
        agent gives no seed), so what they sample does not depend on when the calls came."""
        service = self.serve(params)
        service.driver = EngineDriver(engine, gate, own_thread=False)  # stepped by _run_all
        todo = []
        for p in problems:
            for _ in range(per_problem or p.group_size or self.group_size):
                own = None if seed is None else seed + EPISODE_STRIDE * len(todo)
                todo.append(AgentEpisode(p, service.open_episode(policy, own)))
        ledger.decide("agent", "episode", "start", len(todo))
        try:
            self._run_all(todo, ledger)
        finally:
            service.driver.close()
            service.driver = None
        out = []
        for ep in todo:
            calls = service.close_episode(ep.token)
            ledger.decide("agent", "call", "model", calls.calls)
            if calls.transcript.splits:
                ledger.decide("agent", "split", "rewrite", calls.transcript.splits)
            out.append((ep, calls.transcript.pieces))
        return out

    def _run_all(self, todo: list[AgentEpisode], ledger) -> None:
        """At most `concurrency` episodes at once, the engine stepped between looks; one past
        its time is abandoned (its thread cannot be stopped, but its episode is closed: its
        calls are refused)."""
        waiting, running = list(todo), []
        while waiting or running:
            while waiting and len(running) < self.concurrency:
                ep = waiting.pop(0)
                ep.started = time.monotonic()
                ep.thread = threading.Thread(target=self._episode, args=(ep,), daemon=True,
                                             name="rollwise-agent")
                ep.thread.start()
                running.append(ep)
            self.service.driver.pump()  # this thread steps the engine: the run's own
            for ep in list(running):
                if ep.done.is_set():
                    running.remove(ep)
                    ledger.decide("agent", "end", "error" if ep.error else "returned")
                elif time.monotonic() - ep.started > self.timeout_s:
                    ep.error = (f"the agent did not return within {self.timeout_s:g}s "
                                f"(generate.agent_timeout_s)")
                    self.service.episodes[ep.token].open = False  # its calls are refused
                    running.remove(ep)
                    ledger.decide("agent", "end", "timeout")

    def _episode(self, ep: AgentEpisode) -> None:
        import openai
        try:
            client = openai.OpenAI(base_url=f"{self.server.url}/episodes/{ep.token}/v1",
                                   api_key="rollwise", max_retries=0,
                                   timeout=self.timeout_s, http_client=self._http())
            client.model = MODEL_NAME
            ep.result = self.fn(ep.problem, client)
            if isinstance(ep.result, bool) or not isinstance(ep.result, (int, float, str)):
                ep.error = (f"the agent returned {type(ep.result).__name__}; return a reward "
                            f"(a number) or a final answer (a str)")
        except Exception as e:
            ep.error = "".join(traceback.format_exception_only(type(e), e)).strip()[-500:]
        finally:
            ep.done.set()

    def _http(self):
        """One HTTP connection pool for every episode's client (a client each would build its
        own, TLS context included: milliseconds per episode, in the round's critical path)."""
        if self.http is None:
            import openai
            # openai's own client class, on whichever HTTP library (httpx, httpx2) it is built
            lib = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__
                                          .split(".")[0])
            room = self.concurrency + 8  # a connection for every episode at once
            self.http = openai.DefaultHttpxClient(
                timeout=self.timeout_s,
                limits=lib.Limits(max_connections=room, max_keepalive_connections=room))
        return self.http

    def serve(self, params) -> Service:
        """The endpoints for this strategy's episodes, started on first use (`params`: the
        round's, whose stop ids end every turn) and kept across rounds."""
        if self.service is None:
            cfg = self.cfg
            self.service = Service(self.tokenizer, MODEL_NAME, _context(cfg), params.stop_ids,
                                   request_timeout_s=cfg.loop.wait_timeout_s,
                                   default_max_tokens=cfg.generate.max_new_tokens)
            self.server = BackgroundServer(build_app(self.service))
        return self.service


def episode_samples(ep: AgentEpisode, pieces: list[Piece], step: int) -> list[Sample]:
    """An episode's samples: a piece each, credited with the episode's reward or final
    answer; all failed with the reason where the agent failed, one empty failed sample where
    it made no call."""
    if not pieces:
        s = new_sample(ep.problem, ep.problem.prompt_ids, step)
        s.status = Status.FAILED
        s.meta["env_error"] = ep.error or "the agent made no call to the model"
        return [s]
    out = []
    for i, piece in enumerate(pieces):
        s = new_sample(ep.problem, piece.prompt_ids, step)
        _fill(s, piece)
        s.status = Status.COMPLETED
        s.meta.update(agent_calls=piece.calls, turns=piece.calls)
        if i < len(pieces) - 1:
            s.meta["split"] = True  # an earlier piece: the episode went on in another
        if ep.error:
            s.status = Status.FAILED
            s.meta["env_error"] = ep.error
        elif isinstance(ep.result, str):
            s.meta["final_answer"] = ep.result
        else:
            s.meta["env_reward"] = float(ep.result)
        out.append(s)
    return out


def solved(ep: AgentEpisode, scorer) -> bool:
    """An evaluation episode's success: a reward of 1 or more, or a final answer `scorer`
    scores 1 or more (a scorer that raises counts as wrong)."""
    if ep.error:
        return False
    if isinstance(ep.result, str):
        try:
            return scorer(ep.result, ep.problem)[0] >= 1.0
        except Exception:
            return False
    return float(ep.result) >= 1.0


def _fill(s: Sample, piece: Piece) -> None:
    """The piece's response tokens into the sample, in runs of the same mask."""
    i, n = 0, len(piece.response_ids)
    while i < n:
        j = i
        while j < n and piece.mask[j] == piece.mask[i]:
            j += 1
        s.extend(piece.response_ids[i:j], piece.logprobs[i:j], piece.versions[i:j],
                 piece.entropies[i:j], trainable=piece.mask[i])
        i = j


def _context(cfg) -> int:
    """The model's context length, from its folder's config or the built-in model's."""
    if cfg.model.path is None:
        return cfg.model.max_positions
    return models.model_config(cfg.model.path).max_position_embeddings
