"""End to end: one of five clients forging its model update every round does not take the run.
Real `flwr` runs of this project's ServerApp with a ClientApp made in the test from
scripts/attack_client.py (scripts/attack.py builds it; docs/ROBUSTNESS.md has its whole table):
the clean run, a client sending Delta x 1e4 under the defaults (mean, with the default
``max_update_ratio``), and a client sending -10 x Delta under ``median``. All five clients train
in every round from one seed, so the runs differ only in that client's update."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from attack import run_case  # noqa: E402

pytestmark = pytest.mark.timeout(900)
ROUNDS = 8  # as the table of docs/ROBUSTNESS.md: fewer rounds leave the runs too far from converged to compare
POINTS = 0.05  # "within a few points" of the clean run's final accuracy


@pytest.mark.e2e
def test_a_scaled_or_flipped_update_ends_within_a_few_points_of_the_clean_run(tmp_path, flower_engine,
                                                                               on_flower_engine):
    cases = [(None, "mean"), ("scale", "mean"), ("flip", "median")]
    clean, scale, flip = on_flower_engine(lambda case: run_case(flower_engine, tmp_path, *case, ROUNDS), cases)
    for case in (clean, scale, flip):
        assert case["completed"], f"{case['attack']} {case['aggregation']}: {case['status']}\n{case['log'][-3000:]}"
    assert clean["rejected"] == 0 and clean["accuracy"] > 0.5
    # Delta x 1e4 is ~1e4 times the round's median norm: rejected in every round, with both numbers logged
    assert scale["rejected"] == ROUNDS and "more than max_update_ratio=10" in scale["log"]
    assert abs(scale["accuracy"] - clean["accuracy"]) <= POINTS, (scale["accuracy"], clean["accuracy"])
    assert abs(flip["accuracy"] - clean["accuracy"]) <= POINTS, (flip["accuracy"], clean["accuracy"])
