"""rollwise.registry: names resolve to implementations, and `conform` gives a plugin object that
does not subclass a part's base class the base's defaults, refusing one that lacks a required
method; the Engine base's default `generate` is the engine's own, built from add and step."""

import pytest

from rollwise import registry
from rollwise.engine import BuiltinEngine, Engine, Request, SamplingParams
from rollwise.stages.control.inflight import CONTINUE, InflightController
from rollwise.stages.filter.base import Verifier


class DuckController:
    """An in-flight controller written against the documented methods only."""

    def begin(self, want, step):
        return [], want

    def on_event(self, event, sample, rollout):
        return CONTINUE

    def end(self, rollout, want):
        return list(rollout.groups)

    def metrics(self):
        return {"duck": 1.0}


def test_a_duck_typed_plugin_gets_the_defaults_it_lacks_and_keeps_its_own():
    c = registry.conform(DuckController(), InflightController, "control.inflight")
    assert c.metrics() == {"duck": 1.0}  # its own
    assert c.allocate(["p"], [4]) == [4] and c.state_dict() == {}  # the base's
    assert c.observe([], 0) is None and c.bind(policy=None) is None
    subclass = registry.conform(ok := _Sub(), InflightController, "control.inflight")
    assert subclass is ok  # an instance of the base is returned untouched


class _Sub(InflightController):
    def begin(self, want, step):
        return [], want

    def on_event(self, event, sample, rollout):
        return CONTINUE

    def end(self, rollout, want):
        return []


def test_a_plugin_without_a_required_method_is_refused_by_name():
    class NoScore:
        name = "x"
    with pytest.raises(TypeError, match=r"filter.reward: NoScore lacks score; subclass "
                                        r"rollwise.stages.filter.base.Verifier"):
        registry.conform(NoScore(), Verifier, "filter.reward")


def test_the_task_kind_resolves_a_variant_to_its_registered_name():
    from rollwise.tasks import task_name
    assert task_name("gym:chain_sum") == "gym"
    assert task_name("arith") == "arith"
    assert task_name("mypkg.tasks:Mine") == "mypkg.tasks:Mine"  # a dotted path stays one
    with pytest.raises(ValueError, match="task.name = 'nope': unknown task; choose from arith"):
        registry.resolve("task", "nope", "task.name")


class StepOnly(Engine):
    """An engine that implements only add / step / has_unfinished (a built-in one inside)."""

    def __init__(self, inner):
        self.inner = inner

    def add(self, request):
        return self.inner.add(request)

    def step(self):
        return self.inner.step()

    def has_unfinished(self):
        return self.inner.has_unfinished()


def test_the_default_generate_equals_the_engines_own(tiny):
    model, _ = tiny
    requests = [Request([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=9, seed=1), 0),
                Request([8], SamplingParams(temperature=1.0, max_new_tokens=5, seed=2,
                                            stop_ids=(3,)), 1),
                Request([9, 10], SamplingParams(temperature=0.0, max_new_tokens=7), 2)]
    want = BuiltinEngine(model, max_batch=2, segment=3).generate(requests)
    got = StepOnly(BuiltinEngine(model, max_batch=2, segment=3)).generate(requests)
    for w, g in zip(want, got):
        assert (g.request_id, g.token_ids, g.versions, g.finish_reason) == \
            (w.request_id, w.token_ids, w.versions, w.finish_reason)
        assert g.logprobs == pytest.approx(w.logprobs) and g.entropies == pytest.approx(w.entropies)
