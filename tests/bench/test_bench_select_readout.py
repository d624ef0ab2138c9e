"""bench select --readout: medians, ratios and three-seed subset rates from progress logs."""

import itertools

import pytest

from rollwise.bench.select_readout import (
    NOT_REACHED,
    medians,
    parse_logs,
    report,
    rollouts_to,
    subset_rate,
)


def line(method, seed, curve):
    return (f"# {method} seed {seed}: mixed 0.20 reached None rollouts 0 steps 0 tiers "
            f"(groups, mixed) {{'add2': [1, 1]}} curve {curve}\n")


# rollouts at which each run first reaches 0.29 (None: never); each curve also passes 0.27
# at a quarter of those rollouts
NEED = {"uniform": [None, 4000, None, 3000],
        "dynamic": [9000, 12000, 10000, 40000],
        "dps": [2000, 3900, None, 2500]}


def curve(need):
    end = need or 8000
    return [(1, end // 4, 0.27), (2, end // 2, 0.28 if need else 0.2),
            (3, end, 0.29 if need else 0.25)]


@pytest.fixture
def logs(tmp_path):
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("unrelated output\n" + line("dps", 0, [(1, 1, 0.99)]) + "".join(
        line(m, s, curve(n)) for m in ("uniform", "dps") for s, n in enumerate(NEED[m])))
    b.write_text("".join(line("dynamic", s, curve(n)) for s, n in enumerate(NEED["dynamic"])))
    return [str(a), str(b)]


def naive_median(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def test_later_lines_replace_earlier_and_targets_read_from_the_curve(logs):
    runs = parse_logs(logs)
    assert len(runs) == 12  # the stray dps seed 0 line was replaced by the later one
    assert rollouts_to(runs[("dps", 0)]["curve"], 0.29) == 2000
    assert rollouts_to(runs[("dps", 2)]["curve"], 0.29) == NOT_REACHED
    assert rollouts_to(runs[("dps", 2)]["curve"], 0.27) == 2000  # 8000 // 4
    med = medians(runs, 0.29, [0, 1, 2, 3])
    for m, need in NEED.items():
        vals = [n if n else NOT_REACHED for n in need]
        assert med[m] == (naive_median(vals), sum(n is not None for n in need))


def test_subset_rate_counts_three_seed_subsets_by_hand(logs):
    runs = parse_logs(logs)
    hits = 0
    for c in itertools.combinations(range(4), 3):
        get = {m: naive_median([NEED[m][s] or NOT_REACHED for s in c]) for m in NEED}
        hits += get["dps"] < NOT_REACHED and get["dps"] <= 0.3 * get["dynamic"] \
            and get["dps"] < get["uniform"]
    assert subset_rate(runs, 0.29, "dynamic") == (hits, 4)
    assert 0 < hits < 4  # the fixture has subsets on both sides


def test_report_prints_ratios_and_a_log_without_runs_is_an_error(logs, tmp_path):
    text = report(logs, [0.29])
    assert "DPS / dynamic: 0.291" in text  # medians 3200 / 11000
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    with pytest.raises(ValueError, match="--progress"):
        report([str(empty)], [0.29])
