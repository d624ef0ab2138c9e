"""Agent episodes (rollwise/agents/episode.py, turns.py, env.py) on a scripted engine whose turns
are fixed texts: an episode's ids are the chat template's rendering of the conversation token for
token; the environment's tokens, and only they, have loss mask 0; a turn the template cannot
extend starts a new sample; a failing environment fails its episode only; limits hold."""

import pytest
from agent_helpers import run_episodes
from chat_model import chat_tokenizer

from rollwise.agents.episode import EpisodeGenerator
from rollwise.agents.turns import ChatTurns
from rollwise.config import load_config
from rollwise.engine import BuiltinEngine, SamplingParams
from rollwise.models import char_tokenizer
from rollwise.stages.filter.base import Item
from rollwise.stages.filter.exact import EnvRewardVerifier
from rollwise.stages.ledger import Ledger
from rollwise.types import Problem, Status

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'


def chat_setup(extra=()):
    tok = chat_tokenizer()
    cfg = load_config(None, ["generate.strategy=episode", "generate.env=tools",
                             "generate.tools=[calculator]", "generate.group_size=2",
                             "generate.max_new_tokens=200", *extra])
    messages = [{"role": "user", "content": "What is 12 * 7?"}]
    p = Problem("p0", messages, "84")
    p.prompt_ids = tok.encode(ChatTurns(tok).render(messages, True), add_special_tokens=False)
    stops = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    return tok, cfg, p, SamplingParams(max_new_tokens=200, stop_ids=stops)


def tool_then_answer(conversation: str) -> str:
    return CALL + "<|im_end|>" if "<|im_start|>tool" not in conversation else \
        "The answer is 84<|im_end|>"


def test_an_episode_is_the_templates_rendering_token_for_token():
    tok, cfg, p, params = chat_setup()
    group, decisions, engine = run_episodes(tok, cfg, p, params, tool_then_answer)
    assert len(group.samples) == 2
    assert decisions["agent/turn/model"] == 4 and decisions["agent/end/env"] == 2
    # this engine keeps no K/V: the second turns ran prompt and first turn (but its last
    # token, never fed) through the model again
    turn1 = tok.encode(CALL + "<|im_end|>", add_special_tokens=False)
    assert decisions["agent/reprefill/tokens"] == 2 * (len(p.prompt_ids) + len(turn1) - 1)
    assert "agent/prefill/reused" in decisions and not decisions["agent/prefill/reused"]
    for s in group.samples:
        conversation = [*p.prompt, {"role": "assistant", "content": CALL},
                        {"role": "tool", "content": "84"},
                        {"role": "assistant", "content": "The answer is 84"}]
        rendered = ChatTurns(tok).render(conversation).removesuffix("\n")
        assert s.prompt_ids + s.response_ids == tok.encode(rendered, add_special_tokens=False)
        # the environment's tokens, exactly: everything between the two model turns
        turn1 = tok.encode(CALL + "<|im_end|>", add_special_tokens=False)
        turn2 = tok.encode("The answer is 84<|im_end|>", add_special_tokens=False)
        env = s.response_ids[len(turn1):len(s.response_ids) - len(turn2)]
        assert tok.decode(env) == "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
        assert s.loss_mask == [1] * len(turn1) + [0] * len(env) + [1] * len(turn2)
        assert s.versions == [3] * len(turn1) + [-1] * len(env) + [3] * len(turn2)
        assert s.logprobs == [-0.5] * len(turn1) + [0.0] * len(env) + [-0.5] * len(turn2)
        assert s.status == Status.COMPLETED and s.meta["env_reward"] == 1.0
        assert s.meta["turns"] == 2 and s.meta["env_tool_calls"] == 1
    # the second turn's request was the episode so far, with the per-turn budget
    second = engine.requests[-1]
    assert second.prompt_ids == group.samples[-1].prompt_ids + group.samples[-1].response_ids[
        :-len(tok.encode("The answer is 84<|im_end|>", add_special_tokens=False))]
    assert second.params.max_new_tokens == 200
    verdicts = EnvRewardVerifier().score([Item("", p, meta=s.meta) for s in group.samples])
    assert [v.rewards["env"] for v in verdicts] == [1.0, 1.0]


def test_a_bad_tool_call_is_an_error_observation():
    tok, cfg, p, params = chat_setup()

    def script(conversation):
        if "<|im_start|>tool" not in conversation:
            return '<tool_call>{"name": "nope", "arguments": {}}</tool_call><|im_end|>'
        return "84<|im_end|>"
    group, _, _ = run_episodes(tok, cfg, p, params, script)
    s = group.samples[0]
    env_text = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
    assert "error: unknown tool 'nope'" in env_text
    assert s.meta["env_reward"] == 1.0


def test_a_turn_the_template_cannot_extend_starts_a_new_sample():
    tok, cfg, p, params = chat_setup()

    def script(conversation):  # the first turn ends with eos, not the end-of-turn token
        if "<|im_start|>tool" not in conversation:
            return CALL + "<|endoftext|>"
        return "84<|im_end|>"
    group, decisions, _ = run_episodes(tok, cfg, p, params, script)
    assert len(group.samples) == 4 and decisions["agent/split/template"] == 2
    first, second = group.samples[0], group.samples[2]
    assert first.meta["split"] and second.meta["split_from"] == first.uid
    conversation = [*p.prompt, {"role": "assistant", "content": CALL},
                    {"role": "tool", "content": "84"}]
    assert second.prompt_ids == ChatTurns(tok).prompt_ids(conversation)
    assert first.meta["env_reward"] == second.meta["env_reward"] == 1.0
    assert all(m == 1 for m in first.loss_mask + second.loss_mask)


class BrokenEnv:
    def __init__(self, cfg, problem):
        pass

    def reset(self, problem):
        return None

    def step(self, action):
        raise RuntimeError("the environment broke")


def test_a_failing_environment_fails_its_episode_only(monkeypatch):
    from rollwise import registry
    registry.register("env", "broken", BrokenEnv)
    tok, cfg, p, params = chat_setup(["generate.env=broken"])
    group, decisions, _ = run_episodes(tok, cfg, p, params, tool_then_answer)
    for s in group.samples:
        assert s.status == Status.FAILED and "the environment broke" in s.meta["env_error"]
    assert decisions["agent/end/error"] == 2
    v = EnvRewardVerifier().score([Item("", p, meta=group.samples[0].meta)])[0]
    assert v.failed == "env_error"


def test_turn_and_episode_limits():
    tok, cfg, p, params = chat_setup(["generate.max_turns=3"])
    group, decisions, engine = run_episodes(tok, cfg, p, params,
                                            lambda c: CALL + "<|im_end|>")
    s = group.samples[0]
    assert s.meta["turns"] == 3 and s.meta["episode_end"] == "limit"
    assert s.meta["env_reward"] == 0.0
    turn = len(tok.encode(CALL + "<|im_end|>", add_special_tokens=False))
    tok2, cfg2, p2, params2 = chat_setup([f"generate.max_episode_tokens={turn + 5}"])
    group, _, engine = run_episodes(tok2, cfg2, p2, params2, lambda c: CALL + "<|im_end|>")
    s = group.samples[0]
    assert s.num_tokens <= turn + 5 and s.meta["episode_end"] == "limit"


class AgainEnv:
    """Asks once more, then scores the second answer."""

    def __init__(self, cfg, problem):
        self.turns = 0

    def reset(self, problem):
        return None

    def step(self, action):
        self.turns += 1
        if self.turns == 1:
            return {"role": "tool", "content": "84"}, 0.0, False, {}
        return None, float(action == "84"), True, {}


def test_the_character_model_takes_plain_turns():
    from rollwise import registry
    registry.register("env", "again", AgainEnv)
    tok = char_tokenizer()
    cfg = load_config(None, ["generate.strategy=episode", "generate.env=again",
                             "generate.group_size=1", "generate.max_new_tokens=40"])
    p = Problem("p0", "12*7=", "84")
    p.prompt_ids = tok.encode("12*7=", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=40, stop_ids=(tok.eos_token_id,))
    group, _, _ = run_episodes(tok, cfg, p, params, lambda c: "84<eos>")
    s = group.samples[0]
    env = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m == 0])
    assert env == ";tool: 84;" and s.meta["env_reward"] == 1.0
    assert tok.decode(s.response_ids) == "84<eos>;tool: 84;84<eos>"


def test_an_episode_needs_an_environment():
    with pytest.raises(ValueError, match="generate.env"):
        EpisodeGenerator(load_config(None, ["generate.strategy=episode"]), chat_tokenizer())


class ParityEnv(AgainEnv):
    """Mixed rewards from an untrained model: the second answer's length parity."""

    def step(self, action):
        obs, _, done, info = super().step(action)
        return obs, float(done and len(action) % 2), done, info


@pytest.mark.integration
def test_episodes_train_in_the_loop(tmp_path):
    """The built-in character model through the whole loop: episodes generated, scored by the
    environment's reward, trained (environment tokens masked), stored."""
    from loop_helpers import SMALL

    from rollwise import registry
    from rollwise.loop.run import train
    from rollwise.store.rollouts import RolloutStore
    registry.register("env", "parity", ParityEnv)
    small = [o for o in SMALL if not o.startswith(("filter.reward", "train.steps"))]
    summary = train(load_config(None, small + [
        f"run.root={tmp_path}", "run.name=agent", "train.steps=2", "generate.strategy=episode",
        "generate.env=parity", "filter.reward=env", "generate.max_new_tokens=16",
        "model.max_positions=96"]))  # room for both turns to end: mixed rewards on any seed
    assert summary["tokens_trained"] > 0
    rows = RolloutStore(tmp_path / "agent" / "rollouts").read().to_pylist()
    assert rows and all(0 in r["loss_mask"] for r in rows if r["status"] == "completed")
    for r in rows:  # environment tokens: no version, no log-probability
        for m, v, lp in zip(r["loss_mask"], r["versions"], r["logprobs"]):
            assert (m == 0) == (v == -1) and (m == 1 or lp == 0.0)


def test_episodes_carried_by_april_go_on_in_later_rounds(tiny):
    """APRIL pauses every unfinished request when the batch is complete; an episode paused
    mid-turn, or between turns, goes on in a later round with its environment."""
    import copy

    from loop_helpers import Loop

    from rollwise import registry
    from rollwise.config import Config
    from rollwise.stages.control.april import April
    from rollwise.stages.generate import generate_round
    from rollwise.stages.generate.group import sampling_params
    from rollwise.tasks.prompts import Prompter
    registry.register("env", "again", AgainEnv)
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    cfg = Config.model_validate({"generate": {"group_size": 3, "max_new_tokens": 6,
                                              "strategy": "episode", "env": "again"},
                                 "control": {"april": {"over_provision": 2.0}}})
    gen = EpisodeGenerator(cfg, tok)
    loop = Loop(April(cfg))
    # several stop ids: a random model's turns end early (and often), as trained ones do
    params = sampling_params(cfg.generate, tuple(range(1, 12)))
    engine = BuiltinEngine(model, seed=0, max_batch=64, segment=2)
    released, env_text = [], tok.decode(tok.encode(";tool: 84;", add_special_tokens=False))
    for step in range(1, 6):
        groups = generate_round(engine, gen, loop, params, 2, step, Ledger(),
                                Prompter.plain(tok))
        released += [s for g in groups for s in g.samples]
    assert released
    for s in released:
        assert s.finished
        masked = [t for t, m in zip(s.response_ids, s.loss_mask) if m == 0]
        if s.meta["turns"] == 2:  # one observation, between the two turns
            assert s.meta["episode_end"] == "env" and tok.decode(masked) == env_text
        else:  # a first turn cut at its budget ends the episode
            assert s.meta["episode_end"] == "limit" and not masked
    carried = [s for s in released if s.meta.get("resumed")]
    assert any(s.meta["turns"] == 2 for s in carried)  # paused, resumed, and went on


def test_the_character_model_calls_tools_in_plain_form():
    """A 3-digit product the model cannot know: calculator(...) in its own vocabulary, the
    result comes back as a plain turn, and the answer that copies it is rewarded."""
    tok = char_tokenizer()
    cfg = load_config(None, ["generate.strategy=episode", "generate.env=tools",
                             "generate.tools=[calculator]", "generate.group_size=1",
                             "generate.max_new_tokens=40"])
    p = Problem("p0", "417*386=", str(417 * 386))
    p.prompt_ids = tok.encode("417*386=", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=40, stop_ids=(tok.eos_token_id,))

    def script(conversation):
        if "tool:" not in conversation:
            return "calculator(417*386)<eos>"
        return conversation.rsplit("tool: ", 1)[1].split(";")[0] + "<eos>"
    group, _, _ = run_episodes(tok, cfg, p, params, script)
    s = group.samples[0]
    assert tok.decode(s.response_ids) == "calculator(417*386)<eos>;tool: 160962;160962<eos>"
    assert s.meta["env_reward"] == 1.0 and s.meta["env_tool_calls"] == 1


STEPPED: list[str] = []


class ResetFails:
    def __init__(self, cfg, problem):
        pass

    def reset(self, problem):
        raise RuntimeError("no sandbox")

    def step(self, action):
        STEPPED.append(action)
        return None, 0.0, True, {}


def factory_fails(cfg, problem):
    raise OSError("cannot start the environment")


@pytest.mark.parametrize("env, error", [("ResetFails", "reset: RuntimeError: no sandbox"),
                                        ("factory_fails", "OSError: cannot start the environment")])
def test_an_environment_that_cannot_start_ends_its_episode_with_the_real_reason(env, error):
    """Never stepped, never played, its reason kept, ended once as an error; the episode's
    sample is FAILED, so it is stored but never trained."""
    STEPPED.clear()
    tok, cfg, p, params = chat_setup([f"generate.env=test_agent_episodes:{env}"])
    group, decisions, engine = run_episodes(tok, cfg, p, params, lambda conv: "x<|im_end|>")
    assert STEPPED == [] and engine.requests == []  # nothing generated for it either
    assert [s.status for s in group.samples] == [Status.FAILED] * 2
    assert all(s.meta["env_error"].endswith(error) for s in group.samples)
    assert all(s.meta["episode_end"] == "error" for s in group.samples)
    ends = {k: v for k, v in decisions.items() if k.startswith("agent/end/")}
    assert ends == {"agent/end/error": 2} and decisions["agent/episode/start"] == 2
