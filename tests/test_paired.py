"""Paired comparisons over seeds (fedact_app.paired): the statistics against hand computations,
pairing by seed, and the refusal of runs that trained other clients."""

from pathlib import Path

import math

import pytest

from fedact_app import paired, report
from fedact_app.report import ReportError, Setting


def test_paired_stats_match_a_hand_computation():
    """d = (1, 2, 3, -0.5, 4): mean 1.9, s^2 = 12.2 / 4; 4 wins, 1 loss. Wilcoxon: the ranks of
    |d| are 2, 3, 4, 1, 5, so W- = 1; of the 2^5 equally likely sign patterns 2 have W- <= 1
    (none negative, rank 1 negative), two-sided p = 2 * 2/32. t = 1.9 / sqrt(3.05 / 5) with 4
    degrees of freedom, whose CDF has the closed form 1/2 + 3/8 * u (1 - t^2 / (12 (1 + t^2/4))),
    u = t / sqrt(1 + t^2/4)."""
    stats = paired.paired_stats([1.0, 2.0, 3.0, -0.5, 4.0])
    assert (stats.n, stats.wins, stats.losses, stats.ties) == (5, 4, 1, 0)
    assert stats.mean == pytest.approx(1.9) and stats.std == pytest.approx(math.sqrt(12.2 / 4))
    assert stats.wilcoxon_p == pytest.approx(4 / 32)
    t = 1.9 / math.sqrt(3.05 / 5)
    cdf = 0.5 + 3 / 8 * t / math.sqrt(1 + t * t / 4) * (1 - t * t / (12 * (1 + t * t / 4)))
    assert stats.ttest_p == pytest.approx(2 * (1 - cdf), rel=1e-9)


def test_paired_stats_count_ties_and_leave_undefined_tests_out():
    stats = paired.paired_stats([0.0, 0.5, -0.25])
    assert (stats.wins, stats.losses, stats.ties) == (1, 1, 1)
    none = paired.paired_stats([0.0, 0.0])
    assert none.wilcoxon_p is None and none.ttest_p is None and none.ties == 2
    one = paired.paired_stats([2.0])
    assert one.std is None and one.wilcoxon_p is None and one.ttest_p is None
    with pytest.raises(ReportError):
        paired.paired_stats([])


def fake_run(algorithm: str, seed: int, final: float, samples: list, local_steps: str = "10") -> report.Run:
    """A Run whose rounds 1.. sampled ``samples`` (None: a row without sampled_clients)."""
    rows = [{"round": 0, "test_accuracy": 0.1}]
    rows += [{"round": r, **({} if s is None else {"sampled_clients": s}), "test_accuracy": final}
             for r, s in enumerate(samples, start=1)]
    return report.Run(path=Path(f"/runs/{algorithm}_s{seed}"), algorithm=algorithm,
                      setting=Setting("vit_tiny", "fashion_mnist", "dirichlet", 0.1), seed=seed, rows=tuple(rows),
                      hyperparameters=(("local_steps", local_steps), ("lr", "0.001")))


def test_paired_comparison_pairs_by_seed_in_percent():
    fedact = [fake_run("fedact", s, 0.5 + s / 100, [[s, 1], [2, 3]]) for s in (1, 2, 3)]
    fedadamw = [fake_run("fedadamw", s, 0.5, [[s, 1], [2, 3]]) for s in (3, 2, 1, 4)]
    warnings = []
    comparison = paired.paired_comparison(fedact, fedadamw, "test_accuracy", "final", warnings.append)
    assert comparison.seeds == (1, 2, 3) and comparison.baseline == "FedAdamW"
    assert comparison.differences == pytest.approx((1.0, 2.0, 3.0))
    assert comparison.stats.wins == 3 and comparison.stats.mean == pytest.approx(2.0)
    assert len(warnings) == 1 and "seed 4" in warnings[0]  # only the baseline has it


@pytest.mark.parametrize("other, why", [
    (fake_run("fedadamw", 1, 0.5, [[1, 2], [2, 4]]), "sampled different clients in round 2: [2, 3] vs [2, 4]"),
    (fake_run("fedadamw", 1, 0.5, [[1, 2], None]), "has no sampled_clients"),
    (fake_run("fedadamw", 1, 0.5, [[1, 2]]), "trained 2 and 1 rounds"),
    (fake_run("fedadamw", 1, 0.5, [[1, 2], [2, 3]], local_steps="5"), "local_steps=10 vs 5"),
])
def test_runs_that_trained_other_clients_are_refused_as_pairs(other, why):
    """The same seed is not enough: a pair must have trained the same clients in every round."""
    fedact = fake_run("fedact", 1, 0.6, [[1, 2], [2, 3]])
    with pytest.raises(ReportError, match="not a pair") as err:
        paired.paired_comparison([fedact], [other], "test_accuracy", "final", lambda _: None)
    assert why in str(err.value) and "earlier 'FedACT loses' readings" in str(err.value)
