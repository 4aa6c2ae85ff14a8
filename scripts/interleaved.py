"""Timing several pieces of work against each other on a noisy machine: each piece once to warm
up, then ``repeats`` rounds in which every piece runs in turn (a slower stretch of the machine
hits them alike), and a table of each one's median, range and ratio to a baseline piece."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch


Piece = Callable[[], object] | tuple[Callable[[], object], Callable[[], object]]  # fn, or (untimed setup, fn)


def interleaved(pieces: Mapping[str, Piece], repeats: int,
                device: torch.device | None = None) -> dict[str, list[float]]:
    """Seconds of each call of each piece, the warm-up left out; on a CUDA ``device`` each call
    is timed between two synchronizations. A piece given as ``(setup, fn)`` runs ``setup()``
    untimed before each timed ``fn()``."""

    def timed(piece: Piece) -> float:
        setup, fn = piece if isinstance(piece, tuple) else (None, piece)
        if setup is not None:
            setup()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        fn()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    for fn in pieces.values():  # warm-up: the allocator, the kernels
        timed(fn)
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for _ in range(repeats):
        for name, fn in pieces.items():
            times[name].append(timed(fn))
    return times


def print_medians(times: Mapping[str, list[float]], baseline: str, name_column: tuple[str, int],
                  ms_header: str, range_width: int, ratio_column: tuple[str, int]) -> None:
    """One row a piece: name, median ms, [min-max] ms, median / the ``baseline`` piece's median."""
    (name_header, name_width), (ratio_header, ratio_width) = name_column, ratio_column
    print(f"{name_header:<{name_width}}{ms_header:>10}  {'range':<{range_width}}{ratio_header:>{ratio_width}}")
    base = statistics.median(times[baseline])
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"[{1e3 * min(values):.1f}-{1e3 * max(values):.1f}]"
        print(f"{name:<{name_width}}{1e3 * median:>10.1f}  {spread:<{range_width}}{median / base:>{ratio_width}.2f}")
