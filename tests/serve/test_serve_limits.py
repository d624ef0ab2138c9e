"""The endpoint's limits against hostile bodies: a body past the limit is refused whether its
size is declared or streamed in chunks (nothing past the limit is kept); a prompt that cannot
fit the context is refused before it is tokenized; and parsing, rendering and tokenizing run
off the event loop, so one slow body never stalls another client."""

import json
import socket
import threading
import urllib.request

import openai
import pytest
from agent_helpers import ScriptedEngine
from chat_model import chat_tokenizer

from rollwise.serve.app import MAX_BODY_BYTES, build_app
from rollwise.serve.driver import EngineDriver
from rollwise.serve.gate import bearer_token
from rollwise.serve.server import BackgroundServer
from rollwise.serve.service import Service, longest_token_chars

MESSAGES = [{"role": "user", "content": "What is 12 + 7?"}]


@pytest.fixture
def served():
    tok = chat_tokenizer()
    service = Service(tok, "m", 100_000, (tok.convert_tokens_to_ids("<|im_end|>"),))
    service.driver = EngineDriver(ScriptedEngine(tok, lambda prompt: "19<|im_end|>"))
    server = BackgroundServer(build_app(service))
    yield server, service, tok
    server.close()
    service.driver.close()


def chunked_post(server, path: str, chunks) -> tuple[int | None, bytes]:
    """POST `chunks` with Transfer-Encoding: chunked (no Content-Length): the status and body
    of the reply, or (None, b'') when the server closed the connection before one came."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Transfer-Encoding: chunked\r\n\r\n".encode())
        try:
            for c in chunks:
                s.sendall(b"%x\r\n%s\r\n" % (len(c), c))
            s.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while sending: the reply, if any, is read below
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
                if b"\r\n\r\n" in reply and _complete(reply):
                    break
        except ConnectionResetError:
            pass
    if not reply:
        return None, b""
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def _complete(reply: bytes) -> bool:
    head, _, body = reply.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def test_a_chunked_body_past_the_limit_is_refused_and_one_within_it_is_served(served):
    server, service, _ = served
    megabyte = b" " * (1 << 20)  # JSON whitespace: valid until the limit is passed
    status, body = chunked_post(server, "/v1/chat/completions",
                                [megabyte] * ((MAX_BODY_BYTES >> 20) + 4))
    assert status in (413, None)  # the reply may be lost to the reset of a refused upload
    if status == 413:
        assert json.loads(body)["error"]["code"] == "body_too_large"
    whole = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    status, body = chunked_post(server, "/v1/chat/completions",
                                [whole[:10], whole[10:30], whole[30:]])
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "19"


def test_a_declared_body_past_the_limit_is_refused_before_it_is_read(served):
    server = served[0]
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                  f"{MAX_BODY_BYTES + 1}\r\n\r\n".encode())  # and no body at all
        assert s.recv(65536).split()[1] == b"413"


def test_a_prompt_longer_than_any_context_is_refused_before_tokenizing(served):
    server, service, tok = served
    calls = []
    encode = tok.encode
    tok.encode = lambda *a, **k: calls.append(1) or encode(*a, **k)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    huge = "x" * (service.max_prompt_chars + 1)  # under the body limit
    assert len(huge) < MAX_BODY_BYTES
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=[{"role": "user", "content": huge}])
    assert e.value.body["code"] == "context_length_exceeded" and not calls
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="m", prompt=huge)
    assert e.value.body["code"] == "context_length_exceeded" and not calls
    assert service.max_prompt_chars == 100_000 * longest_token_chars(tok)
    assert longest_token_chars(tok) == max(map(len, tok.get_vocab()))


def test_tokenizing_a_body_never_stalls_other_clients(served):
    """The tokenizer is held inside one request; another client's request and the model list
    are answered meanwhile (on the event loop they waited for it)."""
    server, service, tok = served
    entered, release = threading.Event(), threading.Event()
    encode = tok.encode

    def slow_encode(text, *a, **k):
        if "SLOW" in text:
            entered.set()
            assert release.wait(60)
        return encode(text, *a, **k)
    tok.encode = slow_encode
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    out = {}
    slow = threading.Thread(target=lambda: out.setdefault("slow", c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "SLOW, please: what is 12 + 7?"}])))
    slow.start()
    try:
        assert entered.wait(60)
        assert c.models.list().data[0].id == "m"  # answered while the tokenizer is held
        with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as r:
            assert r.status == 200
        assert "slow" not in out
    finally:
        release.set()
        slow.join(60)
    assert out["slow"].choices[0].message.content == "19"


def test_the_bearer_scheme_is_read_in_any_case():
    assert bearer_token("Bearer k") == bearer_token("bearer k") == bearer_token(" BEARER  k ") \
        == "k"
    assert bearer_token("Basic k") is None and bearer_token("Bearer") is None
