"""Live progress: plain lines, quiet, the rich bar, phase timing and ETA on a fake clock."""

import io
import types

import pytest

from rollwise.report import progress as P


@pytest.fixture
def clock(monkeypatch):
    """A controllable time.time() for the progress module only."""
    now = {"t": 1000.0}
    monkeypatch.setattr(P, "time", types.SimpleNamespace(time=lambda: now["t"]))

    def advance(seconds):
        now["t"] += seconds
    return advance


STEP = {"reward/mean": 0.4125, "perf/gen_tokens_per_s": 2345.6, "groups/mixed_share": 0.625}


def test_plain_lines_show_metrics_and_eta_from_the_first_step(clock):
    out = io.StringIO()
    p = P.Progress("plain", total=10, stream=out)
    clock(500)  # warm start and model loading: not training time
    p.step(0, {"eval/pass1": 0.3})
    clock(20)
    p.step(1, STEP)
    clock(40)
    p.step(3, STEP)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 0/10  pass@1 0.300  eta ?"
    assert lines[1] == ("step 1/10  reward 0.412  pass@1 0.300  tok/s 2346  informative 0.62"
                        "  eta 3m00s")  # 20 s/step x 9 steps left
    assert lines[2].endswith("eta 2m20s")  # 60 s over 3 steps, 7 left


def test_quiet_prints_nothing(capsys, clock):
    p = P.Progress("quiet", total=3)
    p.log("hello")
    p.phase("generate")
    p.step(1, STEP)
    p.close()
    assert capsys.readouterr().out == ""


def seconds(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("perf/")}


def test_phase_seconds_are_booked_per_phase_and_reset(clock):
    p = P.Progress("quiet", total=2)
    p.phase("generate")
    clock(2.0)
    p.phase("score")
    clock(0.5)
    p.phase("generate")  # a phase entered twice adds up
    clock(1.0)
    p.phase("train")
    clock(3.0)
    assert seconds(p.take_phase_metrics()) == {"perf/phase/generate_seconds": 3.0,
                                      "perf/phase/score_seconds": 0.5,
                                      "perf/phase/train_seconds": 3.0}
    clock(1.0)  # still in 'train'
    p.step(1, {})
    clock(5.0)  # between steps: no phase
    assert seconds(p.take_phase_metrics()) == {"perf/phase/train_seconds": 1.0}


def test_rich_bar_renders_to_a_stream(clock):
    out = io.StringIO()
    p = P.Progress("rich", total=5, stream=out)
    p.log("run directory: x")
    p.step(0, {"eval/pass1": 0.25})
    p.phase("generate")
    p.step(2, STEP)
    p.close()
    text = out.getvalue()
    assert "run directory: x" in text and "step 2/5" in text
    assert "reward 0.412" in text and "pass@1 0.250" in text


def test_auto_is_plain_off_a_terminal_and_bad_mode_names_the_field():
    assert P.Progress("auto", total=1, stream=io.StringIO()).mode == "plain"
    with pytest.raises(ValueError, match="run.log = 'loud'"):
        P.Progress("loud")


def test_duration_format():
    assert P.fmt_duration(59.6) == "1m00s"
    assert P.fmt_duration(3 * 3600 + 125) == "3h02m"


def _wait_for(predicate, seconds=5.0):
    import time
    end = time.monotonic() + seconds
    while not predicate() and time.monotonic() < end:
        time.sleep(0.01)
    return predicate()


def test_a_long_phase_is_never_silent_in_plain_mode(clock):
    """A phase longer than heartbeat_s prints its elapsed time and note, once per period;
    a short one prints nothing."""
    out, tokens = io.StringIO(), {"n": 0}
    p = P.Progress("plain", total=3, stream=out, heartbeat_s=0.05)
    p.phase("generate", note=lambda: f"{tokens['n']:,} tokens")
    assert not _wait_for(lambda: "..." in out.getvalue(), 0.3)  # 0 s elapsed: quiet
    tokens["n"] = 1234
    clock(20)
    assert _wait_for(lambda: "  ... generate 20s  1,234 tokens" in out.getvalue())
    p.step(1, STEP)
    clock(20)  # between phases nothing is running: nothing to say
    import time
    time.sleep(0.2)
    p.close()
    assert out.getvalue().count("...") == 1


def test_phase_text_shows_elapsed_time_and_a_note_that_may_fail(clock):
    p = P.Progress("quiet", total=3)
    assert p.phase_text() == ""
    p.phase("train")
    clock(7)
    assert p.phase_text() == "train 7s"
    p.phase("eval", note=lambda: 1 / 0)  # a broken note leaves the phase and time
    clock(3)
    assert p.phase_text() == "eval 3s"
