"""torch's compile cache after an interrupted start (rollwise/engine/compile_cache.py): the
files a killed compile leaves (empty, or cut short) are found and removed so the next start
compiles again; and where a compile or load fails anyway, the engine runs the uncompiled decode
graph, token for token the same, saying so once with the cache to clear."""

import logging
import os
import subprocess
import sys
import textwrap
import time

import engine_contract as contract

from rollwise.engine import BuiltinEngine, Request, SamplingParams, compile_cache
from rollwise.engine.decode_graph import DecodeGraph

COMPILE = textwrap.dedent("""
    import sys, torch
    from rollwise.engine import compile_cache
    if sys.argv[1] == "repair":
        print("removed", len(compile_cache.repair()))
    @torch.compile
    def f(x):
        return (x.sin() * 2 + x.cos()).sum(-1)
    print("ok", f(torch.ones(8, 16)).tolist()[0])
""")


def compile_in(cache, mode: str) -> subprocess.CompletedProcess:
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-c", COMPILE, mode], env=env, capture_output=True,
                          text=True, timeout=600)


def test_an_interrupted_compiles_files_poison_the_cache_until_repaired(tmp_path):
    cache = tmp_path / "inductor"
    first = compile_in(cache, "plain")
    assert first.returncode == 0 and "ok" in first.stdout, first.stderr[-2000:]
    objects = sorted(cache.rglob("*.so"))
    assert objects and not any(compile_cache.is_damaged(p) for p in objects)
    old = time.time() - 3600
    for i, path in enumerate(objects):  # as a kill mid-write leaves them: empty, or cut
        data = path.read_bytes()
        path.write_bytes(b"" if i % 2 == 0 else data[: len(data) // 2])
        os.utime(path, (old, old))
    assert all(compile_cache.is_damaged(p) for p in objects)
    broken = compile_in(cache, "plain")
    assert broken.returncode != 0 or "ok" not in broken.stdout  # every later start dies
    for path in objects:  # the failed start may have rewritten some: damage them again
        if path.exists():
            path.write_bytes(b"")
            os.utime(path, (old, old))
    repaired = compile_in(cache, "repair")
    assert repaired.returncode == 0, repaired.stderr[-2000:]
    assert f"removed {len(objects)}" in repaired.stdout and "ok" in repaired.stdout
    assert repaired.stdout.split("ok")[1].strip() == first.stdout.split("ok")[1].strip()


def test_repair_leaves_sound_recent_and_foreign_files(tmp_path):
    sound = tmp_path / "a" / "sound.so"
    sound.parent.mkdir()
    sound.write_bytes(open(sys.executable, "rb").read())  # a whole ELF file
    fresh = tmp_path / "a" / "fresh.so"
    fresh.write_bytes(b"")  # being written now, by another process perhaps
    other = tmp_path / "a" / "notes.txt"
    other.write_bytes(b"")
    old = time.time() - 3600
    os.utime(sound, (old, old))
    assert compile_cache.repair(tmp_path) == []
    assert sound.exists() and fresh.exists() and other.exists()


def test_a_failed_compile_falls_back_to_the_uncompiled_graph_said_once(monkeypatch, caplog):
    model = contract.wild_model()[0]

    def fails(self):
        raise ImportError("/tmp/torchinductor_x/ab/cabc.so: file too short")
    monkeypatch.setattr(DecodeGraph, "warm_up", fails)
    requests = [Request(list(p), SamplingParams(temperature=0.9, max_new_tokens=12, seed=i), i)
                for i, p in enumerate(contract.PROMPTS[:3])]
    with caplog.at_level(logging.WARNING, logger="rollwise.engine.builtin"):
        fell = BuiltinEngine(model, max_batch=4, segment=5, graph="compile")
        got = fell.generate(requests)
        fell.generate(requests)
    eager = BuiltinEngine(model, max_batch=4, segment=5, graph="eager").generate(requests)
    assert [c.token_ids for c in got] == [c.token_ids for c in eager]
    assert fell.graph is not None and not fell.graph.compiled
    said = [r.getMessage() for r in caplog.records if "uncompiled decode graph" in r.getMessage()]
    assert len(said) == 1 and "file too short" in said[0]
    assert str(compile_cache.cache_dir()) in said[0] and "rm -rf" in said[0]
    assert "file too short" in fell.graph_note and fell.busy_with == ""


def test_the_compile_is_said_with_how_long_it_takes(monkeypatch, caplog):
    model = contract.wild_model()[0]
    seen = []
    engine = BuiltinEngine(model, max_batch=4, segment=5, graph="compile")
    monkeypatch.setattr(DecodeGraph, "warm_up", lambda self: seen.append(engine.busy_with) or 0.0)
    with caplog.at_level(logging.WARNING, logger="rollwise.engine.builtin"):
        engine.generate([Request(list(contract.PROMPTS[0]), SamplingParams(max_new_tokens=3))])
    assert seen and seen[0].startswith("compiling the decode graph") and "min" in seen[0]
    assert any("compiling the decode graph" in r.getMessage() for r in caplog.records)
    assert engine.busy_with == ""
