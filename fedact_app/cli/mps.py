"""A private CUDA MPS control daemon, so that simulated clients sharing a GPU run their kernels
side by side.

Without MPS, every ClientApp process that trains on a GPU has its own CUDA context, and the GPU
runs one context at a time (time slices). Ten Ray actors sharing one GPU take turns, so a round
is no faster than ten clients trained one after another (docs/PERFORMANCE.md). Under NVIDIA's
Multi-Process Service, the processes' kernels go through one server and one shared context: the
kernels of one client can run in the gaps that another client's kernel launches leave.

A CUDA process uses MPS when a control daemon answers in the directory named by
``CUDA_MPS_PIPE_DIRECTORY``; when none answers there, the process runs as it would without MPS
(nvidia-cuda-mps-control(1)). :meth:`MpsDaemon.start` runs ``nvidia-cuda-mps-control -d`` with its
own pipe and log directories:

- it serves only the processes given :attr:`MpsDaemon.env` (the engine's SuperLink and Ray
  cluster, and so their ServerApps and ClientApps);
- it leaves alone any daemon that the machine already runs;
- :meth:`MpsDaemon.stop` ends it with ``quit``, and kills it if it is still there after
  :data:`STOP_TIMEOUT`.

Nothing here changes the GPU's settings (compute mode, MIG).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from fedact_app.cli.flwr import LaunchError
from fedact_app.cli.procs import descendants, kill_quietly, same_process, start_time

CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe directory while the daemon runs
START_TIMEOUT = 10.0  # seconds for the daemon to write its pid file
STOP_TIMEOUT = 10.0  # seconds for ``quit`` to end it, then as long after SIGKILL
HELP = ("clients sharing a GPU run their kernels side by side under a private CUDA MPS daemon "
        "(needs nvidia-cuda-mps-control; fedact_app/cli/mps.py)")  # the command lines' --mps


def control_binary(env: Mapping[str, str]) -> str:
    """The path of ``nvidia-cuda-mps-control`` on ``env``'s PATH; LaunchError if it is not there."""
    path = shutil.which(CONTROL, path=env.get("PATH"))
    if path is None:
        raise LaunchError(
            f"MPS was asked for (--mps), but {CONTROL} is not on PATH ({env.get('PATH', '')!r}). It comes "
            "with NVIDIA's driver utilities, next to nvidia-smi. Put it on PATH, or run without --mps.")
    return path


@dataclass
class MpsDaemon:
    """A running control daemon; its directories live under ``root`` (``pipe/`` and ``log/``)."""

    control: str  # path of nvidia-cuda-mps-control
    root: Path
    pid: int  # 0 until its pid file names a live process
    started: int | None = None  # the process's start time (procs.start_time): the pid may be reused later

    @property
    def env(self) -> dict[str, str]:
        """What a process needs in its environment to use this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}

    @classmethod
    def start(cls, env: Mapping[str, str]) -> MpsDaemon:
        """Start a daemon for the processes that will be given :attr:`env` (``env``: the environment
        it starts in). LaunchError if the binary is missing, exits with an error, or writes no pid
        file within :data:`START_TIMEOUT` seconds; the error carries the daemon's log."""
        control = control_binary(env)
        # the pipe directory holds unix sockets, and their paths must stay under 108 bytes
        root = Path(tempfile.mkdtemp(prefix="fm-", dir="/tmp" if os.path.isdir("/tmp") else None))
        daemon = cls(control, root, 0)
        for sub in ("pipe", "log"):
            (root / sub).mkdir()
        try:
            # output into a file, not a pipe: the daemon forks and may keep the descriptors open
            with (root / "log" / "start.out").open("wb") as out:
                code = subprocess.call([control, "-d"], env={**env, **daemon.env},  # noqa: S603
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       timeout=START_TIMEOUT)
            if code != 0:
                raise LaunchError(f"{control} -d exited with status {code}{daemon.log_tail()}")
            daemon.pid = daemon._wait_for_pid(time.monotonic() + START_TIMEOUT)
            daemon.started = start_time(daemon.pid)
        except BaseException:
            daemon.stop()
            raise
        return daemon

    def _wait_for_pid(self, until: float) -> int:
        pid_file = self.root / "pipe" / PID_FILE
        while time.monotonic() < until:
            try:
                pid = int(pid_file.read_text().strip())
            except (OSError, ValueError):  # not there yet, or being written
                pid = 0
            if pid > 0 and same_process(pid):
                return pid
            time.sleep(0.05)
        raise LaunchError(f"{self.control} -d wrote no {PID_FILE} of a live process within "
                          f"{START_TIMEOUT:g} s{self.log_tail()}")

    def alive(self) -> bool:
        """Whether the daemon still runs."""
        return self.pid > 0 and self.started is not None and start_time(self.pid) == self.started

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the daemon's start output and control log, for an error message."""
        text = []
        for name in ("start.out", "control.log"):
            path = self.root / "log" / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                text += [f"{name}:", *(f"  {line}" for line in tail)]
        return (":\n" + "\n".join(text)) if text else " (it wrote no log)"

    def stop(self) -> tuple[int, ...]:
        """Send ``quit`` (the daemon then stops its MPS server once no client is left), wait for
        the daemon to end, SIGKILL it and its servers if it has not, and remove the directories.
        Returns every pid seen. Call it after the processes that use the daemon have stopped."""
        servers = descendants(self.pid) if self.alive() else set()  # (their start times are noted)

        def left() -> list[int]:
            return [pid for pid in servers if same_process(pid)] + ([self.pid] if self.alive() else [])

        if (self.root / "pipe").is_dir():  # also without a pid: a daemon that wrote none ends too
            try:
                subprocess.run([self.control], input=b"quit\n", env={**os.environ, **self.env},  # noqa: S603
                               capture_output=True, timeout=STOP_TIMEOUT)
            except (OSError, subprocess.TimeoutExpired):
                pass  # SIGKILL below
        if not _gone(left):
            for pid in left():
                kill_quietly(pid, signal.SIGKILL)
            _gone(left)
        shutil.rmtree(self.root, ignore_errors=True)
        return tuple(sorted(servers | ({self.pid} if self.pid > 0 else set())))


def _gone(left: Callable[[], list[int]]) -> bool:
    """Wait up to :data:`STOP_TIMEOUT` seconds for ``left()`` to be empty; whether it became so."""
    until = time.monotonic() + STOP_TIMEOUT
    while left():
        if time.monotonic() >= until:
            return False
        time.sleep(0.05)
    return True
