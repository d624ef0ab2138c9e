"""The levers bench's loss lever: the compiled loss is the eager one, and both arms run."""

from __future__ import annotations

from rollwise.bench.levers import loss_arms


def test_the_compiled_loss_equals_the_eager_one_and_both_arms_step():
    arms, facts = loss_arms(256)
    assert facts["tokens"] == 256 and facts["compile_seconds"] > 0
    assert facts["loss_gap"] < 1e-6
    assert list(arms) == ["eager", "torch.compile"]
    for once in arms.values():
        once()  # forward and backward, as the bench times them
