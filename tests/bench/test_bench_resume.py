"""`rollwise bench resume` end to end, small: the tiny model's resumed answers with and without
shared prefixes, every prefilled token accounted for."""

import json

import pytest

from rollwise.bench import resume

SYSTEM = "task.system_prompt=Think step by step and answer."  # prompts longer than a block


def test_bench_resume_shares_each_groups_prompt_and_keeps_the_answers(capsys):
    assert resume.main(["--problems", "3", "--cut", "4", "--repeats", "1", "--json",
                        "generate.max_new_tokens=24", "generate.group_size=4", SYSTEM]) == 0
    out = json.loads(capsys.readouterr().out)
    off, on = out["per_round"]["off"], out["per_round"]["on"]
    assert out["resumed"] > 1 and off["shared_tokens"] == 0 < on["shared_tokens"]
    assert on["prefill_tokens"] + on["shared_tokens"] == off["prefill_tokens"]
    assert on["decoded_tokens"] == off["decoded_tokens"]
    assert out["resume_prefill_saved"] == pytest.approx(on["shared_tokens"]
                                                        / off["prefill_tokens"])
    assert out["same_answers"] == 1.0  # float32: the copied K/V gives the same tokens
    keep = out["per_round"]["keep"]
    assert keep["resumed"] == out["resumed"] and keep["prefill_tokens"] == 0
    assert out["keep_prefill_tokens"] == 0
    # the same uniforms after the cut and the same weights: float32 gives the same answers
    assert out["same_answers_kept"] == 1.0 and keep["decoded_tokens"] == off["decoded_tokens"]


def test_a_cut_past_the_answers_length_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit):
        resume.main(["--cut", "24", "generate.max_new_tokens=24"])
    assert "--cut 24" in capsys.readouterr().err
