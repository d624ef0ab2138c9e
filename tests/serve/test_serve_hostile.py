"""The endpoint against hostile clients, each while another client's ordinary request is
timed: bodies that nest 100,000 levels deep or hold a lone surrogate get 400, not 500; a list
of 500,000 messages and a rendered prompt past the context are refused before they are
built; half-sent requests and silent connections are closed after the head's deadline and
open connections are capped; a body that never finishes gets 408; a non-streaming client that
disconnects has its sequences aborted, even when the cancel meets an engine event; the K/V
budget refuses a choice that cannot fit, holds the engine's cache within it, and answers 429
once the queue is full; a stop aborts the work in flight and ends the server in bounded time."""

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from agent_helpers import ScriptedEngine
from chat_model import build_chat_model, chat_tokenizer

from rollwise import models
from rollwise.engine import BuiltinEngine, SamplingParams
from rollwise.engine.scheduler import Event
from rollwise.serve.app import build_app
from rollwise.serve.driver import EngineDriver
from rollwise.serve.protocol import MAX_JSON_DEPTH, MAX_MESSAGES, ApiError
from rollwise.serve.server import BackgroundServer, StoppingServer, _config
from rollwise.serve.service import QUEUED_BUDGETS, Service, run_choices

ASK = {"model": "m", "messages": [{"role": "user", "content": "What is 12 + 7?"}]}
PROMPT_OK_S = 5.0  # an ordinary request beside a hostile one; unbounded before (23.5 s seen)


class SlowEngine:
    """One token a step, 20 ms a step, until max_new_tokens: work that lasts, and records
    what was aborted and when."""

    def __init__(self, token: int):
        self.token, self.version, self.tokens_generated = token, 0, 0
        self.live, self.aborted, self.next_id = {}, {}, 0

    def add(self, request):
        self.next_id += 1
        self.live[self.next_id] = [request, []]
        return self.next_id

    def step(self):
        time.sleep(0.02)
        events = []
        for seq_id, (req, ids) in list(self.live.items()):
            ids.append(self.token)
            self.tokens_generated += 1
            done = len(ids) >= req.params.max_new_tokens
            events.append(Event(seq_id, req.id, [self.token], [-0.5], [1.0], [0], done,
                                "length" if done else None))
            if done:
                del self.live[seq_id]
        return events

    def abort(self, seq_id):
        req, ids = self.live.pop(seq_id)
        self.aborted[seq_id] = time.monotonic()
        return type("C", (), {"token_ids": ids, "logprobs": [-0.5] * len(ids),
                              "entropies": [1.0] * len(ids), "versions": [0] * len(ids)})()


@pytest.fixture
def served():
    tok = chat_tokenizer()
    service = Service(tok, "m", 4_096, (tok.convert_tokens_to_ids("<|im_end|>"),))
    service.driver = EngineDriver(ScriptedEngine(tok, lambda prompt: "19<|im_end|>"))
    server = BackgroundServer(build_app(service, body_timeout_s=2.0), header_timeout_s=1.0,
                              max_connections=32)
    yield server, service
    server.close()
    service.driver.close()


def post(server, body: bytes, path="/v1/chat/completions", timeout=60):
    """(status, JSON reply) of a raw POST."""
    req = urllib.request.Request(server.url + path, data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def beside(server, hostile):
    """Run hostile() in a thread and an ordinary chat meanwhile: (its seconds, hostile's)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("hostile", hostile()))
    t.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    status, reply = post(server, json.dumps(ASK).encode())
    took = time.monotonic() - t0
    t.join(120)
    assert status == 200 and reply["choices"][0]["message"]["content"] == "19"
    return took, out["hostile"]


def deep(n: int, leaf: str = "1") -> str:
    return "[" * n + leaf + "]" * n


HOSTILE = {
    "deep content": '{"model": "m", "messages": [{"role": "user", "content": %s}]}'
                    % deep(100_000),
    "deep extra field": '{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                        '"x": %s}' % deep(100_000),
    "deep objects": '{"model": "m", "messages": [{"role": "user", "content": "hi", "x": %s}]}'
                    % ('{"a": ' * 5_000 + "1" + "}" * 5_000),
    "under the recursion limit": '{"model": "m", "messages": [{"role": "user", "content": '
                                 '"hi"}], "x": %s}' % deep(MAX_JSON_DEPTH + 5),
    "lone surrogate": '{"model": "m", "messages": [{"role": "user", "content": "hi \\ud800"}]}',
    "surrogate key": '{"model": "m", "messages": [{"role": "user", "content": "hi", '
                     '"\\udfff": 1}]}',
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_malformed_body_is_a_400_naming_it_while_others_are_served(served, name):
    server, _ = served
    took, (status, reply) = beside(server, lambda: post(server, HOSTILE[name].encode()))
    assert status == 400, reply
    msg = reply["error"]["message"]
    assert ("nests deeper than" in msg) if "deep" in name or "limit" in name \
        else ("not valid Unicode" in msg), msg
    assert took < PROMPT_OK_S


def test_half_a_million_messages_are_refused_before_they_are_validated(served):
    server, service = served
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}] * 500_000})
    assert len(body) < 16 << 20  # under the body limit: refused for its count
    rendered = []
    render = service.renderer.text
    service.renderer.text = lambda *a, **k: rendered.append(1) or render(*a, **k)
    took, (status, reply) = beside(server, lambda: post(server, body.encode()))
    assert status == 400 and reply["error"]["code"] == "too_many_items"
    assert f"more than the {MAX_MESSAGES}" in reply["error"]["message"]
    assert rendered == [1]  # the ordinary request's rendering only
    assert took < PROMPT_OK_S


def test_a_rendered_prompt_past_the_context_is_refused_before_it_is_tokenized():
    """Empty messages pass the contents' count, but the template's own text for each adds
    up: the rendered text is measured before the tokenizer sees it."""
    tok = chat_tokenizer()
    service = Service(tok, "m", 64, (tok.convert_tokens_to_ids("<|im_end|>"),))
    service.driver = EngineDriver(ScriptedEngine(tok, lambda prompt: "19<|im_end|>"))
    server = BackgroundServer(build_app(service))
    encoded = []
    encode = tok.encode
    tok.encode = lambda text, *a, **k: encoded.append(len(text)) or encode(text, *a, **k)
    try:
        n = service.max_prompt_chars // 10 + 1  # '<|im_start|>user\n<|im_end|>\n' each
        assert n < MAX_MESSAGES
        status, reply = post(server, json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": ""}] * n}).encode())
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
        assert "rendered prompt has" in reply["error"]["message"]
        assert encoded == []
    finally:
        server.close()
        service.driver.close()


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_half_sent_heads_and_silent_connections_are_closed_after_the_deadline(served):
    server, _ = served
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(5)]
    half = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        half.append(s)
    took, _ = beside(server, lambda: None)  # served meanwhile
    assert took < PROMPT_OK_S
    t0 = time.monotonic()
    assert all(_closed_within(s, 5.0) for s in silent + half)
    assert time.monotonic() - t0 < 5.0  # the deadline is 1 s here (15 s by default)
    for s in silent + half:
        s.close()


def reply_of(s: socket.socket) -> tuple[bytes, bytes]:
    """The status and body of the next whole reply on s (read to its Content-Length)."""
    reply = b""
    while b"\r\n\r\n" not in reply:
        reply += s.recv(65536)
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(65536)
    return head.split()[1], body


def status_of_reply(s: socket.socket) -> bytes:
    return reply_of(s)[0]


def test_a_kept_alive_connections_next_head_has_the_deadline_too(served):
    server, _ = served
    body = json.dumps(ASK).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        s.settimeout(10)
        assert status_of_reply(s) == b"200"
        time.sleep(1.5)  # idle past the head's deadline: keep-alive (30 s) holds it open
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of_reply(s) == b"200"
        s.sendall(b"GET /v1/mod")  # half a head, then nothing
        assert _closed_within(s, 5.0)


def test_connections_past_the_cap_are_closed_at_once(served):
    server, _ = served
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(32)]
    time.sleep(0.2)
    extra = socket.create_connection(("127.0.0.1", server.port))
    assert _closed_within(extra, 0.5)
    extra.close()
    for s in held:
        s.close()
    time.sleep(0.2)
    assert post(server, json.dumps(ASK).encode())[0] == 200


def test_a_body_that_never_finishes_gets_408(served):
    server, _ = served
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                  b"\r\n{\"model\": ")
        s.settimeout(10)
        status, body = reply_of(s)
    assert status == b"408" and json.loads(body)["error"]["code"] == "body_timeout"


@pytest.fixture
def slow():
    tok = chat_tokenizer()
    engine = SlowEngine(tok.convert_tokens_to_ids("a"))
    service = Service(tok, "m", 100_000, (tok.convert_tokens_to_ids("<|im_end|>"),))
    service.driver = EngineDriver(engine)
    server = BackgroundServer(build_app(service))
    yield server, service, engine
    server.close()
    service.driver.close()


def _wait_for(condition, seconds: float, failure: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


@pytest.mark.parametrize("path,body,sequences", [
    ("/v1/chat/completions", {**ASK, "max_tokens": 50_000, "n": 2}, 2),
    # its 50 prompts run one at a time: one sequence is live when the client leaves
    ("/v1/completions", {"model": "m", "prompt": ["12 + 7 ="] * 50, "max_tokens": 50_000},
     1)])
def test_a_gone_non_streaming_clients_work_is_aborted(slow, path, body, sequences):
    """The client leaves once the engine runs its every sequence (not after a fixed time: on
    a loaded machine that can come before the work began); each is then aborted, not run to
    its 50,000 tokens. How soon is measured in scripts/serve_faults.py."""
    server, service, engine = slow
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        _wait_for(lambda: len(engine.live) == sequences, 60, "the engine never began the work")
    _wait_for(lambda: not engine.live, 60, "the work ran on after its client left")
    assert len(engine.aborted) == sequences  # and the prompts after it never began
    _wait_for(lambda: service.reserved == 0, 10, "the request's K/V positions stayed held")
    assert engine.tokens_generated < sequences * 5_000


class FloodDriver:
    """A driver whose every request gets events as fast as a thread can send them, never
    finishing: a cancel then nearly always meets an event on its way in."""

    def __init__(self):
        self.stop = threading.Event()

    def submit(self, prompt_ids, params, on_event, tag=None):
        stream = type("Stream", (), {"cancelled": False})()
        stream.cancel = lambda: setattr(stream, "cancelled", True)

        def flood():
            while not (stream.cancelled or self.stop.is_set()):
                on_event(Event(1, 1, [5], [-0.5], [1.0], [0], False, None))
                time.sleep(0.0001)
        threading.Thread(target=flood, daemon=True).start()
        return stream


def test_a_cancel_that_meets_an_event_still_ends_the_request():
    """A gone client's request is cancelled while events arrive: the cancel must end it
    (asyncio.wait_for on Python 3.11 returned the event instead and the work ran on)."""
    tok = chat_tokenizer()
    service = Service(tok, "m", 100_000, (tok.convert_tokens_to_ids("<|im_end|>"),))
    service.driver = FloodDriver()
    params = [SamplingParams(max_new_tokens=10**6)]

    async def cancels_kept() -> int:
        kept = 0
        for i in range(50):
            task = asyncio.ensure_future(run_choices(service, [1, 2], params, []))
            await asyncio.sleep(0.0005 * (i % 6))
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=5.0)
            kept += bool(done) and task.cancelled()
            if not done:  # stop the flood so that the lost request ends too
                service.driver.stop.set()
                await asyncio.wait({task}, timeout=5.0)
                service.driver.stop.clear()
        return kept

    assert asyncio.run(cancels_kept()) == 50
    assert service.reserved == 0


def test_a_stop_aborts_the_work_in_flight_and_ends_the_server_in_bounded_time():
    """What SIGTERM or Ctrl-C calls (uvicorn's handle_exit): on_exit stops the engine, the
    open answer ends with 503, and the server is gone within its shutdown bound."""
    tok = chat_tokenizer()
    engine = SlowEngine(tok.convert_tokens_to_ids("a"))
    service = Service(tok, "m", 100_000, (tok.convert_tokens_to_ids("<|im_end|>"),))
    service.driver = EngineDriver(engine)
    stopped = []
    server = StoppingServer(_config(build_app(service), "127.0.0.1", 0),
                            on_exit=lambda: stopped.append(service.driver.stop()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    out = {}
    body = json.dumps({**ASK, "max_tokens": 50_000}).encode()
    client = threading.Thread(target=lambda: out.setdefault("reply", post(
        type("S", (), {"url": url}), body)))
    client.start()
    while not engine.live:
        time.sleep(0.01)
    t0 = time.monotonic()
    server.handle_exit(15, None)
    thread.join(10)
    client.join(10)
    assert not thread.is_alive() and time.monotonic() - t0 < 6.0
    assert stopped == [1] and engine.aborted and not engine.live
    assert out["reply"][0] == 503


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat") / "model")


class Watched(BuiltinEngine):
    """The built-in engine, recording the largest K/V cache it held (rows x positions)."""
    peak = 0

    def step(self):
        out = super().step()
        s = self.scheduler
        self.peak = max(self.peak, s.cache_rows * s.cache_len)
        return out


def test_the_kv_budget_bounds_the_cache_refuses_what_cannot_fit_and_queues(chat_dir):
    model, _ = models.load_model(chat_dir)
    tok = models.load_tokenizer(chat_dir)
    budget = 240  # one choice of 16 + 100 tokens (128 positions aligned) at a time
    engine = Watched(model, seed=0, kv_budget_tokens=budget)
    service = Service(tok, "m", model.config.max_position_embeddings, (-1,),
                      kv_budget_tokens=budget)
    service.driver = EngineDriver(engine)
    server = BackgroundServer(build_app(service))
    try:
        # 16 choices of up to 100 tokens want 16 x 128 positions: they take turns in budget
        status, reply = post(server, json.dumps({**ASK, "n": 16, "max_tokens": 100}).encode())
        assert status == 200 and len(reply["choices"]) == 16
        assert all(len(c["message"]["content"]) > 0 for c in reply["choices"])
        assert 0 < engine.peak <= budget
        # one choice that cannot fit whatever waits: 400 at once, naming the bound
        service.kv_budget_tokens = 100
        status, reply = post(server, json.dumps({**ASK, "max_tokens": 200}).encode())
        assert status == 400 and reply["error"]["code"] == "kv_budget_exceeded"
        assert "budget holds 100" in reply["error"]["message"]
        for path, body in (("/v1/chat/completions", ASK),  # streamed: the status, not an
                           ("/v1/completions", {"model": "m", "prompt": "12 + 7 ="})):  # event
            status, reply = post(server, json.dumps({**body, "max_tokens": 200,
                                                     "stream": True}).encode(), path)
            assert status == 400 and reply["error"]["code"] == "kv_budget_exceeded"
        # the engine's own check, where the service's is bypassed: that request fails, the
        # engine serves on
        service.kv_budget_tokens = None
        status, reply = post(server, json.dumps({**ASK, "max_tokens": 230}).encode())
        assert status == 400 and "kv_budget_tokens=240" in reply["error"]["message"]
        assert post(server, json.dumps({**ASK, "max_tokens": 20}).encode())[0] == 200
    finally:
        server.close()
        service.driver.close()


def test_past_the_queued_budgets_a_request_gets_429_and_its_positions_come_back():
    tok = chat_tokenizer()
    service = Service(tok, "m", 100_000, (0,), kv_budget_tokens=1_024)
    params = [SamplingParams(max_new_tokens=924)]
    held = [service.reserving(100, params) for _ in range(QUEUED_BUDGETS)]
    for h in held:
        h.__enter__()
    assert service.reserved == QUEUED_BUDGETS * 1_024
    with pytest.raises(ApiError) as e:
        with service.reserving(10, [SamplingParams(max_new_tokens=10)]):
            pass
    assert e.value.status == 429 and e.value.headers == {"retry-after": "2"}
    for h in held:
        h.__exit__(None, None, None)
    assert service.reserved == 0
    with service.reserving(10, [SamplingParams(max_new_tokens=10)]):
        assert service.reserved == 20
