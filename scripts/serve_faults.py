"""`rollwise serve` on a real model against requests that take memory and time, from outside.

    python3 scripts/serve_faults.py [--model DIR] [--kv-budget-gib 1]

Starts `rollwise serve` as its own process (SmolLM2-135M-Instruct's folder by default) and
measures, from /proc, what the server holds and spends:
- memory: its resident set before and at the first text of a streamed n=16, max_tokens=8000
  request (each choice's K/V reserved up front), with the budget given and the default;
- a gone client: a non-streaming n=8, max_tokens=3000 request whose client leaves after 8 s,
  and the server's CPU seconds over the 2 s before and the 5 s after (from 1 s after);
- a stop: SIGTERM with a request in flight, and the seconds until the process has ended.
Each server answers a 4-token request first, so the decode graph's compile (or its load from
torch's cache) is out of what is measured: a step in progress, a compile included, ends
before an abort lands. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

GIB = 2**30
LONG = [{"role": "user", "content": "Count from 1 to 5000, one number a line."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(model: str, budget: float | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "rollwise", "serve", "--model", model, "--port", str(port),
           "--name", "m"] + (["--kv-budget-gib", str(budget)] if budget else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5).read()
            # the first request compiles (or loads) the decode graph: out of what is measured
            request(url, {"model": "m", "messages": LONG, "max_tokens": 4}, 600).read()
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(proc.stderr.read())
            time.sleep(0.5)
    raise TimeoutError("the server did not start")


def request(url: str, body: dict, timeout: float):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _has_text(line: bytes) -> bool:
    """An SSE line carrying generated text (not the role chunk's empty content)."""
    if not line.startswith(b"data: {"):
        return False
    delta = json.loads(line[6:])["choices"][0]["delta"]
    return bool(delta.get("content"))


def memory(model: str, budget: float | None) -> dict:
    proc, url = start(model, budget)
    try:
        before = rss(proc.pid)
        t0 = time.monotonic()
        with request(url, {"model": "m", "messages": LONG, "n": 16, "max_tokens": 8000,
                           "stream": True}, 600) as r:
            while not _has_text(r.readline()):
                pass
            first = rss(proc.pid)
        return {"kv_budget_gib": budget or "default", "rss_before_gib": round(before / GIB, 3),
                "rss_at_first_chunk_gib": round(first / GIB, 3),
                "added_gib": round((first - before) / GIB, 3),
                "first_chunk_s": round(time.monotonic() - t0, 2)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def send_raw(url: str, body: dict) -> socket.socket:
    """A chat request on a socket of our own, so that closing it is the client leaving."""
    port = int(url.rsplit(":", 1)[1])
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def busy(pid: int, seconds: float) -> float:
    c0 = cpu_seconds(pid)
    time.sleep(seconds)
    return round(cpu_seconds(pid) - c0, 2)


LONG_REQUEST = {"model": "m", "messages": LONG, "max_tokens": 3000, "n": 8, "seed": 0}


def gone_client(model: str, budget: float | None) -> dict:
    proc, url = start(model, budget)
    try:
        s = send_raw(url, LONG_REQUEST)
        time.sleep(6.0)
        before = busy(proc.pid, 2.0)  # still generating when the client leaves
        s.close()
        time.sleep(1.0)  # the abort lands within a second
        return {"cpu_seconds_in_2s_before": before, "cpu_seconds_in_5s_after":
                busy(proc.pid, 5.0)}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def stop(model: str, budget: float | None) -> dict:
    proc, url = start(model, budget)
    s = send_raw(url, LONG_REQUEST)
    time.sleep(4.0)
    before = busy(proc.pid, 2.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"exited_s": None, "said": "still running after 60 s: killed"}
    finally:
        s.close()
    said = [line for line in proc.stderr.read().splitlines() if "stopping" in line]
    return {"cpu_seconds_in_2s_before": before, "exited_s": round(time.monotonic() - t0, 2),
            "said": said}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(Path.home() / ".cache/rollwise/models/"
                                          "smollm2-135m-instruct"))
    p.add_argument("--kv-budget-gib", type=float, default=1.0)
    args = p.parse_args()
    out = {"memory": [memory(args.model, args.kv_budget_gib), memory(args.model, None)],
           "gone_client": gone_client(args.model, args.kv_budget_gib),
           "stop": stop(args.model, args.kv_budget_gib)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
