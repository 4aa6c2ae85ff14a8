"""Exact top-k of a flat score tensor, without sorting it.

:func:`top_k_indicator_` turns a 1-D score tensor into the indicator of its ``k`` largest entries,
ties to the lowest index: what ``torch.sort(s, descending=True, stable=True).indices[:k]`` picks.
:class:`FedACTAdamW` uses it through :class:`TopKSelector`, which keeps the scratch and the
sample of one selection from step to step.

Two engines find the threshold T (the k-th largest score):

- on the host (CPU tensors, numpy present), :meth:`TopKSelector.threshold_on_host`: a fixed random
  sample brackets T, one pass counts the scores above the bracket and extracts those inside it,
  and ``np.partition`` of the extracted ones gives T; the count makes it exact (a missed bracket
  falls back to a selection over all scores). The passes run on torch's threads
  (:func:`host_map`);
- elsewhere, :func:`_indicator_on_device`: ``torch.topk`` of the smaller side and a tie-break by a
  running count, all tensor operations, so nothing waits for the device.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with every install of this app
    np = None

__all__ = ["top_k_indicator_", "TopKSelector", "host_map"]

_BRACKET_MIN = 1 << 21  # below this many scores one np.partition is as fast as the bracket
# bracket half-width, in standard deviations of the sample rank: the bracket misses T in about
# 1 % of the steps (a full selection then runs), against a narrower band to extract every step
_BRACKET_Z = 2.5
_HOST_CHUNK = 1 << 19  # scores per task: the passes over one chunk stay in cache
_TIE_CHUNK = 1 << 20  # scan length when looking for where a straddling tie is cut


def top_k_indicator_(scores: Tensor, k: int) -> Tensor:
    """In place: ``scores`` <- 1 on its ``k`` largest entries and 0 elsewhere; returns ``scores``.

    Exactly ``k`` ones, also with ties: they go to the lowest index, as in
    ``torch.sort(scores, descending=True, stable=True).indices[:k]``. ``scores`` is a contiguous
    1-D floating tensor of finite values (``torch.topk`` ranks NaN highest). CPU tensors use the
    host engine when numpy is there, others the device engine (module docstring).
    """
    if not isinstance(scores, Tensor) or scores.dim() != 1 or not scores.is_floating_point():
        raise ValueError(f"Invalid scores: expected a 1-D floating tensor, got "
                         f"{getattr(scores, 'shape', type(scores).__name__)}")
    if not scores.is_contiguous():
        raise ValueError("Invalid scores: expected a contiguous tensor (the selection works in place)")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= scores.numel():
        raise ValueError(f"Invalid k: {k!r}; expected an integer in [0, {scores.numel()}]")
    selector = TopKSelector(scores)
    selector.indicator_(k, selector.threshold_on_host(k, parallel=True) if selector.needs_host(k) else None)
    return scores


def _select_on_host(device: torch.device) -> bool:
    """Whether the threshold of scores on ``device`` is found by numpy (CPU) or on the device."""
    return device.type == "cpu" and np is not None


class TopKSelector:
    """One selection over the 1-D ``scores``, reused step after step: its scratch (``mask`` and
    ``scratch``, both of the scores' length: bool and bool on the host, bool and int32 on the
    device), the ``torch.topk`` output buffers of the device engine, and, for a large selection
    on the host, the fixed random positions whose scores bracket the threshold."""

    def __init__(self, scores: Tensor, mask: Optional[Tensor] = None, scratch: Optional[Tensor] = None) -> None:
        on_host = _select_on_host(scores.device) if scratch is None else scratch.dtype == torch.bool
        d, device = scores.numel(), scores.device
        self.scores = scores
        self.mask = torch.empty(d, dtype=torch.bool, device=device) if mask is None else mask
        self.scratch = (torch.empty(d, dtype=torch.bool if on_host else torch.int32, device=device)
                        if scratch is None else scratch)
        self.on_host = on_host
        self.draws = 0  # samples drawn so far; a bracket that misses draws a new one
        self.sample = self.draw_sample()
        self._top_k: Optional[tuple[Tensor, Tensor]] = None

    def needs_host(self, k: int) -> bool:
        """Whether :meth:`indicator_` needs :meth:`threshold_on_host` first."""
        return self.on_host and 0 < k < self.scores.numel()

    def top_k_buffers(self, n: int) -> tuple[Tensor, Tensor]:
        """Values and indices buffers of ``n`` entries for ``torch.topk`` on the device path,
        allocated at the first step (n depends only on d and k)."""
        if self._top_k is None or self._top_k[0].numel() != n:
            self._top_k = (torch.empty(n, dtype=self.scores.dtype, device=self.scores.device),
                           torch.empty(n, dtype=torch.int64, device=self.scores.device))
        return self._top_k

    def draw_sample(self) -> Optional["np.ndarray"]:
        """Sorted random positions (a cache-friendly gather), reproducible per size and draw."""
        d = self.scores.numel()
        if not self.on_host or d < _BRACKET_MIN:
            return None
        n = min(d // 16, math.ceil(2.0 * d ** (2.0 / 3.0)))  # balances sampling and extraction costs
        rng = np.random.default_rng([d, self.draws])
        self.draws += 1
        return np.sort(rng.integers(0, d, n))

    def indicator_(self, k: int, host_threshold: Optional[tuple[float, int]]) -> None:
        """``scores`` <- 1 on its ``k`` largest entries, ties to the lowest index, 0 elsewhere.

        ``host_threshold``: ``(T, cut)`` from :meth:`threshold_on_host` (needed when
        :meth:`needs_host`): the entries ``>= T`` before ``cut`` and ``> T`` from ``cut`` on are
        exactly the top k.
        """
        s = self.scores
        d = s.numel()
        if k == 0 or k == d:
            s.fill_(1.0 if k else 0.0)
        elif host_threshold is None:
            _indicator_on_device(self, k)
        else:
            threshold, cut = host_threshold
            head, tail = s[:cut], s[cut:]
            torch.ge(head, threshold, out=head)
            if cut < d:
                torch.gt(tail, threshold, out=tail)

    def threshold_on_host(self, k: int, parallel: bool) -> tuple[float, int]:
        """The ``k``-th largest score ``T`` (0 < k < d), exactly, and the index ``cut`` such that
        ``{s > T} ∪ {s == T before cut}`` has exactly ``k`` entries (``cut = d`` when no tie
        straddles the boundary).

        A large selection's sample brackets T between two of its order statistics ``lo <= hi``
        (:func:`_bracket`); one pass counts the scores above ``hi`` and extracts those in
        ``[lo, hi]`` (about ``2.5 d / sqrt(n)`` of them for n samples at k = d/2), in chunks that
        stay in cache, on threads when ``parallel``; a selection on the extracted scores gives T.
        When the bracket misses (checked exactly) the selection runs on all scores and a new
        sample is drawn: the result is exact either way.
        """
        a = self.scores.numpy()
        d = a.size
        band, n_above = a, 0
        if self.sample is not None:
            lo, hi = _bracket(a[self.sample], (d - k) / d)
            above, inside = self.mask.numpy(), self.scratch.numpy()
            step = _HOST_CHUNK

            def work(i: int) -> tuple[int, np.ndarray]:
                return _count_and_extract(a[i:i + step], lo, hi, above[i:i + step], inside[i:i + step])

            chunks = range(0, d, step)
            sizes = [min(step, d - i) for i in chunks]
            parts = host_map(work, chunks, sizes) if parallel else [work(i) for i in chunks]
            n_above = sum(n for n, _ in parts)
            candidates = np.concatenate([c for _, c in parts])
            if 0 < k - n_above <= candidates.size:
                band = candidates
            else:  # the bracket missed T (rare): select on everything, and draw a new sample
                n_above = 0
                self.sample = self.draw_sample()
        j = band.size - (k - n_above)  # T is band's entry j in ascending order
        part = np.partition(band, j)
        threshold = part[j]
        if j == 0 or part[:j].max() != threshold:  # no score below the top k equals T
            return float(threshold), d
        # A tie straddles the boundary: the top k hold every score above T and the first `need`
        # scores equal to T, need being how many of them fall in the band's top part.
        need = int(np.count_nonzero(part[j:] == threshold))
        return float(threshold), _index_after(a, threshold, need)


def host_thresholds(selections: Sequence[tuple[TopKSelector, int]]) -> list[tuple[float, int]]:
    """:meth:`TopKSelector.threshold_on_host` of several selections: one alone splits its work
    over threads, several are spread over threads."""
    if len(selections) == 1:
        return [selections[0][0].threshold_on_host(selections[0][1], parallel=True)]
    return host_map(lambda item: item[0].threshold_on_host(item[1], parallel=False), selections,
                    [selector.scores.numel() for selector, _ in selections])


def _count_and_extract(a: "np.ndarray", lo: float, hi: float, above: "np.ndarray",
                       inside: "np.ndarray") -> tuple[int, "np.ndarray"]:
    """How many entries of ``a`` exceed ``hi``, and those in ``[lo, hi]`` (bool scratch given)."""
    np.greater(a, hi, out=above)
    np.greater_equal(a, lo, out=inside)
    np.not_equal(inside, above, out=inside)  # lo <= a <= hi
    return int(np.count_nonzero(above)), np.compress(inside, a)  # 2x faster than a[inside] here


def _bracket(sample: "np.ndarray", q: float) -> tuple[float, float]:
    """Entries ``lo <= hi`` of the sample around its ``q``-quantile, ``_BRACKET_Z`` standard
    deviations of the sample rank apart (``-inf`` / ``inf`` past its ends)."""
    n = sample.size
    half = _BRACKET_Z * math.sqrt(q * (1.0 - q) * n) + 1.0
    j_lo, j_hi = math.floor(q * n - half), math.ceil(q * n + half)
    inner = [j for j in (j_lo, j_hi) if 0 <= j < n]
    part = np.partition(sample, inner) if inner else sample
    lo = part[j_lo] if j_lo >= 0 else -np.inf
    hi = part[j_hi] if j_hi < n else np.inf
    return lo, hi


def _index_after(a: "np.ndarray", value: float, n: int) -> int:
    """The index just after the ``n``-th entry of ``a`` equal to ``value`` (n >= 1, flat order)."""
    for start in range(0, a.size, _TIE_CHUNK):
        equal = a[start:start + _TIE_CHUNK] == value
        count = int(np.count_nonzero(equal))
        if count >= n:
            return start + int(np.flatnonzero(equal)[n - 1]) + 1
        n -= count
    raise AssertionError("fewer entries equal the threshold than counted")  # pragma: no cover


_POOL: dict[tuple[int, int], ThreadPoolExecutor] = {}


def host_map(fn: Callable, items: Sequence, sizes: Sequence[int]) -> list:
    """``[fn(x) for x in items]`` on up to ``torch.get_num_threads()`` threads: the host selection
    is numpy work that releases the GIL, so it can use the cores torch would use.

    The items are cut into one run of consecutive items per thread, of about equal total
    ``sizes``; the calling thread works through the first run itself. One task per thread, not
    one per item: many small per-tensor selections handed to a pool one by one cost more than
    the second core gave (docs/PERFORMANCE.md)."""
    if len(sizes) != len(items):
        raise ValueError(f"host_map: {len(sizes)} sizes for {len(items)} items")
    workers = min(torch.get_num_threads(), len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    key = (os.getpid(), workers - 1)  # a forked child builds its own pool
    if key not in _POOL:
        _POOL.clear()
        _POOL[key] = ThreadPoolExecutor(workers - 1, thread_name_prefix="fedact-select")
    runs = _balanced_runs(sizes, workers)
    pending = [_POOL[key].submit(lambda run=run: [fn(items[i]) for i in run]) for run in runs[1:]]
    try:
        results = [fn(items[i]) for i in runs[0]]
    finally:  # also when this thread's run raised: no task may go on writing the step's scratch
        wait(pending)
    for future in pending:
        results.extend(future.result())
    return results


def _balanced_runs(sizes: Sequence[int], n: int) -> list[range]:
    """``n`` runs of consecutive indices into ``sizes`` (some may be empty), the j-th ending at
    the first index where the running total reaches ``j / n`` of the whole."""
    total, bounds, running, j = sum(sizes), [0], 0, 1
    for i, size in enumerate(sizes):
        running += size
        while j < n and running * n >= total * j:
            bounds.append(i + 1)
            j += 1
    bounds += [len(sizes)] * (n + 1 - len(bounds))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _indicator_on_device(selector: TopKSelector, k: int) -> None:
    """The device engine of :meth:`TopKSelector.indicator_` (also without numpy), all tensor
    operations, so nothing waits for the device. The threshold T, the k-th largest score, is the
    smallest of the k largest scores or the largest of the d - k + 1 smallest (``torch.topk`` of
    the smaller side, into the selector's buffers); the tie-break is a running count of the
    entries equal to T, in the selector's ``mask`` (bool) and ``scratch`` (integer).

    ``torch.topk``, not ``torch.kthvalue``: PyTorch's CUDA kthvalue runs one thread block per
    slice (``gatherKthValue`` in ATen's Sorting.cu), so one multiprocessor would read all d
    scores many times over (pytorch/pytorch#75599: 20x slower than a full sort for 10^8
    values), where topk's radix select spreads one large slice over many blocks (``mbtopk`` in
    TensorTopK.cu)."""
    s, mask, ranks = selector.scores, selector.mask, selector.scratch
    d = s.numel()
    largest = k <= d - k + 1
    values, indices = selector.top_k_buffers(k if largest else d - k + 1)
    torch.topk(s, values.numel(), largest=largest, sorted=False, out=(values, indices))
    threshold = values.min() if largest else values.max()    # k-th largest, stays on the device
    # (scores must be finite: topk ranks NaN highest, and a NaN T selects nothing)
    torch.gt(s, threshold, out=ranks)
    need = k - ranks.sum()                                    # places left for entries equal to T
    torch.eq(s, threshold, out=mask)
    torch.cumsum(mask, 0, dtype=ranks.dtype, out=ranks)       # ties at or before each index
    mask.logical_and_(ranks.le_(need))                        # the first `need` ties
    torch.gt(s, threshold, out=s).add_(mask)
