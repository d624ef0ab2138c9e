"""The OpenAI-compatible endpoints over the vLLM engine (rollwise.serve), through the real
`openai` client: what they return is what the same engine gives directly for the same prompt
ids and seed, streaming or not. The engine is stepped by the thread that built it (vLLM's CPU
attention keeps the thread count it was built with), as an agent round steps it.

    .venv-vllm/bin/python -m pytest -m vllm tests/with_vllm/test_vllm_serve.py -q
"""

import os
import threading
import time

import engine_contract as contract
import openai
import pytest

from rollwise import models
from rollwise.engine import Request, SamplingParams
from rollwise.serve.app import build_app
from rollwise.serve.driver import EngineDriver
from rollwise.serve.server import BackgroundServer
from rollwise.serve.service import Service, choice_seed

pytestmark = pytest.mark.vllm
PROMPT = "12+7="


def test_the_endpoints_serve_vllm_as_the_engine_generates(tmp_path):
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rollwise.engine.vllm import VLLMEngine
    model, tok = contract.wild_model(hidden=64, heads=2, kv_heads=1)  # head_dim 32 for vLLM
    models.save(model, tok, tmp_path / "model")
    engine = VLLMEngine(tmp_path / "model", max_batch=4, max_model_len=64, block_size=32)
    service = Service(tok, "wild", 64, (tok.eos_token_id,))
    service.driver = EngineDriver(engine, own_thread=False)
    server = BackgroundServer(build_app(service))
    got = {}

    def client():
        try:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                              timeout=120)
            got["whole"] = c.completions.create(model="wild", prompt=PROMPT, seed=4,
                                                max_tokens=12, n=2, logprobs=0)
            got["streamed"] = "".join(ch.choices[0].text for ch in c.completions.create(
                model="wild", prompt=PROMPT, seed=4, max_tokens=12, stream=True))
        except Exception as e:
            got["error"] = e
    asking = threading.Thread(target=client)
    asking.start()
    t0 = time.monotonic()
    try:
        while asking.is_alive() and time.monotonic() - t0 < 120:
            service.driver.pump()  # this thread built the engine: it steps it
    finally:
        server.close()
        service.driver.close()
    asking.join(10)
    assert "error" not in got, got.get("error")
    ids = tok.encode(PROMPT)
    for i, choice in enumerate(got["whole"].choices):
        (want,) = engine.generate([Request(ids, SamplingParams(max_new_tokens=12,
                                                               seed=choice_seed(4, i),
                                                               stop_ids=(tok.eos_token_id,)))])
        body = want.token_ids[:-1] if want.finish_reason == "stop" else want.token_ids
        assert choice.text == tok.decode(body, skip_special_tokens=True)
        assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert got["streamed"] == got["whole"].choices[0].text
