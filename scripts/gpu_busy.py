"""How busy the GPU was over stretches of a benchmark: ``nvidia-smi``'s utilization, sampled.

    with GpuBusy() as busy:
        ...                                   # the work
    print(busy.mean(start, end))              # mean % busy over [start, end] (Unix times), or None

``utilization.gpu`` is the share of the last sample period in which a kernel ran on the device
(NVML's definition): 100 % means some kernel was always running, not that the GPU's arithmetic
was used. The samples come every ``period_ms`` (default 200) from one ``nvidia-smi -lms``
process, each stamped with this machine's clock when read. Without ``nvidia-smi`` (no NVIDIA
driver), nothing is sampled and every mean is None.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time


class GpuBusy:
    """Samples GPU utilization (the first GPU ``nvidia-smi`` lists, or ``index``) in a thread."""

    def __init__(self, period_ms: int = 200, index: int = 0) -> None:
        self.period_ms = period_ms
        self.index = index
        self.samples: list[tuple[float, float]] = []  # (Unix time, % busy)
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return shutil.which("nvidia-smi") is not None

    def __enter__(self) -> GpuBusy:
        if self.available:
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--id={self.index}", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 f"--loop-ms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip())))
            except ValueError:  # "[N/A]" on a GPU that does not report it
                continue

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            ended_early = self._proc.poll()  # a sampler that stopped by itself failed
            self._proc.terminate()
            self._proc.wait(timeout=10)
            if ended_early is not None and not self.samples:
                assert self._proc.stderr is not None
                print(f"gpu_busy: nvidia-smi exited with {ended_early}: {self._proc.stderr.read().strip()[:500]}",
                      file=sys.stderr)
        if self._reader is not None:
            self._reader.join(timeout=10)

    def mean(self, start: float, end: float) -> float | None:
        """Mean % busy of the samples taken in [start, end]; None when there are none."""
        inside = [busy for stamp, busy in self.samples if start <= stamp <= end]
        return sum(inside) / len(inside) if inside else None
