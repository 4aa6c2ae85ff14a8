"""Exact top-k of a flat score tensor cut into segments, without sorting it.

A selection (:class:`TopKSelector`) covers one flat 1-D score tensor cut into consecutive
segments: one segment for the seed's global scope (``s in R^d``), one per parameter tensor for
``trust_scope="tensor"``. Segment j gets 1 on its ``k_j`` largest entries and 0 elsewhere, ties
to the lowest index: what ``torch.sort(s_j, descending=True, stable=True).indices[:k_j]`` picks.
:func:`top_k_indicator_` is one selection of one segment.

Two engines, each exact and each with a fixed number of PyTorch operations whatever the number
of segments:

- on the host (CPU tensors, numpy present): per segment, a fixed random sample brackets the
  threshold T (the k-th largest score), one pass counts the scores above the bracket and extracts
  those inside it, and ``np.partition`` of the extracted ones gives T; numpy writes the indicator
  of several segments in place, torch's comparisons that of one (:meth:`TopKSelector.indicator_`).
  The work runs on torch's threads (:func:`host_map`); the scratch is one chunk per thread;
- elsewhere (CUDA; CPU without numpy), :class:`_RadixSelect`: a radix select over the
  bit patterns of the scores, one byte a pass, with one histogram per segment, then the tie-break
  by a running count: about 140 tensor operations for any number of segments, one integer scratch
  of d entries, nothing that waits for the device and no d-sized temporary;
- there, for float32 scores with ``compiled=True`` (``FedACTAdamW(compile=True)``),
  :class:`_CountSelect`: the threshold and the tie's position found three bits a pass by
  counting, in passes that ``torch.compile`` fuses, one read of the scores a pass, no atomic
  addition and no scratch.

The two device engines run the same way (:class:`_DeviceEngine`): launched at the first
selection, then, on CUDA with ``cuda_graph``, captured as one CUDA graph and replayed.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import types
import warnings
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
# 1 % of the steps (a retry twice as wide then runs), against a narrower band to extract every step
_BRACKET_Z = 2.5
_HOST_CHUNK = 1 << 19  # scores per task: the passes over one chunk stay in cache
_LANE_COUNTERS = 1 << 18  # the radix select's counters with lanes, at most (1 MiB of int32 for float32 scores)
_TIE_CHUNK = 1 << 16  # scan length when looking for where a straddling tie is cut (its index list: 8x)


def top_k_indicator_(scores: Tensor, k: int) -> Tensor:
    """In place: ``scores`` <- 1 on its ``k`` largest entries and 0 elsewhere; returns ``scores``.

    Exactly ``k`` ones, also with ties: they go to the lowest index, as in
    ``torch.sort(scores, descending=True, stable=True).indices[:k]``. ``scores`` is a contiguous
    1-D floating tensor (float32 or float64) of finite values. CPU tensors use the host engine
    when numpy is there, others the device engine (module docstring).
    """
    if not isinstance(scores, Tensor) or scores.dim() != 1 or scores.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"Invalid scores: expected a 1-D floating tensor (float32 or float64), got "
                         f"{getattr(scores, 'shape', type(scores).__name__)} {getattr(scores, 'dtype', '')}".rstrip())
    if not scores.is_contiguous():
        raise ValueError("Invalid scores: expected a contiguous tensor (the selection works in place)")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= scores.numel():
        raise ValueError(f"Invalid k: {k!r}; expected an integer in [0, {scores.numel()}]")
    TopKSelector(scores, [0, scores.numel()]).indicator_([k])
    return scores


def _select_on_host(device: torch.device) -> bool:
    """Whether the scores on ``device`` are selected by numpy (CPU) or by tensor operations."""
    return device.type == "cpu" and np is not None


def counts_compiled(device: torch.device, dtype: torch.dtype, numel: int, compiled: bool) -> bool:
    """Whether a selection of ``numel`` scores of ``dtype`` on ``device`` runs the compiled
    counting engine (:class:`_CountSelect`, asked for with ``compiled``; float32 scores off the
    host, fewer than 2^31 of them, torch.compile not failed in this process), which needs no
    integer scratch."""
    return (compiled and dtype == torch.float32 and numel < 1 << 31 and not _select_on_host(device)
            and not compile_disabled())


# torch.compile's failures for compile=True in this process: after the first, every compiled
# pass of FedACTAdamW runs its eager operations (kernels.py) and every selection the radix select
_compile_failures: list[BaseException] = []


def compile_failed(exc: BaseException) -> bool:
    """Record that torch.compile failed for ``compile=True``; True at the first failure of the
    process, whose caller warns (once for all of them)."""
    _compile_failures.append(exc)
    return len(_compile_failures) == 1


def compile_disabled() -> bool:
    """Whether torch.compile has failed for ``compile=True`` in this process (:func:`compile_failed`)."""
    return bool(_compile_failures)


class TopKSelector:
    """One selection over the 1-D float32/float64 ``scores`` cut at ``bounds`` (``0 = b_0 <= b_1
    <= ... = d``: segment j is ``scores[b_j:b_{j+1}]``), reused step after step.

    It keeps what the step must not allocate again: on the device, the integer scratch of d
    entries (int32 for float32 scores, int64 for float64) and the small per-segment tensors; on
    the host, the fixed random sample of every segment of at least ``_BRACKET_MIN`` scores (the
    chunk scratch lives per thread, :func:`_chunk_scratch`). ``scratch``: d elements as wide as
    the scores for the device engine's codes (the flat direction buffer, layout.py), or ``None``
    for a buffer of its own. ``cuda_graph``: on a CUDA device, the device engine's kernels are
    captured as one CUDA graph at the second selection and replayed from then on
    (:class:`_RadixSelect`); ignored elsewhere.
    """

    def __init__(self, scores: Tensor, bounds: Sequence[int], scratch: Optional[Tensor] = None,
                 cuda_graph: bool = False, compiled: bool = False) -> None:
        if list(bounds[:1]) != [0] or bounds[-1] != scores.numel() or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"Invalid bounds: expected 0 <= ... <= {scores.numel()}, got {list(bounds)}")
        self.scores = scores
        self.bounds = list(bounds)
        self.on_host = _select_on_host(scores.device)
        if self.on_host:
            self.draws = [0] * (len(self.bounds) - 1)  # samples drawn per segment; a miss draws anew
            self.samples = [self.draw_sample(j) for j in range(len(self.draws))]
        elif counts_compiled(scores.device, scores.dtype, scores.numel(), compiled):
            self.device_engine: _DeviceEngine = _CountSelect(scores, self.bounds, cuda_graph)
        else:
            self.device_engine = _RadixSelect(scores, self.bounds, scratch, cuda_graph)

    def sizes(self) -> list[int]:
        """The number of scores in every segment."""
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def draw_sample(self, j: int) -> Optional["np.ndarray"]:
        """Sorted random positions in segment j (a cache-friendly gather), reproducible per size
        and draw; ``None`` below ``_BRACKET_MIN`` scores."""
        n = self.bounds[j + 1] - self.bounds[j]
        if n < _BRACKET_MIN:
            return None
        size = min(n // 16, math.ceil(2.0 * n ** (2.0 / 3.0)))  # balances sampling and extraction costs
        rng = np.random.default_rng([n, self.draws[j]])
        self.draws[j] += 1
        return np.sort(rng.integers(0, n, size))

    def indicator_(self, ks: Sequence[int], host_threshold: Optional[tuple[float, int]] = None) -> None:
        """``scores`` <- 1 on the ``ks[j]`` largest entries of every segment j, ties to the lowest
        index, 0 elsewhere. ``host_threshold``: ``(T, cut)`` of a one-segment host selection from
        :meth:`threshold_on_host`, when the caller has it already."""
        if len(ks) != len(self.bounds) - 1 or any(not 0 <= k <= n for k, n in zip(ks, self.sizes())):
            raise ValueError(f"Invalid ks: {list(ks)} for segments of {self.sizes()} scores")
        if not self.on_host:
            engine = self.device_engine
            try:
                engine.indicator_(ks)
            except CompileFailed as err:  # at the first selection, before any score was written
                if compile_failed(err.__cause__ or err):
                    # stacklevel: the caller of FedACTAdamW.step(), past this method, _modulate,
                    # fedact_step, _step, step and its two torch wrappers (a test checks it)
                    warnings.warn(f"FedACTAdamW(compile=True): the counting selection could not be compiled "
                                  f"({err}); the radix select runs instead, with an integer scratch of its own",
                                  RuntimeWarning, stacklevel=8)
                self.device_engine = _RadixSelect(self.scores, self.bounds, None, engine.cuda_graph)
                self.device_engine.indicator_(ks)
            return
        if len(ks) == 1:  # one segment: torch's comparisons, on its threads, are 3x numpy's here
            s, k = self.scores, ks[0]
            if k in (0, s.numel()):
                s.fill_(1.0 if k else 0.0)
                return
            threshold, cut = host_threshold or self.threshold_on_host(k)
            torch.ge(s[:cut], threshold, out=s[:cut])
            torch.gt(s[cut:], threshold, out=s[cut:])
            return
        scores = self.scores.numpy()  # once: every conversion is four tensor operations
        host_map(lambda j: self._segment_on_host(scores, j, ks[j]), range(len(ks)), self.sizes())

    def _segment_on_host(self, scores: "np.ndarray", j: int, k: int) -> None:
        """Segment j's indicator, all in numpy (no tensor operation per segment)."""
        a = scores[self.bounds[j]:self.bounds[j + 1]]
        if k in (0, a.size):
            a.fill(1.0 if k else 0.0)
            return
        threshold, cut = self._threshold(a, j, k, parallel=False)
        np.greater_equal(a[:cut], threshold, out=a[:cut])  # the bool result cast to the scores' dtype
        np.greater(a[cut:], threshold, out=a[cut:])

    def threshold_on_host(self, k: int) -> tuple[float, int]:
        """The ``k``-th largest score ``T`` of a one-segment selection (0 < k < d), exactly, and
        the index ``cut`` such that ``{s > T} ∪ {s == T before cut}`` has exactly ``k`` entries
        (``cut = d`` when no tie straddles the boundary): :meth:`_threshold` on threads."""
        return self._threshold(self.scores.numpy(), 0, k, parallel=True)

    def _threshold(self, a: "np.ndarray", j: int, k: int, parallel: bool) -> tuple[float, int]:
        """:meth:`threshold_on_host` of segment j, whose scores are ``a``.

        A large segment's sample brackets T between two of its order statistics ``lo <= hi``
        (:func:`_bracket`); one pass counts the scores above ``hi`` and extracts those in
        ``[lo, hi]`` (about ``2.5 d / sqrt(n)`` of them for n samples at k = d/2; none when
        ``lo == hi``, where T = lo), in chunks that stay in cache, on threads when ``parallel``;
        a selection on the extracted scores gives T. When the bracket misses (checked exactly) a
        bracket twice as wide is tried on a new sample, then a selection on all scores: the
        result is exact either way.
        """
        n = a.size
        band, n_above = a, 0
        for z in (_BRACKET_Z, 2.0 * _BRACKET_Z):
            if self.samples[j] is None:
                break
            lo, hi = _bracket(a[self.samples[j]], (n - k) / n, z)
            chunks = range(0, n, _HOST_CHUNK)

            def work(i: int, lo=lo, hi=hi) -> tuple[int, int, Optional[np.ndarray]]:
                return _count_and_extract(a[i:i + _HOST_CHUNK], lo, hi)

            sizes = [min(_HOST_CHUNK, n - i) for i in chunks]
            parts = host_map(work, chunks, sizes) if parallel else [work(i) for i in chunks]
            above = sum(p[0] for p in parts)
            inside = sum(p[1] for p in parts)
            if 0 < k - above <= inside:
                if lo == hi:  # every score in the bracket equals T: nothing to partition
                    return float(lo), n if k - above == inside else _index_after(a, lo, k - above)
                band, n_above = np.concatenate([p[2] for p in parts]), above
                break
            self.samples[j] = self.draw_sample(j)  # the bracket missed T (rare): a new sample
        j_band = band.size - (k - n_above)  # T is band's entry j_band in ascending order
        part = np.partition(band, j_band)
        threshold = part[j_band]
        if j_band == 0 or part[:j_band].max() != threshold:  # no score below the top k equals T
            return float(threshold), n
        # A tie straddles the boundary: the top k hold every score above T and the first `need`
        # scores equal to T, need being how many of them fall in the band's top part.
        need = int(np.count_nonzero(part[j_band:] == threshold))
        return float(threshold), _index_after(a, threshold, need)


_SCRATCH = threading.local()


def _chunk_scratch(n: int) -> tuple["np.ndarray", "np.ndarray"]:
    """Two bool arrays of ``n`` entries for this thread, made once per thread and size: the
    host selection's scratch is a chunk a thread, not d entries."""
    if getattr(_SCRATCH, "n", None) != n:
        _SCRATCH.n, _SCRATCH.arrays = n, (np.empty(n, dtype=bool), np.empty(n, dtype=bool))
    return _SCRATCH.arrays


def _count_and_extract(a: "np.ndarray", lo: float, hi: float) -> tuple[int, int, Optional["np.ndarray"]]:
    """How many entries of ``a`` exceed ``hi``, how many lie in ``[lo, hi]``, and those entries
    (``None`` when ``lo == hi``: they all equal lo)."""
    above, inside = (x[:a.size] for x in _chunk_scratch(_HOST_CHUNK))
    np.greater(a, hi, out=above)
    np.greater_equal(a, lo, out=inside)
    np.not_equal(inside, above, out=inside)  # lo <= a <= hi
    n_above = int(np.count_nonzero(above))
    if lo == hi:
        return n_above, int(np.count_nonzero(inside)), None
    band = np.compress(inside, a)  # 2x faster than a[inside] here
    return n_above, band.size, band


def _bracket(sample: "np.ndarray", q: float, z: float) -> tuple[float, float]:
    """Entries ``lo <= hi`` of the sample around its ``q``-quantile, ``z`` standard deviations of
    the sample rank apart (``-inf`` / ``inf`` past its ends)."""
    n = sample.size
    half = z * math.sqrt(q * (1.0 - q) * n) + 1.0
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


_POOL: dict[tuple[int, int], ThreadPoolExecutor] = {}  # by thread count and chunk size


def host_map(fn: Callable, items: Sequence, sizes: Sequence[int]) -> list:
    """``[fn(x) for x in items]`` on up to ``torch.get_num_threads()`` threads: the host selection
    (and the server's decoding of replies, fedact_app.replies) is work that releases the GIL, so
    it can use the cores torch would use.

    The items are cut into one run of consecutive items per thread, of about equal total
    ``sizes``; the calling thread works through the first run itself. One task per thread, not
    one per item: many small per-tensor selections handed to a pool one by one cost more than
    the second core gave (docs/PERFORMANCE.md)."""
    if len(sizes) != len(items):
        raise ValueError(f"host_map: {len(sizes)} sizes for {len(items)} items")
    threads = torch.get_num_threads()
    workers = min(threads, len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    pool = _pool(threads - 1, _HOST_CHUNK)
    runs = _balanced_runs(sizes, workers)
    pending = [pool.submit(lambda run=run: [fn(items[i]) for i in run]) for run in runs[1:]]
    try:
        results = [fn(items[i]) for i in runs[0]]
    finally:  # also when this thread's run raised: no task may go on writing the step's scratch
        wait(pending)
    for future in pending:
        results.extend(future.result())
    return results


_POOL_LOCK = threading.Lock()


def _pool(n: int, chunk: int) -> ThreadPoolExecutor:
    """This process's pool of ``n`` threads (torch's threads but the caller's) holding scratch for
    chunks of ``chunk`` scores, made once per thread count and chunk size and kept: a thread whose
    torch thread count differs gets a pool of its own, none is stopped while another thread may
    be using it, and a pool made while the chunk size was another (a test sets a small one) is
    never handed out, since its threads would make new scratch in some step after the first."""
    with _POOL_LOCK:
        if (n, chunk) not in _POOL:
            _POOL[n, chunk] = _started_pool(n, chunk)
        return _POOL[n, chunk]


def _forget_pools() -> None:
    """In a forked child: its copy of the parent's pools has no threads, and the lock may have
    been taken by a thread that does not exist there."""
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    _POOL.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_pools)


def _started_pool(n: int, chunk: int) -> ThreadPoolExecutor:
    """A pool of ``n`` threads, every one started and holding its scratch for chunks of ``chunk``
    scores (:func:`_chunk_scratch`). A ThreadPoolExecutor starts a thread only when no started
    one is idle, and a thread makes its scratch at its first task: with threads started on
    demand, a step after the first could still start one and allocate its scratch (1 MiB a
    thread)."""
    pool = ThreadPoolExecutor(n, thread_name_prefix="fedact-select", initializer=_chunk_scratch,
                              initargs=(chunk,))
    started = threading.Barrier(n, timeout=60)  # each task holds its thread until all n run
    wait([pool.submit(started.wait) for _ in range(n)])
    return pool


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


class _DeviceEngine:
    """What both device engines share: the ks on the device, and their launch or replay.

    A subclass sets ``scores`` and implements :meth:`_select`, the selection's tensor operations
    for the ks of ``self._ks``, none of which waits for the device.

    ``cuda_graph`` (CUDA only): the operations are the same at every selection (the buffers, the
    segments and the ks are fixed; no branch depends on the scores), so the second selection
    captures them as one CUDA graph (:func:`_captured`) and every later one replays it: one
    launch instead of one per kernel (about 140 for the radix select), each of which costs the
    host a few microseconds, and the same kernels on the same memory, so the same result bit
    for bit. The first selection runs them
    one by one, which also loads each kernel before any capture. New ks mean a new capture.
    Inside a capture of the caller's (the whole step in a graph) the operations go into that
    graph; a capture that fails warns and leaves this selection's operations launched one by one.
    """

    def __init__(self, scores: Tensor, cuda_graph: bool) -> None:
        self.scores = scores
        self._ks: tuple[tuple[int, ...], Optional[Tensor]] = ((), None)
        self.cuda_graph = cuda_graph and scores.device.type == "cuda"
        self._graph: Optional["torch.cuda.CUDAGraph"] = None
        self._loaded = False  # whether the operations have run once (every kernel loaded)

    def indicator_(self, ks: Sequence[int]) -> None:
        if self.scores.numel() == 0:
            return
        if tuple(ks) != self._ks[0]:  # ks change only with the trust settings: one copy then
            self._ks = (tuple(ks), _on_device(list(ks), torch.int64, self.scores.device))
            self._graph = None  # a graph reads the ks of the tensor it was captured with
        if self.cuda_graph and torch.cuda.is_current_stream_capturing():
            self._select()  # the caller captures the step in a graph of its own: these go into it
        elif self._graph is not None:
            self._graph.replay()
        elif self.cuda_graph and self._loaded:
            try:
                self._graph = _captured(self._select, self.scores.device)
            except RuntimeError as err:  # as compile=True does: warn, then the eager operations
                self.cuda_graph = False
                # stacklevel: the caller of FedACTAdamW.step(), past this method, TopKSelector.indicator_,
                # _modulate, fedact_step, _step, step and its two torch wrappers (a test checks it)
                warnings.warn(f"FedACTAdamW(cuda_graph=True): the selection could not be captured as a CUDA "
                              f"graph ({err}); its operations are launched one by one", RuntimeWarning,
                              stacklevel=9)
                self._select()
            else:
                self._graph.replay()
        else:
            self._select()
            self._loaded = True

    def _select(self) -> None:
        raise NotImplementedError


class _RadixSelect(_DeviceEngine):
    """The device engine: the top ``k_j`` of every segment at once, in tensor operations whose
    number does not depend on the number of segments, so nothing waits for the device.

    The scores' bit patterns, made order-preserving (:meth:`_keys`), are read one byte a pass
    from the top. Every score carries a code in the integer ``scratch``: ``3j + 1`` while it is
    still a candidate for segment j's threshold, ``3j + 2`` once it is known to be above it,
    ``3j`` below (in the first pass, where every score is a candidate, just ``j``). A pass turns
    the code into a histogram bin ``256 code + byte``, counts the bins (``index_add_``), finds in
    each segment's candidate histogram the byte of its ``k_j``-th largest remaining score, and
    maps every bin to its new code with one ``searchsorted`` over three boundaries per segment.
    Each bin is counted in ``lanes`` copies, the score's position modulo ``lanes`` picking one,
    the copies lane after lane (:class:`_Bins`; the codes lose their lane again before the
    ``searchsorted``): the top byte (sign and exponent) puts nearly every score of a segment in
    a few bins, and on CUDA the atomic additions into one counter run one after another (11.2 M
    scores into one counter: 8.3 ms on an H100, into 1,024 of them 0.21 ms). The first pass,
    whose bins are a third of a later pass's, takes more lanes within the same budget of
    counters (up to three times, rounded down to a power of two): it is the contended one,
    most of all with many segments, whose lanes are few (ResNet-18's 62 tensors: 16 in the
    first pass, 4 in the others). After the last byte the candidates left are the scores equal
    to the threshold; a running count over them (``cumsum_`` in the scores' memory) keeps the
    first ``need_j`` of each segment, lowest index first (:meth:`_tie_break`).

    Memory: the scratch (4 bytes a float32 score), the scores' own buffer, the counters (at most
    ``max(_LANE_COUNTERS, 768 x segments)`` integers of the keys' width) and tensors of a few
    entries per segment; no operation makes a d-sized temporary on CUDA.
    ``torch.topk`` is not used: its outputs hold ``12 min(k, d-k+1)`` bytes (about 6 d at
    tau = 0.5), its CUDA launches happen once per segment, and the tie-break it needs cost a
    d-sized cast in ``torch.cumsum``.
    ``cuda_graph``: as :class:`_DeviceEngine` says.
    """

    def __init__(self, scores: Tensor, bounds: list[int], scratch: Optional[Tensor], cuda_graph: bool) -> None:
        if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
            raise RuntimeError("the device top-k reads the scores' bytes as little-endian")
        super().__init__(scores, cuda_graph)
        device, n_seg = scores.device, len(bounds) - 1
        self.n_seg = n_seg
        self.key_dtype = torch.int32 if scores.dtype == torch.float32 else torch.int64
        self.bytes = scores.element_size()
        self.keys = scores.view(self.key_dtype)
        self.scratch = (torch.empty(scores.numel(), dtype=self.key_dtype, device=device) if scratch is None
                        else scratch.view(self.key_dtype))
        # the first pass has candidates only (code j, one block of bins a segment), the later
        # ones three blocks (codes 3j, 3j + 1, 3j + 2): within one budget of counters, more lanes
        self.first, self.later = (_Bins(self.scratch, n_seg, blocks) for blocks in (1, 3))
        self.counts = torch.empty(max(self.first.counters, self.later.counters), dtype=self.key_dtype, device=device)
        self.one = torch.ones((), dtype=self.key_dtype, device=device).expand(scores.numel())
        # Codes j for every score: 0 at the first, +1 where each later segment starts.
        starts = [b for b in bounds[1:-1] if b < scores.numel()]
        self.code_at = _on_device(starts, torch.int64, device)
        self.code_step = torch.ones((), dtype=self.key_dtype, device=device).expand(len(starts))

    def _select(self) -> None:
        """The selection's operations (class docstring), for the ks of ``self._ks``."""
        need = ties = self._ks[1]
        self._keys()
        codes = self.scratch
        codes.zero_()
        codes.index_add_(0, self.code_at, self.code_step)
        codes.cumsum_(0)
        for byte in reversed(range(self.bytes)):
            bins = self.first if byte == self.bytes - 1 else self.later
            codes.mul_(256)  # then the byte into the code's lowest byte: a copy between byte views
            codes.view(torch.uint8)[::self.bytes].copy_(self.keys.view(torch.uint8)[byte::self.bytes])
            bins.spread_()
            counts = self.counts[:bins.counters]
            counts.zero_()
            counts.index_add_(0, codes, self.one)
            bins.gather_()
            need, ties, boundaries = self._pass(counts, need, bins)
            torch.searchsorted(boundaries, codes, right=True, out_int32=self.key_dtype == torch.int32, out=codes)
        self._tie_break(need, ties)

    def _keys(self) -> None:
        """The scores' bits, in place, as integers whose unsigned order is the scores' order:
        the sign bit flipped for scores >= 0, every bit for the others; -0.0 first becomes
        +0.0, which it equals."""
        s, keys, sign = self.scores, self.keys, self.scratch
        s.add_(0.0)
        torch.bitwise_right_shift(keys, 8 * self.bytes - 1, out=sign)  # -1 for negative scores, else 0
        sign.bitwise_or_(torch.iinfo(self.key_dtype).min)
        keys.bitwise_xor_(sign)

    def _pass(self, counts: Tensor, need: Tensor, bins: "_Bins") -> tuple[Tensor, Tensor, Tensor]:
        """From this byte's histograms (``counts``, laid out as ``bins`` says): per segment, what
        is still needed after the scores whose byte is above the selected one, how many
        candidates carry the selected byte, and the boundaries that map every bin to its new
        code (above: 3j + 2, selected byte: 3j + 1, below: 3j)."""
        by_lane = counts.view(bins.lanes, self.n_seg, bins.blocks, 256)[:, :, bins.blocks // 2]
        hist = by_lane.sum(0, dtype=self.key_dtype).flip(1)         # the candidates' counts, byte 255 first
        # (in the keys' width: a sum into int64 would first cast all counters, up to 2 MiB on the CPU)
        at_least = hist.cumsum(1)                                   # candidates with byte >= 255 - i
        short = at_least < need.unsqueeze(1)                        # a prefix of each row
        above = (hist * short).sum(1)
        index = short.sum(1, keepdim=True)                          # 255 - the selected byte
        ties = hist.gather(1, index).squeeze(1)
        selected = bins.top - index.squeeze(1).to(self.key_dtype)
        boundaries = torch.stack((selected, selected + 1, bins.next), 1).view(-1)
        return need - above, ties, boundaries

    def _tie_break(self, need: Tensor, ties: Tensor) -> None:
        """Scores <- 1 on the codes 3j + 2 and on the first ``need_j`` codes 3j + 1 of each
        segment, else 0. With c the running count of codes 3j + 1 (in the keys' memory), those
        of segment j have c in ``(before_j, before_j + ties_j]``, before_j the ties of the
        segments before it, and are kept when ``c <= before_j + need_j``: when ``c`` falls in an
        odd interval of the sorted boundaries ``before_0, limit_0, before_1, limit_1, ...``.
        A score is kept when ``code % 3 + that parity >= 2``."""
        codes, count = self.scratch, self.keys
        before = ties.cumsum(0) - ties
        boundaries = torch.stack((before, before + need), 1).view(-1).to(self.key_dtype)
        torch.remainder(codes, 3, out=codes)
        torch.eq(codes, 1, out=count)
        count.cumsum_(0)
        torch.searchsorted(boundaries, count, out_int32=self.key_dtype == torch.int32, out=count)
        codes.add_(count.bitwise_and_(1))
        torch.ge(codes, 2, out=codes)
        self.scores.copy_(codes)


class CompileFailed(RuntimeError):
    """torch.compile could not make a compiled pass's kernels here (no compiler, no Triton):
    the first call of :func:`compiled_copy`'s function failed."""


class _CountSelect(_DeviceEngine):
    """The compiled device engine (``compiled=True``, float32 scores): the top ``k_j`` of every
    segment by counting, in kernels that ``torch.compile`` fuses, with no atomic addition, no
    integer scratch and no d-sized temporary.

    With the scores' keys (:func:`_order_keys`: int32 in the scores' order), T_j, the
    ``k_j``-th largest key of segment j, is the largest v with ``#{key >= v} >= k_j``. It is
    found from the top bit down, ``_COUNT_BITS`` bits a pass: with the prefix R_j found so far
    (its lower bits 0), a pass counts, per segment, the keys at or above each candidate
    ``R_j + t 2^shift`` (t = 1 .. 7), and keeps the largest t whose count reaches ``k_j``
    (:func:`_value_pass`). Then the tie-break, lowest index first: among the keys equal to T_j
    the same search finds ``cut_j``, the position of the ``need_j``-th of them, where ``need_j =
    k_j - #{key > T_j}`` (:func:`_position_pass`), and the last pass writes the indicator of
    ``key > T_j or (key == T_j and position <= cut_j)`` into the scores (:func:`_indicator`):
    11 passes for the keys' 32 bits, ``ceil(log2(d) / 3)`` for the positions (8 up to 16.7 M
    scores), each one read of the scores, and the indicator's read and write.

    A pass reads the scores in rows of at most ``_COUNT_ROW`` (255) that never straddle a
    segment, so a row's segment and prefix are loaded once. Every score gets a level, the number
    of candidates it reaches (0 .. 7), and a row sums ``2^(8 (level - 1))`` over its scores in
    one int64: seven 8-bit counters that cannot carry, about twenty integer instructions a score
    where a compare per candidate would take three times as many. Chunks of at most 64 rows of
    one segment, then the segments, sum those counters (:func:`_at_least`), with no scan: on the
    CPU inductor makes each pass one kernel (on CUDA, where a reduction is a kernel of its own,
    presumably three). Where atomic additions into a few hot counters queue (the radix select's
    histograms, docs/PERFORMANCE.md), these sums do not contend, and the number of segments
    changes only the chunks' sums, whose steps stay near the rows' number.

    The passes are three functions compiled for this engine's layout, at its first selection;
    where compilation fails that selection raises :class:`CompileFailed` before any score is
    written (:class:`TopKSelector` then runs the radix select). Memory: the rows' and chunks'
    tables (16 bytes a row, 0.06 bytes a score) and, within a pass, the rows' sums (8 bytes a
    row, 0.03 bytes a score) and the chunks' (28 bytes a chunk).
    ``cuda_graph``: as :class:`_DeviceEngine` says.
    """

    def __init__(self, scores: Tensor, bounds: list[int], cuda_graph: bool) -> None:
        super().__init__(scores, cuda_graph)
        d, device = scores.numel(), scores.device
        starts, lengths, first_rows = _pieces(bounds, _COUNT_ROW)  # the rows, segment by segment
        chunk_first, chunk_rows, first_chunks = _pieces(first_rows, _COUNT_CHUNK)  # each segment's rows in chunks
        segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(first_rows).diff())
        segment_chunks = torch.tensor(first_chunks).diff()
        tables = (torch.tensor(starts, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32), segment,
                  torch.tensor(chunk_first), torch.tensor(chunk_rows), torch.tensor(first_chunks[:-1]), segment_chunks)
        # what every pass reads: the rows (start, length, segment), then _at_least's chunks
        self.row_tables = tuple(_to_device(t, device) for t in tables) + (max([1, *segment_chunks.tolist()]),)
        # a position's segment, for the indicator: the number of segment ends <= it, by a binary
        # search over the ends padded with d to a power of two (every probe then in range)
        ends = torch.full((1 << len(bounds).bit_length(),), d, dtype=torch.int32)
        ends[:len(bounds) - 1] = torch.tensor(bounds[1:])
        self.ends = _to_device(ends, device)
        self.value_shifts = list(range(32 - _COUNT_BITS, -1, -_COUNT_BITS)) + [0]  # 29, 26, ..., 2, 0
        position_bits = _COUNT_BITS * -(-max(1, (d - 1).bit_length()) // _COUNT_BITS)
        self.position_shifts = list(range(position_bits - _COUNT_BITS, -1, -_COUNT_BITS))
        self.shift = {s: _on_device([s], torch.int32, device)[0] for s in set(self.value_shifts + self.position_shifts)}
        self.value_pass, self.position_pass, self.indicator = map(compiled_copy, (_value_pass, _position_pass,
                                                                                   _indicator))

    def _select(self) -> None:
        ks = self._ks[1]
        value = torch.full_like(ks, -(1 << 31))
        for shift in self.value_shifts:
            value = self.value_pass(self.scores, value, ks, self.shift[shift], *self.row_tables)
        cut = torch.zeros_like(ks)
        for shift in self.position_shifts:
            cut = self.position_pass(self.scores, value, cut, ks, self.shift[shift], *self.row_tables)
        self.indicator(self.scores, value, cut, ks, self.ends)


_COUNT_BITS = 3  # bits of T found per pass: candidates t = 1 .. 7, a level of 3 bits a score
_COUNT_ROW = 255  # scores a row: its seven 8-bit counters cannot carry
_COUNT_CHUNK = 64  # rows a chunk: the segments' sums run over chunks, not rows


def _pieces(bounds: list[int], size: int) -> tuple[list[int], list[int], list[int]]:
    """Every range ``bounds[j] .. bounds[j + 1]`` cut into pieces of at most ``size``: the pieces'
    starts and lengths, and the index of each range's first piece (one more entry: their number)."""
    starts, lengths, firsts = [], [], [0]
    for a, b in zip(bounds, bounds[1:]):
        starts += range(a, b, size)
        lengths += [min(size, b - s) for s in range(a, b, size)]
        firsts.append(len(starts))
    return starts, lengths, firsts


def compiled_copy(fn: Callable) -> Callable:
    """``torch.compile(fn)`` of a copy of ``fn`` with a code object of its own, compiled at its
    first call: torch._dynamo keeps at most ``recompile_limit`` (8) graphs per code object, and
    one process may select over more layouts than that (a benchmark, a test run). An error of
    the first call (the compilation's) is raised as :class:`CompileFailed`, later ones as
    they are."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    compiled = torch.compile(own, dynamic=False, fullgraph=True)
    ran = []

    def call(*args):
        if ran:
            return compiled(*args)
        try:
            result = compiled(*args)
        except Exception as exc:  # noqa: BLE001 - whatever the compiler raised
            raise CompileFailed(f"{type(exc).__name__}: {exc}") from exc
        ran.append(True)
        return result

    return call


def _segment_of(position: Tensor, ends: Tensor) -> Tensor:
    """The number of ``ends`` (sorted, a power of two of them, the last above every position)
    at or below each position: a binary search of fixed depth, which compiles into the kernel
    that reads it (``torch.bucketize`` runs apart on CPU, with a d-sized output)."""
    seg = torch.zeros_like(position)
    step = ends.numel() // 2
    while step:
        seg = seg + step * (ends[seg + (step - 1)] <= position)
        step //= 2
    return seg


def _order_keys(scores: Tensor) -> Tensor:
    """float32 scores as int32 keys in the same order (-0.0 equal to +0.0): the bits of a score
    >= 0, and those of a negative score with every bit but the sign flipped."""
    bits = scores.view(torch.int32)
    bits = torch.where(bits == -(1 << 31), 0, bits)  # -0.0 is the sign bit alone
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _row_keys(scores: Tensor, starts: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The keys of every row (rows x ``_COUNT_ROW``), their positions, and which are the row's
    (a short row repeats its last score, which then does not count)."""
    lane = torch.arange(_COUNT_ROW, dtype=torch.int32, device=scores.device)
    valid = lane < lengths[:, None]
    position = starts[:, None] + torch.minimum(lane, lengths[:, None] - 1)
    return _order_keys(scores[position]), position, valid


def _at_least(level: Tensor, valid: Tensor, chunk_first: Tensor, chunk_rows: Tensor, segment_first: Tensor,
              segment_chunks: Tensor, most_chunks: int) -> Tensor:
    """``counts[j, l - 1] = #{scores of segment j with level >= l}`` for l = 1 .. 7, from the
    levels (0 .. 7) of the rows' scores. A score adds 1 to the counter of its level, one of seven
    8-bit counters packed in one int64; a row's sum keeps them apart (at most 255 a counter). A
    chunk (at most ``_COUNT_CHUNK`` consecutive rows of one segment: ``chunk_rows`` from
    ``chunk_first``) sums its rows' counts at or above each level, and a segment its chunks
    (``segment_chunks`` from ``segment_first``, at most ``most_chunks``): two small reductions
    whose steps stay near the rows' number, however the segments' sizes differ."""
    field = torch.ones_like(level, dtype=torch.int64) << (8 * (level - 1)).clamp(min=0)  # no negative shift
    per_row = torch.where(valid & (level > 0), field, 0).sum(1)
    i = torch.arange(_COUNT_CHUNK, device=level.device)
    row = (chunk_first[:, None] + i).clamp(max=per_row.numel() - 1)
    in_chunk = torch.where(i < chunk_rows[:, None], per_row[row], 0)
    per_chunk, at_least = [], 0
    for f in reversed(range(7)):  # level f + 1
        at_least = at_least + ((in_chunk >> (8 * f)) & 255)
        per_chunk.append(at_least.sum(1, dtype=torch.int32))
    per_chunk = torch.stack(per_chunk[::-1], 1)  # chunks x 7
    j = torch.arange(most_chunks, device=level.device)
    chunk = (segment_first[:, None] + j).clamp(max=per_chunk.shape[0] - 1)
    return torch.where((j < segment_chunks[:, None])[..., None], per_chunk[chunk], 0).sum(1, dtype=torch.int32)


def _value_pass(scores: Tensor, value: Tensor, ks: Tensor, shift: Tensor, starts: Tensor, lengths: Tensor,
                segment: Tensor, *counting: Tensor | int) -> Tensor:
    """The next ``_COUNT_BITS`` bits of every T_j: ``value`` plus the largest ``t 2^shift`` with
    ``#{key >= value + t 2^shift} >= k_j`` (t = 0 when none). A key's level is the number of
    candidates it reaches, ``(key >> shift) - (value >> shift)`` clamped to 0 .. 7 (value's bits
    below ``shift + 3`` are 0, so that is ``floor((key - value) / 2^shift)``)."""
    key, _, valid = _row_keys(scores, starts, lengths)
    # in int64: at shift 0 the difference of two int32 can pass int32's range
    level = ((key >> shift).to(torch.int64) - (value >> shift)[segment][:, None]).clamp(0, 7).to(torch.int32)
    counts = _at_least(level, valid, *counting)
    return value + (counts >= ks[:, None]).sum(1) * (1 << shift.to(torch.int64))


def _position_pass(scores: Tensor, value: Tensor, cut: Tensor, ks: Tensor, shift: Tensor, starts: Tensor,
                   lengths: Tensor, segment: Tensor, *counting: Tensor | int) -> Tensor:
    """The next ``_COUNT_BITS`` bits of every segment's last tie position: ``cut`` plus the largest
    ``t 2^shift`` with ``#{key > T_j} + #{key == T_j, position < cut + t 2^shift} < k_j``. A key
    above T_j reaches every candidate, one equal to it those with ``t > (position >> shift) -
    (cut >> shift)``."""
    key, position, valid = _row_keys(scores, starts, lengths)
    t_row = value.clamp(max=(1 << 31) - 1).to(torch.int32)[segment][:, None]
    before = (position >> shift) - (cut >> shift).to(torch.int32)[segment][:, None]
    level = torch.where(key > t_row, 7, torch.where(key == t_row, 7 - before.clamp(0, 7), 0))
    counts = _at_least(level, valid, *counting).flip(1)  # candidate t reached at level >= 8 - t
    return cut + (counts < ks[:, None]).sum(1) * (1 << shift.to(torch.int64))


def _indicator(scores: Tensor, value: Tensor, cut: Tensor, ks: Tensor, ends: Tensor) -> None:
    """``scores`` <- 1 where ``key > T_j`` or ``key == T_j`` at a position up to ``cut_j``
    (nothing where k_j = 0), else 0."""
    position = torch.arange(scores.numel(), dtype=torch.int32, device=scores.device)
    seg = _segment_of(position, ends)
    t = value.clamp(max=(1 << 31) - 1).to(torch.int32)[seg]
    last = torch.where(ks > 0, cut, -1).to(torch.int32)[seg]  # cut < d
    key = _order_keys(scores)
    scores.copy_((key > t) | ((key == t) & (position <= last)))


def _captured(fn: Callable[[], None], device: torch.device) -> "torch.cuda.CUDAGraph":
    """``fn``'s CUDA operations captured (not run) as one graph, on a side stream that first waits
    for the current stream's work; replayed on the current stream. The temporaries ``fn`` makes
    come from the graph's own memory pool and are kept for its replays. Neither the capture nor
    a replay waits for the device."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")  # other threads' CUDA calls stay legal
        try:
            fn()
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph


class _Bins:
    """The histogram layout of one kind of radix pass: per segment, ``blocks`` blocks of 256 bins
    (one block of candidates in the first pass, where every score is one; three in the later
    ones), counted in ``lanes`` copies (:func:`_lanes`), the score's position modulo ``lanes``
    picking one. The copies lie lane after lane (every bin of lane 0, then of lane 1, ...), so
    that a bin's copies are ``bins`` counters apart, each in a line of the GPU's L2 cache of its
    own: the GPU's atomic additions are capped per line as well as per address
    (docs/PERFORMANCE.md). ``top``: the last bin of each segment's candidate block; ``next``:
    the first bin of the next segment."""

    def __init__(self, scratch: Tensor, n_seg: int, blocks: int) -> None:
        d, device, dtype = scratch.numel(), scratch.device, scratch.dtype
        self.blocks, self.lanes = blocks, _lanes(d, n_seg, blocks)
        bins = blocks * 256 * n_seg
        self.counters = bins * self.lanes
        self.offset = torch.arange(self.lanes, dtype=dtype, device=device) * bins  # where each lane's copies start
        # the codes in whole rows of lanes (their lane's offset is added), and the last d % lanes (lane 0)
        self.rows = scratch[:d - d % self.lanes].view(-1, self.lanes)
        seg = torch.arange(n_seg, device=device)
        self.top = (256 * (blocks * seg + blocks // 2 + 1) - 1).to(dtype)
        self.next = (256 * blocks * (seg + 1)).to(dtype)

    def spread_(self) -> None:
        """The codes (bins) in the scratch become their counters: ``bin + bins x (position % lanes)``."""
        if self.lanes > 1:
            self.rows.add_(self.offset)

    def gather_(self) -> None:
        """The counters in the scratch become their bins again (:meth:`spread_` undone)."""
        if self.lanes > 1:
            self.rows.sub_(self.offset)


def _lanes(d: int, n_seg: int, blocks: int) -> int:
    """Copies of every bin of a pass with ``blocks`` blocks of 256 bins a segment: the largest
    power of two whose counters stay within ``_LANE_COUNTERS`` and one per 16 scores (a small
    selection has too few scores to contend, and keeps one copy); at least 1, so a selection of
    many segments keeps ``256 x blocks`` counters each."""
    lanes = max(1, min(_LANE_COUNTERS, d // 16) // (blocks * 256 * n_seg))
    return 1 << (lanes.bit_length() - 1)


def _on_device(values: list[int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A small tensor of ``values`` on ``device`` (:func:`_to_device`)."""
    return _to_device(torch.tensor(values, dtype=dtype), device)


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """The CPU tensor ``t`` on ``device``; off CPU copied from pinned memory, which does not wait
    for the device."""
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
