"""Shared helpers of the tests (not a test module)."""

from __future__ import annotations

import torch

from rollwise.agents.episode import EpisodeGenerator
from rollwise.agents.trace_rollout import TraceGenerator
from rollwise.config import load_config
from rollwise.engine import SamplingParams
from rollwise.engine.scheduler import Event
from rollwise.models import char_tokenizer
from rollwise.stages.control.inflight import RunToEnd
from rollwise.stages.generate.rollout import Rollout
from rollwise.stages.ledger import Ledger
from rollwise.types import Problem


class ScriptedEngine:
    """Each request gets the next text of its script (by how many turns its prompt holds),
    emitted at once as canonical tokens with log-probability -0.5 at version 3."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.version, self.tokens_generated, self.queue, self.next_id = 3, 0, [], 0
        self.requests = []

    def add(self, request):
        self.next_id += 1
        self.queue.append((self.next_id, request))
        self.requests.append(request)
        return self.next_id

    def has_unfinished(self):
        return bool(self.queue)

    def step(self):
        events = []
        for seq_id, req in self.queue:
            text = self.script(self.tokenizer.decode(req.prompt_ids))
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            ids = ids[:req.params.max_new_tokens]
            stop = bool(ids) and ids[-1] in req.params.stop_ids
            n = len(ids)
            self.tokens_generated += n
            events.append(Event(seq_id, req.id, ids, [-0.5] * n, [1.0] * n, [3] * n, True,
                                "stop" if stop else "length"))
        self.queue = []
        return events

def run_episodes(tok, cfg, problem, params, script):
    engine = ScriptedEngine(tok, script)
    gen = EpisodeGenerator(cfg, tok)
    rollout = Rollout(engine, RunToEnd(), Ledger(), params)
    gen.generate(rollout, [problem], step=1)
    return rollout.groups[0], rollout.ledger.decisions, engine


TRACE = ["generate.strategy=trace", "generate.env=tools", "generate.tools=[calculator]",
         "generate.tool_format=plain", "generate.group_size=6", "generate.trace.roots=2",
         "generate.max_new_tokens=24", "generate.max_turns=3"]

def calls_then_copies(conversation: str) -> str:
    if "tool:" not in conversation:
        return "calculator(" + conversation.split("=")[0] + ")<eos>"
    return conversation.rsplit("tool: ", 1)[1].split(";")[0] + "<eos>"

def run(extra=(), script=calls_then_copies, predictor=None, problems=None):
    tok = char_tokenizer()
    cfg = load_config(None, TRACE + list(extra))
    gen = TraceGenerator(cfg, tok)
    if predictor is not None:
        gen.predictor.w = torch.tensor(predictor)
    problems = problems or [Problem("p0", "417*386=", str(417 * 386)),
                            Problem("p1", "12*34=", str(12 * 34))]
    for p in problems:
        p.prompt_ids = tok.encode(p.prompt, add_special_tokens=False)
    rollout = Rollout(ScriptedEngine(tok, script), RunToEnd(), Ledger(),
                      SamplingParams(max_new_tokens=24, stop_ids=(tok.eos_token_id,)))
    gen.generate(rollout, problems, step=1)
    return rollout, tok, gen
