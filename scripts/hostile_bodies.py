"""Time the endpoint's refusals of hostile bodies, and another client's wait meanwhile.

    python3 scripts/hostile_bodies.py [--model DIR]     # default: SmolLM2-135M-Instruct's folder

The server runs as `rollwise serve` builds it, with the model's tokenizer and context; no
engine is needed, since every request here is refused before it would generate. Prints JSON:
per body, its HTTP status and seconds to the reply, and the slowest `GET /v1/models` answered
while that body was being handled; then how many of 1,100 connections that never finish their
request head (one sends nothing) the server still holds 20 s later.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

from rollwise import models
from rollwise.serve.app import build_app
from rollwise.serve.server import BackgroundServer
from rollwise.serve.service import Service

MB = 1 << 20


def post(port: int, body: bytes, chunked: bool) -> int | None:
    """The reply's status (None: the connection was closed before one came)."""
    head = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    with socket.create_connection(("127.0.0.1", port), timeout=300) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  f"Content-Type: application/json\r\n{head}\r\n\r\n".encode())
        try:
            if chunked:
                for i in range(0, len(body), MB):
                    part = body[i:i + MB]
                    s.sendall(b"%x\r\n%s\r\n" % (len(part), part))
                s.sendall(b"0\r\n\r\n")
            else:
                s.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            reply = s.recv(4096)
        except ConnectionResetError:
            return None
    return int(reply.split()[1]) if reply else None


def half_sent_heads(port: int, n: int = 1_100, wait_s: float = 20.0) -> dict:
    """n connections that send half a request head and one that sends nothing: how many the
    server still holds open after wait_s."""
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=wait_s + 10)
        if i:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)
    time.sleep(wait_s)
    still = 0
    for s in socks:
        s.setblocking(False)
        try:
            still += s.recv(1) != b""
        except BlockingIOError:
            still += 1
        except OSError:
            pass
        s.close()
    return {"connections": n, "open_after_s": wait_s, "still_open": still}


def timed(url: str, port: int, body: bytes, chunked: bool) -> dict:
    waits, done = [], threading.Event()

    def poll():
        while not done.is_set():
            t = time.perf_counter()
            urllib.request.urlopen(url + "/v1/models", timeout=300).read()
            waits.append(time.perf_counter() - t)
            time.sleep(0.05)
    poller = threading.Thread(target=poll)
    poller.start()
    t0 = time.perf_counter()
    status = post(port, body, chunked)
    seconds = time.perf_counter() - t0
    done.set()
    poller.join()
    return {"status": status, "seconds": round(seconds, 3),
            "models_slowest_s": round(max(waits, default=0.0), 3)}


def chat(content: str) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


def raw_chat(content_json: str, extra: str = "") -> bytes:
    return ('{"model": "m", "messages": [{"role": "user", "content": %s}]%s}'
            % (content_json, extra)).encode()


def deep(n: int) -> str:
    return "[" * n + "1" + "]" * n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".cache/rollwise/models/"
                                          "smollm2-135m-instruct"))
    args = p.parse_args()
    tok = models.load_tokenizer(args.model)
    context = models.load_model(args.model)[0].config.max_position_embeddings
    service = Service(tok, "m", context, (tok.eos_token_id,))
    service.driver = object()  # refused requests never reach an engine
    server = BackgroundServer(build_app(service))
    just_fits = "word " * (service.max_prompt_chars // 5 - 1)  # tokenized, then too long
    cases = {
        "20 MB chunked body": (b" " * (20 * MB), True),
        "20 MB declared body": (b" " * (20 * MB), False),
        "2 MB message (under the body limit)": (chat("x" * (2 * MB)), False),
        f"{len(just_fits) // 1000} k-character message (rendered past the bound)":
            (chat(just_fits), False),
        "500,000 empty messages": (json.dumps({"model": "m", "messages": [
            {"role": "user", "content": ""}] * 500_000}).encode(), False),
        "content nested 100,000 deep": (raw_chat(deep(100_000)), False),
        "extra field nested 100,000 deep": (raw_chat('"hi"', ', "x": ' + deep(100_000)), False),
        "objects nested 5,000 deep": (raw_chat('"hi"', ', "x": ' + '{"a": ' * 5_000 + "1"
                                               + "}" * 5_000), False),
        "lone surrogate": (raw_chat('"hi \\ud800"'), False),
    }
    out = {"context": context, "max_prompt_chars": service.max_prompt_chars,
           **{name: timed(server.url, server.port, body, chunked)
              for name, (body, chunked) in cases.items()},
           "half-sent heads": half_sent_heads(server.port)}
    server.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
