"""Whether a held-out pass@1 reaches a target. A target is a measured pass@1 plus a gain, and
the sum rounds (0.195 + 0.1 = 0.29500000000000004), so an evaluation scoring exactly the
target would miss it by a rounding error: comparisons allow for that much."""

from __future__ import annotations

ROUNDING = 1e-9  # far below any pass@1's resolution (1 / the number of problems)


def reaches(pass1: float, target: float) -> bool:
    return pass1 >= target - ROUNDING


def first_reach(curve: list[dict], target: float) -> dict | None:
    """The first evaluation at or above target, or None."""
    return next((c for c in curve if reaches(c["pass1"], target)), None)
