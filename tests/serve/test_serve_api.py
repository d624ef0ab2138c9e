"""The OpenAI-compatible endpoints (rollwise.serve.app) through the real `openai` client: what
they return is what the engine gives for the template's prompt ids (tokens, log-probabilities,
seeds per choice); streaming returns what non-streaming does; tool calls come back in OpenAI's
format; bad requests get the documented 4xx; a non-local bind needs the key."""

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from agent_helpers import ScriptedEngine
from chat_model import build_chat_model, chat_tokenizer, favour_token

from rollwise import models
from rollwise.engine import BuiltinEngine, Request, SamplingParams
from rollwise.serve.app import build_app
from rollwise.serve.driver import EngineDriver
from rollwise.serve.server import BackgroundServer
from rollwise.serve.service import Service, choice_seed
from rollwise.tasks.prompts import end_of_turn_id, stop_ids

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is 12 + 7?"}]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def served(chat_dir):
    """The test chat model (biased toward ending its turn) behind the server, and a reference
    engine built the same way, driven directly."""
    tok = models.load_tokenizer(chat_dir)
    model = favour_token(models.load_model(chat_dir)[0], end_of_turn_id(tok), 3.0)
    stops = stop_ids(tok, model.config)
    service = Service(tok, "chat", model.config.max_position_embeddings, stops)
    service.driver = EngineDriver(BuiltinEngine(model, seed=0))
    server = BackgroundServer(build_app(service))
    yield server, service, tok, BuiltinEngine(model, seed=0), stops
    server.close()
    service.driver.close()


def client(server, key="none"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def reference(engine, ids, stops, seed, n=24, top=0):
    (c,) = engine.generate([Request(ids, SamplingParams(temperature=1.0, max_new_tokens=n,
                                                        stop_ids=stops, seed=seed,
                                                        top_logprobs=top))])
    return c


def test_chat_is_the_engine_on_the_templates_prompt_with_each_choice_its_seed(served):
    server, _, tok, engine, stops = served
    r = client(server).chat.completions.create(model="chat", messages=MESSAGES, n=3, seed=11,
                                               max_tokens=24, logprobs=True, top_logprobs=2)
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(ids, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    assert len(r.choices) == 3
    for i, choice in enumerate(r.choices):
        want = reference(engine, ids, stops, choice_seed(11, i), top=2)
        body = want.token_ids[:-1] if want.finish_reason == "stop" else want.token_ids
        assert choice.message.content == tok.decode(body, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if want.finish_reason == "stop" else "length")
        got = choice.logprobs.content
        assert [t.logprob for t in got] == pytest.approx(want.logprobs[:len(body)])
        assert [[a.token for a in t.top_logprobs] for t in got] == \
            [[tok.decode([a]) for a, _ in top] for top in want.top_logprobs[:len(body)]]
    assert r.usage.completion_tokens == sum(
        len(reference(engine, ids, stops, choice_seed(11, i)).token_ids) for i in range(3))
    alone = client(server).chat.completions.create(model="chat", messages=MESSAGES, seed=11,
                                                   max_tokens=24)
    assert alone.choices[0].message.content == r.choices[0].message.content  # choice 0


def test_a_seed_sweep_with_several_choices_never_repeats_a_choice():
    """seed s's choice i must not be seed s+i's choice 0, as seed + index made it."""
    seeds = [choice_seed(s, i) for s in range(-50, 200) for i in range(8)]
    assert len(set(seeds)) == len(seeds)
    assert all(choice_seed(s, 0) == s for s in range(-5, 5)) and choice_seed(None, 3) is None


def test_streaming_returns_what_non_streaming_does(served):
    server = served[0]
    c = client(server)
    for seed in (1, 2, 3):
        whole = c.chat.completions.create(model="chat", messages=MESSAGES, seed=seed,
                                          max_tokens=24, logprobs=True)
        chunks = list(c.chat.completions.create(model="chat", messages=MESSAGES, seed=seed,
                                                max_tokens=24, stream=True, logprobs=True))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == \
            whole.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        streamed = [t for ch in chunks if ch.choices[0].logprobs
                    for t in ch.choices[0].logprobs.content]
        assert [(t.token, t.logprob) for t in streamed] == \
            [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]  # same tokens
        text = c.completions.create(model="chat", prompt="What is", seed=seed, max_tokens=16)
        streamed = c.completions.create(model="chat", prompt="What is", seed=seed,
                                        max_tokens=16, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed) == text.choices[0].text


def test_a_stop_string_cuts_the_text_before_it(served):
    server = served[0]
    c = client(server)
    free = c.completions.create(model="chat", prompt="What is", seed=5, max_tokens=16)
    text = free.choices[0].text
    assert len(text) > 3
    stop = text[2:4]
    cut = c.completions.create(model="chat", prompt="What is", seed=5, max_tokens=16,
                               stop=[stop])
    assert cut.choices[0].text == text[:text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors_with_4xx(served):
    server = served[0]
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4", messages=MESSAGES)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="chat", messages=[{"role": "robot", "content": "x"}])
    assert "messages.0.role" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="chat", messages=[{"role": "user", "content": "x" * 400}])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="chat", messages=MESSAGES, temperature=5)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="chat", prompt=[10 ** 9])  # not a token id
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    for choice in ({"type": "function", "function": "lookup"}, {"type": "function"}, "any"):
        with pytest.raises(openai.BadRequestError) as e:  # a string where an object belongs
            c.chat.completions.create(model="chat", messages=MESSAGES, tools=tools,
                                      tool_choice=choice)
        assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="chat", messages=MESSAGES, tools=["lookup"])
    assert e.value.body["param"].startswith("tools")
    raw = urllib.request.Request(server.url + "/v1/chat/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(raw, timeout=30)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError) as e:  # an episode that is not (or no longer) open
        openai.OpenAI(base_url=server.url + "/episodes/nope/v1", api_key="x",
                      max_retries=0).chat.completions.create(model="chat", messages=MESSAGES)
    assert e.value.body["code"] == "episode_closed"
    assert c.models.list().data[0].id == "chat"


def test_tool_calls_come_back_in_openai_format():
    tok = chat_tokenizer()
    call = '<tool_call>{"name": "add", "arguments": {"expr": "2+3"}}</tool_call><|im_end|>'
    service = Service(tok, "m", 1024, (tok.convert_tokens_to_ids("<|im_end|>"),))
    service.driver = EngineDriver(ScriptedEngine(tok, lambda prompt: call))
    server = BackgroundServer(build_app(service))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"expr": {"type": "string"}}}}}]
    try:
        c = client(server)
        r = c.chat.completions.create(model="m", messages=MESSAGES, tools=tools)
        (t,) = r.choices[0].message.tool_calls
        assert (t.type, t.function.name, json.loads(t.function.arguments)) == \
            ("function", "add", {"expr": "2+3"})
        assert r.choices[0].finish_reason == "tool_calls"
        chunks = list(c.chat.completions.create(model="m", messages=MESSAGES, tools=tools,
                                                stream=True))
        (streamed,) = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
        assert streamed.function.name == "add"
        none = c.chat.completions.create(model="m", messages=MESSAGES, tools=tools,
                                         tool_choice="none")
        assert none.choices[0].message.tool_calls is None
        assert none.choices[0].finish_reason == "stop"
    finally:
        server.close()
        service.driver.close()


def test_a_non_local_bind_needs_a_key_and_every_request_must_carry_it():
    tok = chat_tokenizer()
    service = Service(tok, "m", 1024, (tok.eos_token_id,), api_key="sekrit")
    service.driver = EngineDriver(ScriptedEngine(tok, lambda prompt: "hi<|endoftext|>"))
    with pytest.raises(ValueError, match="API key"):
        BackgroundServer(build_app(service), host="0.0.0.0")
    server = BackgroundServer(build_app(service), host="0.0.0.0", api_key="sekrit")
    try:
        url = f"http://127.0.0.1:{server.port}/v1"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        raw = urllib.request.Request(url + "/models")  # no Authorization header at all
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(raw, timeout=30)
        assert e.value.code == 401
        for header, status in (("bearer sekrit", 200), ("BEARER  sekrit ", 200),
                               ("Basic sekrit", 401), ("Bearer", 401), ("sekrit", 401)):
            raw = urllib.request.Request(url + "/models", headers={"Authorization": header})
            try:
                got = urllib.request.urlopen(raw, timeout=30).status
            except urllib.error.HTTPError as e:
                got = e.code
            assert got == status, header  # the scheme is case-insensitive (RFC 9110)
        ok = openai.OpenAI(base_url=url, api_key="sekrit", max_retries=0)
        assert ok.chat.completions.create(model="m", messages=MESSAGES).choices[0] \
            .message.content == "hi"
    finally:
        server.close()
        service.driver.close()


def test_a_client_that_leaves_a_stream_frees_its_sequence(chat_dir):
    """No stop token: the request would run its 200 tokens; the client leaves after the
    first chunk, and the engine aborts it well before."""
    class Slow(BuiltinEngine):  # 20 ms a step: the client leaves long before 200 tokens
        def step(self):
            time.sleep(0.02)
            return super().step()
    tok = models.load_tokenizer(chat_dir)
    engine = Slow(models.load_model(chat_dir)[0], seed=0, segment=4)
    service = Service(tok, "chat", 256, ())
    service.driver = EngineDriver(engine)
    server = BackgroundServer(build_app(service))
    try:
        stream = client(server).completions.create(model="chat", prompt="What is", seed=9,
                                                   max_tokens=200, stream=True)
        next(iter(stream))
        stream.close()
        t0 = time.monotonic()
        while service.driver.busy and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        assert not service.driver.busy and engine.tokens_generated < 100
    finally:
        server.close()
        service.driver.close()


def test_what_a_template_cannot_render_or_a_huge_body_is_a_4xx_not_a_crash():
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}"
              "{{ raise_exception('system messages are not supported') }}{% endif %}"
              "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = chat_tokenizer(template=strict)
    deep = "<tool_call>" + "[" * 5000 + "</tool_call><|im_end|>"  # past json's depth
    service = Service(tok, "m", 100_000, (tok.convert_tokens_to_ids("<|im_end|>"),))
    service.driver = EngineDriver(ScriptedEngine(tok, lambda prompt: deep))
    server = BackgroundServer(build_app(service))
    try:
        c = client(server)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", messages=MESSAGES)
        assert "system messages are not supported" in e.value.body["message"]
        tools = [{"type": "function", "function": {"name": "add"}}]
        r = c.chat.completions.create(model="m", messages=MESSAGES[1:], tools=tools)
        assert r.choices[0].message.tool_calls is None  # an unreadable call is just text
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model="m", messages=[
                {"role": "user", "content": "x" * (17 << 20)}])
        assert e.value.status_code == 413
    finally:
        server.close()
        service.driver.close()


def test_rollwise_serve_serves_a_model_folder_and_refuses_an_open_bind_without_a_key(chat_dir):
    import socket
    import subprocess
    import sys
    refused = subprocess.run([sys.executable, "-c", (
        "import sys; from rollwise.cli import main; "
        "rc = main(['serve', '--model', '/nowhere', '--host', '0.0.0.0']); "
        "print(rc, 'torch' in sys.modules)")], capture_output=True, text=True, timeout=120)
    assert refused.stdout.split() == ["2", "False"]  # before torch or any model loads
    assert "--api-key" in refused.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "rollwise", "serve", "--model", str(chat_dir),
                             "--port", str(port), "--name", "chat"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "serving 'chat'" in proc.stdout.readline()
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=5,
                          timeout=60)
        t0 = time.monotonic()
        while True:  # the line comes just before uvicorn listens
            try:
                r = c.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=8)
                break
            except openai.APIConnectionError:
                assert time.monotonic() - t0 < 60
                time.sleep(0.2)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens
    finally:
        proc.terminate()
        proc.wait(30)
