"""Shared fixtures and the suite's layout.

tests/<part>/ holds the tests of rollwise/<part>/ (tests/stages/filter/ those of
rollwise/stages/filter/, ...); tests/ itself the tests of top-level modules, and the helpers the
test modules share (*_helpers.py, engine_contract.py, extension_plugin.py, ...), which no test
module imports from another. Tests that run whole training loops are marked `integration`:
`python3 -m pytest -q --unit` leaves them out (the unit suite, within 3 minutes on 2 cores) and
runs in one process per core, each test file in one of them, unless -n is given;
`python3 -m pytest -q` runs both, as CI does (in two processes: `-n 2 --dist loadfile`).
"""

import os

import pytest
import torch

from rollwise import models
from rollwise.config import ModelConfig

torch.set_num_threads(1)  # the suite shares a 2-core machine; keep numbers deterministic


def pytest_addoption(parser):
    parser.addoption("--unit", action="store_true",
                     help="the unit suite: leave out tests marked integration (whole loops)")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """--unit is the quick check while editing: it takes every core (pytest-xdist) unless the
    command says how many processes (-n) or leaves xdist out (-p no:xdist)."""
    cores = os.cpu_count() or 1
    worker = "PYTEST_XDIST_WORKER" in os.environ  # a worker runs what its controller gives it
    if config.getoption("--unit") and getattr(config.option, "numprocesses", 0) is None \
            and cores > 1 and not worker:
        config.option.numprocesses, config.option.dist = cores, "loadfile"


_PEAK = {"gib": 0.0, "test": ""}  # this process's peak RSS and the test that last raised it


def pytest_runtest_teardown(item):
    from rollwise.report.memory import GIB, high_water_bytes
    now = high_water_bytes() / GIB
    if now > _PEAK["gib"]:
        _PEAK.update(gib=now, test=item.nodeid)


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand it to the controller
        session.config.workeroutput["peak_rss"] = dict(_PEAK)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the vLLM venv runs pytest without xdist
def pytest_testnodedown(node, error):
    peak = getattr(node, "workeroutput", {}).get("peak_rss")
    if peak:
        node.config._peaks = getattr(node.config, "_peaks", []) + [peak]


def pytest_terminal_summary(terminalreporter, config):
    """Each test process's peak resident memory, and the test that set it."""
    for p in getattr(config, "_peaks", None) or ([_PEAK] if _PEAK["test"] else []):
        terminalreporter.write_line(f"peak resident memory of a test process: "
                                    f"{p['gib']:.2f} GiB (set in {p['test']})")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--unit"):
        return
    left_out = [item for item in items if "integration" in item.keywords]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if "integration" not in item.keywords]


@pytest.fixture(scope="session")
def tiny():
    """A small random Qwen2 model and the character tokenizer."""
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                      intermediate_size=64)
    return models.build(cfg, seed=0)
