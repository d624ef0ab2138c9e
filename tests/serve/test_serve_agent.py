"""Agents written against the real `openai` client (rollwise.serve.agent): their calls become
samples whose ids are the conversation the client saw, rendered as the template renders it,
token for token, with the loss mask exactly on what the model wrote; a rewritten history
splits; a failing or hanging agent fails its own episode; the loop trains on them."""

import json

import agent_plugins
import pytest
from agent_helpers import ScriptedEngine
from chat_model import build_chat_model, chat_tokenizer

from rollwise.config import load_config
from rollwise.engine import SamplingParams
from rollwise.loop.run import train
from rollwise.models import char_tokenizer
from rollwise.serve.agent import AgentGenerator, episode_samples
from rollwise.serve.chat import Renderer
from rollwise.serve.service import Policy
from rollwise.stages.ledger import Ledger
from rollwise.store.rollouts import RolloutStore
from rollwise.types import Problem, Status

CHAR_TURNS = ["add(2+3)<eos>", "mul(5+5)<eos>", "25<eos>"]
CHAT_TURNS = ['<tool_call>{"name": "add", "arguments": {"expr": "2+3"}}</tool_call><|im_end|>',
              '<tool_call>{"name": "mul", "arguments": {"expr": "5+5"}}</tool_call><|im_end|>',
              "It is 25.<|im_end|>"]


def scripted(turns, marker):
    """The model's n-th turn is turns[n], n counted by the tool results the prompt holds."""
    return lambda prompt: turns[min(prompt.count(marker), len(turns) - 1)]


def play(tok, agent, script, extra=(), n=2, prompt="what is 2+3 times 5?"):
    path = agent if isinstance(agent, str) else "agent_plugins:" + agent.__name__
    cfg = load_config(None, ["generate.strategy=agent", f"generate.agent={path}",
                             "model.max_positions=1024",
                             "generate.max_new_tokens=96", *extra])
    gen = AgentGenerator(cfg, tok)
    engine = ScriptedEngine(tok, script)
    params = SamplingParams(max_new_tokens=96, stop_ids=_stops(tok))
    problems = [Problem(f"p{i}", prompt, "25") for i in range(n)]
    for p in problems:
        p.prompt_ids = tok.encode(p.prompt, add_special_tokens=False)
    ledger = Ledger()
    agent_plugins.SEEN.clear()
    try:
        played = gen.play(engine, params, problems, Policy(), None, ledger, per_problem=1)
    finally:
        gen.close()
    return played, ledger, gen


def _stops(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>") if tok.chat_template else None
    return tuple(i for i in (tok.eos_token_id, end) if i is not None)


@pytest.mark.parametrize("kind", ["char", "chat"])
def test_a_two_tool_agent_is_one_sample_equal_to_the_conversation_it_saw(kind):
    tok = char_tokenizer() if kind == "char" else chat_tokenizer()
    marker, turns = (";tool:", CHAR_TURNS) if kind == "char" else ("<|im_start|>tool", CHAT_TURNS)
    played, ledger, gen = play(tok, agent_plugins.two_tools, scripted(turns, marker))
    render = Renderer(tok)
    for ep, pieces in played:
        assert ep.error is None and ep.result == 1.0
        (piece,) = pieces  # every call extended the one before: one sample
        (seen,) = [m for m in agent_plugins.SEEN[ep.problem.id]]
        assert [m["role"] for m in seen] == ["user", "assistant", "tool", "assistant", "tool",
                                             "assistant"]
        assert [t["function"]["name"] for m in seen for t in m.get("tool_calls", [])] == \
            ["add", "mul"]
        assert [m["content"] for m in seen if m["role"] == "tool"] == ["5", "25"]
        # the ids are the template's rendering of that conversation, token for token ...
        stored = tok.decode(piece.ids, skip_special_tokens=False)
        full = render.text(seen, False, agent_plugins.TOOLS)
        assert full.startswith(stored) and full[len(stored):] in ("", "\n")
        assert piece.prompt_ids == render.prompt_ids(seen[:1], agent_plugins.TOOLS)
        # ... and the mask is on exactly the model's tokens: its three turns, as it wrote them
        runs = _runs(piece)
        assert [tok.decode(ids, skip_special_tokens=False) for m, ids in runs if m] == turns
        assert all(v == 3 for v, m in zip(piece.versions, piece.mask) if m)  # the engine's
        assert all(v == -1 and lp == 0.0 for v, lp, m in
                   zip(piece.versions, piece.logprobs, piece.mask) if not m)
    assert ledger.decisions["agent/call/model"] == 6 and "agent/split/rewrite" not in \
        ledger.decisions


def _runs(piece):
    out = []
    for t, m in zip(piece.response_ids, piece.mask):
        if out and out[-1][0] == m:
            out[-1][1].append(t)
        else:
            out.append((m, [t]))
    return out


def test_a_history_rewrite_starts_a_new_sample_and_is_counted():
    tok = char_tokenizer()
    played, ledger, _ = play(tok, agent_plugins.rewrites_history, lambda p: "15<eos>", n=1)
    ((ep, pieces),) = played
    assert len(pieces) == 2 and ledger.decisions["agent/split/rewrite"] == 1
    samples = episode_samples(ep, pieces, 1)
    assert [s.meta.get("split", False) for s in samples] == [True, False]
    assert all(s.meta["env_reward"] == 0.5 for s in samples)  # every piece gets the reward


@pytest.mark.parametrize("agent, why", [(agent_plugins.raises, "the agent's own bug"),
                                        (agent_plugins.hangs, "did not return within 2s")])
def test_an_agent_that_raises_or_hangs_fails_its_own_episode(agent, why):
    tok = char_tokenizer()
    played, ledger, gen = play(tok, agent, lambda p: "2<eos>",
                               extra=["generate.agent_timeout_s=2"], n=2)
    for ep, pieces in played:
        samples = episode_samples(ep, pieces, 1)
        assert samples and all(s.status == Status.FAILED and why in s.meta["env_error"]
                               for s in samples)
    end = "error" if agent is agent_plugins.raises else "timeout"
    assert ledger.decisions[f"agent/end/{end}"] == 2


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


AGENT_RUN = ["generate.strategy=agent", "generate.agent=agent_plugins:two_tools",
             "filter.reward=env", "train.steps=2", "control.prompts_per_step=2",
             "generate.group_size=2", "run.eval_every=2", "task.eval_size=4", "sft.steps=0",
             "run.log=quiet", "run.threads=1", "filter.workers=0", "run.report=false",
             "run.tensorboard=false", "generate.max_new_tokens=12"]
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
        "model.num_kv_heads=1", "model.intermediate_size=64", "model.max_positions=256",
        "task.train_size=40"]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["char", "chat"])
def test_the_loop_trains_an_openai_client_agent(tmp_path, kind, request):
    extra = TINY if kind == "char" else [
        f"model.path={request.getfixturevalue('chat_dir')}", "task.name=gym:basic_arithmetic",
        "task.train_size=40"]
    summary = train(load_config(None, AGENT_RUN + extra + [f"run.root={tmp_path}",
                                                            "run.name=agent"]))
    assert summary["steps"] == 2
    rows = RolloutStore(tmp_path / "agent" / "rollouts").read().to_pylist()
    assert len(rows) >= 2 * 2 * 2  # two steps of two prompts x two episodes, one piece or more
    for r in rows:
        assert r["status"] in ("completed", "failed")
        mask = r["loss_mask"]
        assert any(mask) and len(mask) == len(r["response_ids"])
        versions = [v for v, m in zip(r["versions"], mask) if m]
        assert all(v >= 0 for v in versions)  # every model token carries its version
    metrics = [json.loads(x) for x in (tmp_path / "agent" / "metrics.jsonl").read_text()
               .splitlines()]
    assert metrics[-1]["decisions/agent/call/model"] > 0 and "eval/pass1" in metrics[-1]


@pytest.mark.integration
def test_agents_in_the_asynchronous_loop_keep_the_staleness_bound(tmp_path):
    """The server goes on serving across weight pushes: every model token carries the version
    that sampled it, and none is staler than loop.max_staleness allows."""
    cfg = load_config(None, AGENT_RUN + TINY + [
        f"run.root={tmp_path}", "run.name=async", "train.steps=4", "loop.mode=async",
        "loop.max_staleness=1", "train.correction.mode=tis"])
    assert train(cfg)["steps"] == 4
    metrics = [json.loads(x) for x in (tmp_path / "async" / "metrics.jsonl").read_text()
               .splitlines()][1:]
    assert all(m["staleness/max"] <= 1 for m in metrics)
    rows = RolloutStore(tmp_path / "async" / "rollouts").read().to_pylist()
    for r in rows:
        model = [v for v, m in zip(r["versions"], r["loss_mask"]) if m]
        assert model and all(r["step"] - 1 - 1 <= v <= r["step"] - 1 for v in model)


def test_the_readme_agent_calls_the_calculator_and_answers_with_its_result(monkeypatch):
    """examples/calc_agent.py on the character model's plain tool format: the model's
    calculator(417*386) comes back to the agent as an OpenAI tool call, its result as a tool
    message the model then copies."""
    import pathlib
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parents[2] / "examples"))
    tok = char_tokenizer()

    def model(prompt):
        return "calculator(417*386)<eos>" if ";tool:" not in prompt else \
            prompt.rsplit(";tool: ", 1)[1].split(";")[0] + "<eos>"
    played, ledger, _ = play(tok, "calc_agent:solve", model, n=1, prompt="417*386=")
    ((ep, pieces),) = played
    assert ep.error is None and ep.result == str(417 * 386)
    (piece,) = pieces
    assert tok.decode(piece.ids, skip_special_tokens=False) == \
        "417*386=calculator(417*386)<eos>;tool: 160962;160962<eos>"


def test_an_episodes_samples_do_not_depend_on_when_its_calls_arrive(tiny):
    """Each episode's calls sample from its own seeds: one at a time or eight at once (their
    calls batched in whatever order they came), the episodes are the same token for token."""
    from rollwise.engine import BuiltinEngine
    model, tok = tiny
    out = []
    for concurrency in (1, 8):
        cfg = load_config(None, ["generate.strategy=agent",
                                 "generate.agent=agent_plugins:two_tools",
                                 "model.max_positions=256", "generate.max_new_tokens=12",
                                 f"generate.agent_concurrency={concurrency}"])
        gen = AgentGenerator(cfg, tok)
        problems = [Problem(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
        try:
            played = gen.play(BuiltinEngine(model, seed=concurrency), SamplingParams(
                max_new_tokens=12, stop_ids=(tok.eos_token_id,)), problems, Policy(1.0, 1.0),
                None, Ledger(), per_problem=2, seed=123)
        finally:
            gen.close()
        out.append([[(p.ids, p.mask) for p in pieces] for _, pieces in played])
        lps = [lp for _, pieces in played for p in pieces for lp in p.logprobs]
    assert out[0] == out[1] and len(lps) > 0

