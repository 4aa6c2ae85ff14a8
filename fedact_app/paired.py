"""Paired comparisons of methods over seeds (scripts/study.py): per-seed differences with their
sign count, Wilcoxon signed-rank and paired t-test, over runs paired by seed that trained the same
clients in every round (``metrics.jsonl``'s ``sampled_clients``). A difference between runs that
trained other clients measures the sampling, not the method, so such pairs are refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from fedact_app.report import (TRAINING_KEYS, ReportError, Run, Setting, Warn, in_percent, mean_std,
                               print_warning)


@dataclass(frozen=True)
class PairedStats:
    """Statistics of per-seed differences d_i = reference - baseline (one pair per seed)."""

    n: int
    mean: float
    std: Optional[float]  # sample std (ddof=1); None for one pair
    wins: int  # d_i > 0: the reference is ahead at that seed
    losses: int  # d_i < 0
    ties: int  # d_i == 0
    wilcoxon_p: Optional[float]  # two-sided Wilcoxon signed-rank; None when undefined (n < 2, every d_i 0)
    ttest_p: Optional[float]  # two-sided paired t-test; None when undefined (n < 2, no spread)


def paired_stats(differences: Sequence[float]) -> PairedStats:
    """Mean ± sample std, sign count and two-sided p-values of paired differences.

    Wilcoxon: ``scipy.stats.wilcoxon(d)`` (zeros dropped, as Wilcoxon's original test does; exact
    null distribution for small samples without ties, else the normal approximation). Paired
    t-test: ``scipy.stats.ttest_1samp(d, 0)``, which is ``ttest_rel(reference, baseline)``.
    """
    from scipy import stats  # only the study needs scipy (plot.py and table.py do not)

    d = [float(x) for x in differences]
    if not d:
        raise ReportError("no paired differences")
    mean, std = mean_std(d)
    wilcoxon_p = ttest_p = None
    if len(d) >= 2 and any(x != 0 for x in d):
        wilcoxon_p = float(stats.wilcoxon(d).pvalue)
    if len(d) >= 2 and std:
        ttest_p = float(stats.ttest_1samp(d, 0.0).pvalue)
    return PairedStats(n=len(d), mean=mean, std=std, wins=sum(x > 0 for x in d),
                       losses=sum(x < 0 for x in d), ties=sum(x == 0 for x in d),
                       wilcoxon_p=wilcoxon_p, ttest_p=ttest_p)


def client_sequence(run: Run) -> Optional[tuple[tuple, ...]]:
    """The run's ``sampled_clients`` of every training round, in round order; None when a round
    lacks it (a run from before it was logged)."""
    rows = [row for row in run.rows if row["round"] >= 1]
    if any(not isinstance(row.get("sampled_clients"), list) for row in rows):
        return None
    return tuple((row["round"], tuple(row["sampled_clients"])) for row in rows)


def training_settings(run: Run) -> dict[str, str]:
    """The run's ``TRAINING_KEYS`` values (as compared for pairing)."""
    return {key: value for key, value in run.hyperparameters if key in TRAINING_KEYS}


def pair_runs(reference: Sequence[Run], baseline: Sequence[Run],
              warn: Warn = print_warning) -> list[tuple[Run, Run]]:
    """(reference run, baseline run) per seed both have, by seed; ReportError when a pair differs in
    its setting, training settings or in the clients it trained in some round.

    Paired differences mean something only when both runs saw the same data in the same rounds:
    unpaired runs were the source of the earlier "FedACT loses" readings (docs/ROBUSTNESS.md: at one
    seed every method now trains the same clients, and metrics.jsonl lists them). Seeds only one
    side has are left out with a warning."""
    by_seed = {run.seed: run for run in baseline}
    pairs = []
    for run in reference:
        other = by_seed.pop(run.seed, None)
        if other is None:
            warn(f"{run.method} has seed {run.seed} and {baseline[0].method if baseline else 'the baseline'} "
                 "has not: left out of the paired comparison")
            continue
        why = _unpaired_reason(run, other)
        if why:
            raise ReportError(f"{run.path} and {other.path} (seed {run.seed}) are not a pair: {why}. Paired "
                              "differences of runs that trained other clients measure the sampling, not the "
                              "method (unpaired runs were the source of the earlier 'FedACT loses' readings); "
                              "rerun both with the current app (docs/ROBUSTNESS.md)")
        pairs.append((run, other))
    for seed in sorted(by_seed):
        warn(f"{by_seed[seed].method} has seed {seed} and "
             f"{reference[0].method if reference else 'the reference'} has not: left out of the paired comparison")
    return pairs


def _unpaired_reason(a: Run, b: Run) -> str:
    """Why runs ``a`` and ``b`` of one seed are not a pair ('' when they are)."""
    if a.setting != b.setting:
        return f"they train different settings ({a.setting.title} / {b.setting.title})"
    if (ta := training_settings(a)) != (tb := training_settings(b)):
        keys = sorted(k for k in ta.keys() | tb.keys() if ta.get(k) != tb.get(k))
        return "different training settings: " + ", ".join(f"{k}={ta.get(k)} vs {tb.get(k)}" for k in keys)
    sa, sb = client_sequence(a), client_sequence(b)
    if sa is None or sb is None:
        return (f"{(a if sa is None else b).path} has no sampled_clients in some round, so it cannot be "
                "shown to have trained the clients the other run trained")
    if len(sa) != len(sb):
        return f"they trained {len(sa)} and {len(sb)} rounds"
    for (round_a, clients_a), (round_b, clients_b) in zip(sa, sb):
        if (round_a, clients_a) != (round_b, clients_b):
            return (f"they sampled different clients in round {round_a}: {list(clients_a)} vs "
                    f"{list(clients_b)}" if round_a == round_b else f"their rounds differ ({round_a} vs {round_b})")
    return ""


@dataclass(frozen=True)
class PairedComparison:
    """Reference vs baseline in one setting: per-seed values (accuracies in %) and their statistics."""

    setting: Setting
    reference: str
    baseline: str
    seeds: tuple[int, ...]
    reference_values: tuple[float, ...]
    baseline_values: tuple[float, ...]
    stats: PairedStats

    @property
    def differences(self) -> tuple[float, ...]:
        return tuple(r - b for r, b in zip(self.reference_values, self.baseline_values))


def paired_comparison(reference: Sequence[Run], baseline: Sequence[Run], column: str, kind: str,
                      warn: Warn = print_warning) -> PairedComparison:
    """The paired comparison of the ``final``/``best`` value of ``column`` (accuracies in %) of
    two methods' runs of one setting (:func:`pair_runs`, which refuses unpaired runs); ReportError
    when no pair has the value."""
    scale = 100.0 if in_percent(column) else 1.0
    rows = []
    for ref, base in pair_runs(reference, baseline, warn):
        a, b = ref.value(column, kind), base.value(column, kind)
        if a is None or b is None or math.isnan(a) or math.isnan(b):
            warn(f"seed {ref.seed}: no {column} in {ref.path if a is None else base.path}: left out")
            continue
        rows.append((ref.seed, scale * a, scale * b))
    if not rows:
        raise ReportError(f"no seed has {column} in both {reference[0].method if reference else '?'} and "
                          f"{baseline[0].method if baseline else '?'}")
    seeds, ref_values, base_values = zip(*rows)
    return PairedComparison(setting=reference[0].setting, reference=reference[0].method,
                            baseline=baseline[0].method, seeds=seeds, reference_values=ref_values,
                            baseline_values=base_values,
                            stats=paired_stats([a - b for a, b in zip(ref_values, base_values)]))
