"""How a round's accepted replies are combined, entry by entry: the weighted mean and two robust
rules, coordinate-wise. Plain tensors in, plain tensors out (no Flower types, no methods).

Every server rule (fedact_app.algorithms) combines its per-client arrays through one
:class:`Aggregation`: the model deltas Delta_i, the second moments v_i, the corrections
Delta_i / sum_k eta_{i,k} that make Delta_G, SCAFFOLD's control updates. For each coordinate j
over the S replies of a round:

    mean          sum_i w_i t_ij                      w_i = 1/S (``weighting: uniform``) or by examples
    trimmed_mean  the mean of the values left after dropping the k = ceil(trim_fraction * S)
                  smallest and the k largest of t_1j..t_Sj (S > 2k is needed)
    median        the middle value of t_1j..t_Sj; for an even S the mean of the two middle ones

The robust rules are unweighted, as Flower's ``FedTrimmedAvg`` and ``FedMedian`` are: a weight
by a client's own count of examples would let that count (which the client reports) move the
order statistic, and the rules exist to keep any one client from steering the aggregate. A config
combines them with ``weighting: uniform`` only (fedact_app.config). Unlike ``FedTrimmedAvg``,
which drops floor(beta * S) values at each end, the trim rounds up: at 5 replies and
trim_fraction 0.1 it drops one at each end instead of none (the plain mean).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fedact_app.packing import as_vector, consecutive, views
from fedact_app.registry import AGGREGATIONS, TRIM_FRACTION, WEIGHTINGS, trim_count

TensorDict = dict[str, Tensor]


def client_weights(num_examples: Sequence[int], weighting: str) -> list[float]:
    """Aggregation weights summing to 1: ``uniform`` (1/S) or proportional to ``num_examples``."""
    if weighting == "uniform":
        return [1.0 / len(num_examples)] * len(num_examples)
    if weighting == "examples":
        total = sum(num_examples)
        return [n / total for n in num_examples]
    raise ValueError(f"Invalid weighting {weighting!r}: allowed {', '.join(WEIGHTINGS)}")


def weighted_mean(tensors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """sum_i w_i t_i, accumulated in the tensors' (floating) dtype."""
    total = torch.zeros_like(tensors[0])
    for tensor, weight in zip(tensors, weights):
        total.add_(tensor, alpha=weight)
    return total


SORTING_NETWORK_MAX = 32  # up to this many replies, sort by compare-exchange; above, torch.sort


def sorted_values(tensors: Sequence[Tensor]) -> list[Tensor]:
    """The tensors' values sorted coordinate-wise: element i holds each coordinate's i-th
    smallest value. Up to ``SORTING_NETWORK_MAX`` tensors by odd-even transposition (S rounds of
    elementwise minimum/maximum over neighbours, S(S-1)/2 compare-exchanges: at 10 replies of
    ViT-Tiny's shapes about 17 times faster than ``torch.sort`` along the client dimension on a
    2-vCPU VM), else ``torch.sort``; both only move values, so they agree exactly."""
    size = len(tensors)
    if size > SORTING_NETWORK_MAX:
        return list(torch.stack(tensors).sort(dim=0).values)
    values = list(tensors)
    for parity in range(size):
        for i in range(parity % 2, size - 1, 2):
            values[i], values[i + 1] = torch.minimum(values[i], values[i + 1]), torch.maximum(values[i], values[i + 1])
    return values


def trimmed_mean(tensors: Sequence[Tensor], trim_fraction: float) -> Tensor:
    """Coordinate-wise mean of the values left after dropping the k = ``trim_count(S,
    trim_fraction)`` smallest and the k largest of each coordinate (equal values are
    interchangeable: which of them is dropped does not matter). ValueError when S <= 2k."""
    size = len(tensors)
    k = trim_count(size, trim_fraction)
    if size <= 2 * k:
        raise ValueError(f"trimmed_mean with trim_fraction={trim_fraction:g} drops ceil({trim_fraction:g} x "
                         f"{size}) = {k} of {size} replies at each end of every coordinate and needs more than "
                         f"{2 * k}")
    return torch.stack(sorted_values(tensors)[k:size - k]).mean(dim=0)


def coordinate_median(tensors: Sequence[Tensor]) -> Tensor:
    """Coordinate-wise median; for an even count the mean of the two middle values (numpy's
    ``median``, Flower's ``FedMedian``), so that it does not lean to either side."""
    size = len(tensors)
    ordered = sorted_values(tensors)
    if size % 2:
        return ordered[size // 2]
    return (ordered[size // 2 - 1] + ordered[size // 2]) / 2


@dataclass(frozen=True)
class Aggregation:
    """A round's combination rule (module docstring): ``rule`` one of ``AGGREGATIONS``;
    ``trim_fraction`` in (0, 0.5), read by ``trimmed_mean`` only."""

    rule: str = "mean"
    trim_fraction: float = TRIM_FRACTION

    def __post_init__(self) -> None:
        if self.rule not in AGGREGATIONS:
            raise ValueError(f"Invalid aggregation {self.rule!r}: allowed {', '.join(AGGREGATIONS)}")
        if not 0 < self.trim_fraction < 0.5:
            raise ValueError(f"Invalid trim_fraction {self.trim_fraction!r}: allowed in (0, 0.5)")

    def combine(self, tensors: Sequence[Tensor], weights: Sequence[float],
                divisors: Sequence[float] | None = None) -> Tensor:
        """One array's aggregate over the clients, of t_i / d_i (``divisors``, one per client;
        none: t_i): the mean sum_i (w_i / d_i) t_i, or the robust rule over the t_i / d_i. The
        robust rules are unweighted: ``weights`` must then be equal (ValueError otherwise)."""
        if self.rule == "mean":
            if divisors is not None:
                weights = [w / d for w, d in zip(weights, divisors)]
            return weighted_mean(tensors, weights)
        if len(set(weights)) > 1:
            raise ValueError(f"aggregation={self.rule} is unweighted; got unequal client weights "
                             f"(weighting=examples?): allowed weighting=uniform")
        if divisors is not None:
            tensors = [t / d for t, d in zip(tensors, divisors)]
        if self.rule == "median":
            return coordinate_median(tensors)
        return trimmed_mean(tensors, self.trim_fraction)

    def combine_dicts(self, arrays: Sequence[TensorDict], weights: Sequence[float],
                      divisors: Sequence[float] | None = None,
                      names: Sequence[str] | None = None) -> TensorDict:
        """:meth:`combine` per entry of ``names`` (default: every entry of ``arrays[0]``). An
        integer entry (``num_batches_tracked``) is combined in float64 and rounded back (half to
        even), so it stays an integer. The leading entries that lie one after the other in one
        vector in every client's dict (a decoded reply's, fedact_app.packing) are combined as
        that vector, in one operation per client instead of one per entry and client; each
        coordinate is computed by the same operations in the same order, so the values are those
        of the entry-by-entry combination, and the results are views into the combined vector, which
        shares no memory with the inputs (those of a decoded reply are reused, fedact_app.packing)."""
        names = list(arrays[0]) if names is None else list(names)
        lead = min(consecutive(a, names) for a in arrays)
        if lead and not arrays[0][names[0]].is_floating_point():
            lead = 0
        out = {}
        if lead:
            vectors = [as_vector(a, names[:lead]) for a in arrays]
            combined = self.combine(vectors, weights, divisors)
            if any(combined.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() for v in vectors):
                combined = combined.clone()  # the median of one reply is that reply: a vector of its own
            out = views(combined, names[:lead], [arrays[0][name].shape for name in names[:lead]])
        for name in names[lead:]:
            tensors = [a[name] for a in arrays]
            if tensors[0].is_floating_point():
                out[name] = self.combine(tensors, weights, divisors)
                if any(out[name] is t for t in tensors):
                    out[name] = out[name].clone()
            else:
                combined = self.combine([t.double() for t in tensors], weights, divisors)
                out[name] = torch.round(combined).to(tensors[0].dtype)
        return out
