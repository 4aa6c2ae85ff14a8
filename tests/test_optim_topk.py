"""The exact top-k selection (fedact_app.optim.topk) against a stable descending sort.

The oracle is ``torch.sort(s, descending=True, stable=True)``: the k largest entries, ties to the
lowest index.
"""

import math
import threading
import time
import warnings

import pytest
import torch

import fedact_app.optim.kernels as kernels
import fedact_app.optim.topk as topk
from fedact_app.optim import FedACTAdamW, top_k_indicator_


def _stable_top_k(s, k):
    """1 on the k largest entries of s (stable descending sort: ties to the lowest index)."""
    top = torch.zeros_like(s)
    top[torch.sort(s, descending=True, stable=True).indices[:k]] = 1
    return top


def _host_and_device_top_k(s, k, on_host, monkeypatch=None):
    """The public top_k_indicator_ on the host engine (numpy) or the device engine (numpy hidden)."""
    if not on_host and s.device.type == "cpu":
        monkeypatch.setattr(topk, "np", None)
    return top_k_indicator_(s, k)


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy-bracket", "device-radix"])
@pytest.mark.parametrize("kind", ["normal", "70% zeros", "five values", "signed zeros", "all equal"])
def test_selection_on_large_segments_is_exact(kind, on_host, monkeypatch):
    """Above _BRACKET_MIN (sample, bracket, exact count, chunks on threads) and on the device path:
    exactly floor(tau*d) ones, ties to the lowest index, whatever the ties."""
    monkeypatch.setattr(topk, "_BRACKET_MIN", 1 << 16)
    monkeypatch.setattr(topk, "_HOST_CHUNK", 1 << 16)
    d = (1 << 18) + 3
    gen = torch.Generator().manual_seed(5)
    s = {"normal": lambda: torch.randn(d, generator=gen),
         "70% zeros": lambda: torch.randn(d, generator=gen) * (torch.rand(d, generator=gen) > 0.7),
         "five values": lambda: torch.randint(0, 5, (d,), generator=gen).float(),
         "signed zeros": lambda: torch.randn(d, generator=gen).clamp(min=0) * torch.tensor([1.0, -0.0]).repeat(d)[:d],
         "all equal": lambda: torch.ones(d)}[kind]()
    for tau in (1e-6, 0.3, 0.5, 0.999999):
        k = math.floor(tau * d)
        assert torch.equal(_host_and_device_top_k(s.clone(), k, on_host, monkeypatch), _stable_top_k(s, k)), tau


@pytest.mark.parametrize("on_host, lanes", [(True, None), (False, None), (False, {1: 4, 3: 4}), (False, {1: 8, 3: 2})],
                         ids=["numpy", "device-radix", "device-radix-4-lanes", "device-radix-8-then-2-lanes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segmented_selection_is_exact_in_every_segment(on_host, lanes, dtype, monkeypatch):
    """One selection over segments (as trust_scope="tensor" cuts the flat scores): every segment
    j gets exactly its k_j largest, ties to its lowest index, as a stable sort of that segment
    alone; empty segments, k = 0 and k = size, ties (signed zeros included) and tiny values.
    The radix select also with 4 copies of every bin, and with 8 in the first pass and 2 in the
    others (large selections have them; here most sizes leave scores beyond the last whole row
    of lanes)."""
    if not on_host:
        monkeypatch.setattr(topk, "np", None)
    if lanes is not None:
        monkeypatch.setattr(topk, "_lanes", lambda d, n_seg, blocks: lanes[blocks])
    gen = torch.Generator().manual_seed(2)
    for trial in range(60):
        sizes = torch.randint(0, 40, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        d = bounds[-1]
        s = [lambda: torch.randn(d, generator=gen),
             lambda: torch.randint(-2, 3, (d,), generator=gen).float(),
             lambda: torch.randn(d, generator=gen) * (torch.rand(d, generator=gen) > 0.6) * torch.tensor([1.0, -1.0]).repeat(d)[:d],
             lambda: torch.randn(d, generator=gen).exp() * 1e-30][trial % 4]().to(dtype)
        ks = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in sizes]
        top = s.clone()
        topk.TopKSelector(top, bounds).indicator_(ks)
        expected = torch.cat([_stable_top_k(s[a:b], k) for a, b, k in zip(bounds, bounds[1:], ks)])
        assert torch.equal(top, expected), (trial, sizes, ks)


def _counting_selector(s, bounds):
    """A selector of the compiled counting engine on the CPU (numpy hidden, as on CUDA)."""
    selector = topk.TopKSelector(s, bounds, compiled=True)
    assert type(selector.device_engine) is topk._CountSelect
    return selector


def _graphs_compiled():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("sizes", [[0, 5, 37, 0, 1, 300], [0, 0, 600, 0], [17, 2040, 47_952, 1, 19_999],
                                   [(1 << 17) + 3]],
                         ids=["short-rows", "one-not-empty", "whole-and-short-rows", "one-segment-of-chunks"])
def test_counting_selection_is_exact_in_every_segment(sizes, monkeypatch):
    """The compiled counting engine (compile=True off the host): every segment j gets exactly its
    k_j largest, ties to its lowest index, as a stable sort of that segment alone, for scores
    with ties (signed zeros, a few values, all equal), k = 0 and k = size, empty segments, and
    segments shorter than a row of 255, of whole rows (2,040) and ending in a short row. New
    contents and ks reuse the three compiled passes: they compile once for the layout."""
    monkeypatch.setattr(topk, "np", None)
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    d = bounds[-1]
    gen = torch.Generator().manual_seed(6)
    kinds = [lambda: torch.randn(d, generator=gen),
             lambda: torch.randint(-2, 3, (d,), generator=gen).float(),
             lambda: (torch.randn(d, generator=gen) * (torch.rand(d, generator=gen) > 0.6)
                      * torch.tensor([1.0, -1.0]).repeat(d)[:d]),
             lambda: torch.randn(d, generator=gen).exp() * 1e-30,
             lambda: torch.ones(d)]
    selector = _counting_selector(torch.empty(d), bounds)
    before = _graphs_compiled()
    for trial in range(11):
        s = kinds[trial % len(kinds)]()
        ks = [[0, n, n // 2][trial % 3] if trial < 3 else int(torch.randint(0, n + 1, (1,), generator=gen))
              for n in sizes]
        if trial == 10:  # distinct scores, the first of them the (k+1)-th largest of its segment
            s = torch.randperm(d, generator=gen).float()
            ks[0] = int((s[:sizes[0]] > s[0]).sum())
        selector.scores.copy_(s)
        selector.indicator_(ks)
        expected = torch.cat([_stable_top_k(s[a:b], k) for a, b, k in zip(bounds, bounds[1:], ks)])
        assert torch.equal(selector.scores, expected), (trial, ks)
    assert _graphs_compiled() - before == 3  # value, position and indicator passes, once each


def test_counting_selection_that_cannot_compile_warns_once_and_runs_the_radix_select(no_torch_compile, monkeypatch):
    """Where torch.compile fails, the first selection warns and the radix select (with a scratch of
    its own) does it and every later one, exactly; no score was written by the failed attempt."""
    monkeypatch.setattr(topk, "np", None)
    gen = torch.Generator().manual_seed(8)
    bounds, ks = [0, 300, 1000], [100, 699]
    selector = _counting_selector(torch.empty(1000), bounds)
    for step in range(3):
        s = torch.randint(-3, 4, (1000,), generator=gen).float()
        selector.scores.copy_(s)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            selector.indicator_(ks)
        assert [str(w.message) for w in record if "could not be compiled" in str(w.message)] == (
            ["FedACTAdamW(compile=True): the counting selection could not be compiled (RuntimeError: no compiler "
             "here); the radix select runs instead, with an integer scratch of its own"] if step == 0 else [])
        assert type(selector.device_engine) is topk._RadixSelect
        expected = torch.cat([_stable_top_k(s[a:b], k) for a, b, k in zip(bounds, bounds[1:], ks)])
        assert torch.equal(selector.scores, expected)


def test_a_counting_selection_that_cannot_compile_warns_at_the_line_that_called_step(no_torch_compile,
                                                                                      monkeypatch):
    """The fallback's warning names the caller of FedACTAdamW.step() (here the compiled passes
    run eagerly, so the selection's failure is the process's first)."""
    monkeypatch.setattr(topk, "np", None)
    monkeypatch.setattr(kernels, "_direction_compiled", lambda run, sqrt_bias2, local_scale: False)
    params = [torch.randn(40, requires_grad=True), torch.randn(3, 5, requires_grad=True)]
    opt = FedACTAdamW(params, lr=1e-2, compile=True)
    for p in params:
        p.grad = torch.randn_like(p)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt.step()
    ((warning,),) = [[w for w in record if "could not be compiled" in str(w.message)]]
    assert warning.filename == __file__, warning.filename


def test_each_counting_engine_compiles_its_own_passes(monkeypatch):
    """torch._dynamo keeps at most recompile_limit graphs per code object; each engine compiles
    copies of its own, so a process selecting over more layouts than that (here the limit set to
    1, and two layouts) keeps the counting engine for every one of them."""
    monkeypatch.setattr(topk, "np", None)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    gen = torch.Generator().manual_seed(9)
    for bounds in ([0, 40, 100], [0, 70]):
        s = torch.randn(bounds[-1], generator=gen)
        selector = _counting_selector(s.clone(), bounds)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            selector.indicator_([7] * (len(bounds) - 1))
        assert type(selector.device_engine) is topk._CountSelect
        expected = torch.cat([_stable_top_k(s[a:b], 7) for a, b in zip(bounds, bounds[1:])])
        assert torch.equal(selector.scores, expected)


def test_segment_of_counts_the_ends_at_or_below_each_position():
    """The counting engine's binary search against a plain count, with empty segments (repeated
    ends) and the padding above the last end."""
    for bounds in ([0, 10], [0, 0, 3, 3, 3, 9, 10], [0, 1, 2, 3, 4, 5, 6, 7, 10]):
        ends = torch.full((1 << len(bounds).bit_length(),), bounds[-1])
        ends[:len(bounds) - 1] = torch.tensor(bounds[1:])
        position = torch.arange(bounds[-1])
        expected = torch.tensor([sum(e <= i for e in bounds[1:]) for i in range(bounds[-1])])
        assert torch.equal(topk._segment_of(position, ends), expected), bounds


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_segmented_selection_with_its_own_lanes_is_exact(dtype, monkeypatch):
    """The radix select with the lanes it picks itself for a large selection of a few segments
    (2^18 + 5 scores in 5 segments: 8 lanes in the first pass, 4 in the others; d not a multiple
    of either), ties included: each segment's k_j largest, ties to the lowest index."""
    monkeypatch.setattr(topk, "np", None)
    sizes = [100_003, 70_000, 1, 50_000, (1 << 18) + 5 - 220_004]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    d = bounds[-1]
    assert (topk._lanes(d, 5, 1), topk._lanes(d, 5, 3)) == (8, 4)
    gen = torch.Generator().manual_seed(4)
    for s in (torch.randn(d, generator=gen), torch.randint(-3, 4, (d,), generator=gen).float()):
        s = s.to(dtype)
        ks = [n // 3 for n in sizes]
        top = s.clone()
        topk.TopKSelector(top, bounds).indicator_(ks)
        expected = torch.cat([_stable_top_k(s[a:b], k) for a, b, k in zip(bounds, bounds[1:], ks)])
        assert torch.equal(top, expected)


def test_lanes_are_powers_of_two_within_the_counter_budget():
    """The radix select's copies of every bin: the largest power of two within 2^18 counters
    (256 a copy, block and segment: one block in the first pass, three in the others) and one
    counter per 16 scores; one for small selections."""
    assert topk._lanes(11_220_132, 1, 3) == 256
    assert topk._lanes(11_220_132, 1, 1) == 1024
    assert topk._lanes((1 << 22) + 1000, 1, 3) == 256
    assert topk._lanes(11_220_132, 62, 3) == 4      # 2^18 // (768 * 62) = 5
    assert topk._lanes(11_220_132, 62, 1) == 16     # 2^18 // (256 * 62) = 16
    assert topk._lanes(2_710_948, 80, 3) == 2       # 169,434 // (768 * 80) = 2
    assert topk._lanes(2_710_948, 80, 1) == 8       # 169,434 // (256 * 80) = 8
    assert topk._lanes((1 << 18) + 3, 1, 3) == 16   # 16,384 // 768 = 21
    assert topk._lanes(1000, 1, 3) == topk._lanes(1 << 30, 400, 3) == topk._lanes(1 << 30, 1100, 1) == 1


def test_a_bins_copies_lie_a_whole_histogram_apart(monkeypatch):
    """The radix select's lanes lie lane after lane: the score at position i with bin b is
    counted at ``b + bins x (i % lanes)`` (the last ``d % lanes`` scores in lane 0), so the
    copies of a bin fall in different lines of the GPU's cache; ``gather_`` gives the bins back."""
    monkeypatch.setattr(topk, "_lanes", lambda d, n_seg, blocks: 4)
    codes = torch.arange(10, dtype=torch.int32) * 7
    bins = topk._Bins(codes, n_seg=2, blocks=3)
    assert bins.counters == 4 * 3 * 256 * 2
    bins.spread_()
    assert codes.tolist() == [7 * i + 1536 * (i % 4) for i in range(8)] + [56, 63]
    bins.gather_()
    assert torch.equal(codes, torch.arange(10, dtype=torch.int32) * 7)


def test_host_map_runs_uneven_items_on_threads_in_order(monkeypatch):
    """The host selection's thread map: results in item order, the items cut into one run of
    consecutive items per thread by their sizes, the calling thread working too."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    sizes = [50, 1, 1, 1, 1, 1, 1, 1, 1, 30, 2]
    seen = {}

    def square(x):
        seen[x] = threading.get_ident()
        return x * x

    assert topk.host_map(square, list(range(len(sizes))), sizes) == [x * x for x in range(len(sizes))]
    assert seen[0] == threading.get_ident()  # the first run (item 0 alone: 50 of 91) stays here
    assert len({seen[i] for i in range(1, 10)}) == 1 and seen[1] != seen[0]
    assert seen[10] != seen[0]  # the third run: a pool thread (maybe the one that ran the second)
    assert [list(r) for r in topk._balanced_runs([1, 1], 3)] == [[0], [1], []]
    with pytest.raises(ValueError, match="2 sizes for 3 items"):
        topk.host_map(square, [0, 1, 2], [1, 1])

    finished = []

    def fail_here_finish_there(x):  # item 0 runs on this thread and raises; item 1 takes a while
        if x == 0:
            raise KeyError("boom")
        time.sleep(0.2)
        finished.append(x)

    with pytest.raises(KeyError):
        topk.host_map(fail_here_finish_there, [0, 1], [1, 1])
    assert finished == [1]  # the other thread's run had ended before the error came out


def _forced_graph_selector(monkeypatch, capturing):
    """A device-engine selector on the CPU (numpy hidden) with its CUDA graph forced on, the
    stream's capture state mocked, and scores to select from."""
    monkeypatch.setattr(topk, "np", None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    s = torch.randn(1000, generator=torch.Generator().manual_seed(9))
    selector = topk.TopKSelector(s.clone(), [0, 400, 1000], cuda_graph=True)
    selector.device_engine.cuda_graph = True  # as on a CUDA device
    return selector, s


def test_a_selection_whose_capture_fails_warns_once_and_launches_its_operations(monkeypatch):
    """A capture that raises (an operation a CUDA graph cannot hold) warns once, naming the
    setting, and the selections go on exact with their operations launched one by one."""
    selector, s = _forced_graph_selector(monkeypatch, capturing=False)
    captures = []

    def failing_capture(fn, device):
        captures.append(device)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(topk, "_captured", failing_capture)
    want = torch.cat([_stable_top_k(s[:400], 100), _stable_top_k(s[400:], 300)])
    with pytest.warns(RuntimeWarning, match=r"cuda_graph=True.*not permitted.*launched one by one") as record:
        for _ in range(4):
            selector.scores.copy_(s)
            selector.indicator_([100, 300])
            assert torch.equal(selector.scores, want)
    assert len(captures) == 1 and not selector.device_engine.cuda_graph and len(record) == 1


def test_a_failed_capture_warns_at_the_line_that_called_step(monkeypatch):
    """The warning of a failed capture points at the caller of ``FedACTAdamW.step()`` (its
    stacklevel counts the frames between them), once for the optimizer's selection."""
    monkeypatch.setattr(topk, "np", None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    def failing_capture(fn, device):
        raise RuntimeError("no graph here")

    monkeypatch.setattr(topk, "_captured", failing_capture)
    made = topk._RadixSelect.__init__

    def as_on_cuda(self, *args):
        made(self, *args)
        self.cuda_graph = True

    monkeypatch.setattr(topk._RadixSelect, "__init__", as_on_cuda)
    params = [torch.randn(30, requires_grad=True), torch.randn(4, 5, requires_grad=True)]
    opt = FedACTAdamW(params, lr=1e-2)
    with pytest.warns(RuntimeWarning, match="no graph here") as record:
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
    assert len(record) == 1 and record[0].filename == __file__, record[0].filename


def test_a_selection_inside_the_callers_capture_is_not_captured_again(monkeypatch):
    """Where the caller captures the whole step (the stream is capturing), the selection's
    operations run into the caller's graph: no graph of its own, no warning."""
    selector, s = _forced_graph_selector(monkeypatch, capturing=True)
    monkeypatch.setattr(topk, "_captured", lambda fn, device: pytest.fail("captured inside a capture"))
    want = torch.cat([_stable_top_k(s[:400], 100), _stable_top_k(s[400:], 300)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            selector.scores.copy_(s)
            selector.indicator_([100, 300])
            assert torch.equal(selector.scores, want)
    assert selector.device_engine._graph is None and selector.device_engine.cuda_graph


def test_the_selection_threads_hold_their_scratch_before_their_first_task(monkeypatch):
    """Every thread of the host selection's pool is started with its chunk scratch when the pool
    is made, so no later step allocates one, whichever threads its tasks land on (on a
    16-core machine steps after the first allocated a thread's 1 MiB where the pool had started
    threads on demand)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(topk, "_POOL", {})
    seen = topk.host_map(lambda _: (threading.get_ident(), getattr(topk._SCRATCH, "n", None)), range(8), [1] * 8)
    (pool,) = topk._POOL.values()
    try:
        assert len(pool._threads) == 7
        on_pool = [n for ident, n in seen if ident != threading.get_ident()]
        assert on_pool and all(n == topk._HOST_CHUNK for n in on_pool), seen
    finally:
        pool.shutdown()


def test_a_pool_made_while_the_chunk_size_was_another_is_not_handed_out(monkeypatch):
    """Pools are kept per chunk size: after a pool was made under a small ``_HOST_CHUNK`` (as a test
    sets it), the selection at the real size gets threads holding scratch of that size, so none
    makes new scratch in a step after the first (a pool shared by both sizes would hand out
    threads with the small scratch: docs/PERFORMANCE.md has what that cost a later test)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    monkeypatch.setattr(topk, "_POOL", {})
    try:
        with monkeypatch.context() as small_chunks:
            small_chunks.setattr(topk, "_HOST_CHUNK", 300)
            topk.host_map(lambda _: None, range(8), [1] * 8)
        seen = topk.host_map(lambda _: (threading.get_ident(), getattr(topk._SCRATCH, "n", None)), range(8), [1] * 8)
        on_pool = [n for ident, n in seen if ident != threading.get_ident()]
        assert on_pool and all(n == topk._HOST_CHUNK for n in on_pool), seen
    finally:
        for pool in topk._POOL.values():
            pool.shutdown()


@pytest.mark.parametrize("on_host", [True, False], ids=["numpy", "device-radix"])
def test_top_k_indicator_on_small_tensors_of_every_dtype(on_host, monkeypatch):
    """The public function on small 1-D tensors (one np.partition, no bracket), float32 and
    float64, with ties, for every k from 0 to d."""
    gen = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.float64):
        s = torch.randint(-3, 4, (37,), generator=gen).to(dtype)
        for k in range(s.numel() + 1):
            out = _host_and_device_top_k(s.clone(), k, on_host, monkeypatch)
            assert out.dtype == dtype and torch.equal(out, _stable_top_k(s, k)), (dtype, k)


def test_top_k_indicator_works_in_place_and_validates():
    s = torch.tensor([0.5, 2.0, -1.0, 2.0])
    assert top_k_indicator_(s, 2) is s and s.tolist() == [0.0, 1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="Invalid k: 5; expected an integer in \\[0, 4\\]"):
        top_k_indicator_(torch.zeros(4), 5)
    with pytest.raises(ValueError, match="Invalid k"):
        top_k_indicator_(torch.zeros(4), -1)
    with pytest.raises(ValueError, match="1-D floating"):
        top_k_indicator_(torch.zeros(2, 2), 1)
    with pytest.raises(ValueError, match="1-D floating"):
        top_k_indicator_(torch.arange(4), 1)
    with pytest.raises(ValueError, match="contiguous"):
        top_k_indicator_(torch.zeros(8)[::2], 1)


# Not run by CI (no GPU there). On a GPU machine: python3 -m pytest -q tests/test_optim_topk.py -k cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("kind", ["normal", "70% zeros", "five values", "all equal"])
def test_cuda_selection_on_a_large_segment_is_exact(kind):
    """The radix select on one segment of 2^20 + 3 scores with the device tie-break: exactly
    floor(tau*d) ones, ties to the lowest index, as a stable sort on the CPU."""
    d = (1 << 20) + 3
    gen = torch.Generator().manual_seed(7)
    s = {"normal": lambda: torch.randn(d, generator=gen),
         "70% zeros": lambda: torch.randn(d, generator=gen) * (torch.rand(d, generator=gen) > 0.7),
         "five values": lambda: torch.randint(0, 5, (d,), generator=gen).float(),
         "all equal": lambda: torch.ones(d)}[kind]()
    for tau in (1e-6, 0.3, 0.5, 0.999999):
        k = math.floor(tau * d)
        top = top_k_indicator_(s.cuda(), k)
        assert torch.equal(top.cpu(), _stable_top_k(s, k)), tau


@needs_cuda
@pytest.mark.parametrize("kind", ["normal", "70% zeros", "five values", "all equal"])
@pytest.mark.parametrize("bounds", [[0, (1 << 20) + 3], [0, 1000, 1000, 700_001, (1 << 20) + 3]],
                         ids=["one-segment", "four-segments"])
def test_cuda_counting_selection_is_exact_launched_captured_and_replayed(kind, bounds):
    """The compiled counting engine on CUDA, 2^20 + 3 scores: its first selection launched (and
    compiled), later ones captured as a CUDA graph (anew for new ks) and replayed, each exactly
    the k_j largest of every segment, ties to the lowest index, as a stable sort on the CPU."""
    d = bounds[-1]
    gen = torch.Generator().manual_seed(7)
    s = {"normal": lambda: torch.randn(d, generator=gen),
         "70% zeros": lambda: torch.randn(d, generator=gen) * (torch.rand(d, generator=gen) > 0.7),
         "five values": lambda: torch.randint(0, 5, (d,), generator=gen).float(),
         "all equal": lambda: torch.ones(d)}[kind]()
    selector = topk.TopKSelector(torch.empty(d, device="cuda"), bounds, cuda_graph=True, compiled=True)
    assert type(selector.device_engine) is topk._CountSelect
    for tau in (1e-6, 0.3, 0.999999):
        ks = [math.floor(tau * (b - a)) for a, b in zip(bounds, bounds[1:])]
        expected = torch.cat([_stable_top_k(s[a:b], k) for a, b, k in zip(bounds, bounds[1:], ks)])
        for selection in range(3):
            selector.scores.copy_(s)
            selector.indicator_(ks)
            launched = tau == 1e-6 and selection == 0
            assert (selector.device_engine._graph is None) == launched, (tau, selection)
            assert torch.equal(selector.scores.cpu(), expected), (tau, selection)
