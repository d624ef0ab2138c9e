"""Time the endpoint's refusals of hostile bodies, and another client's wait meanwhile.

    python3 scripts/hostile_bodies.py [--model DIR]     # default: SmolLM2-135M-Instruct's folder

The server runs as `rollwise serve` builds it, with the model's tokenizer and context; no
engine is needed, since every request here is refused before it would generate. Prints JSON:
per body, its HTTP status and seconds to the reply, and the slowest `GET /v1/models` answered
while that body was being handled.
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
        f"{len(just_fits) // 1000} k-character message (tokenized)": (chat(just_fits), False),
    }
    out = {"context": context, "max_prompt_chars": service.max_prompt_chars,
           **{name: timed(server.url, server.port, body, chunked)
              for name, (body, chunked) in cases.items()}}
    server.close()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
