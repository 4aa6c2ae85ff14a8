"""A private CUDA MPS control daemon, so that simulated clients sharing a GPU can run their kernels
side by side.

Without MPS, every ClientApp process that trains on a GPU has its own CUDA context, and the GPU
runs one context at a time (time slices). Ten Ray actors sharing one GPU take turns, so a round
is no faster than ten clients trained one after another (docs/PERFORMANCE.md). Under NVIDIA's
Multi-Process Service, the processes' kernels go through one server and one shared context: the
kernels of one client can run in the gaps that another client's kernel launches leave. The price:
a fatal GPU fault in one client ends every client of that server.

A CUDA process uses MPS when a control daemon answers in the directory named by
``CUDA_MPS_PIPE_DIRECTORY``; when none answers there, the process runs as it would without MPS
(nvidia-cuda-mps-control(1)). :meth:`MpsDaemon.start` runs ``nvidia-cuda-mps-control -f`` (the
daemon in the foreground, so its pid is known without its pid file) in a session of its own, with
its own pipe and log directories:

- it serves only the processes given :attr:`MpsDaemon.env` (the engine's SuperLink and Ray
  cluster, and so their ServerApps and ClientApps);
- it leaves alone any daemon that the machine already runs;
- it sees every GPU of the machine: ``CUDA_VISIBLE_DEVICES`` is taken out of its environment,
  since a daemon started with ``CUDA_VISIBLE_DEVICES=1`` numbers that GPU 0, and Ray's actors,
  which keep the machine's numbering, would then name a GPU it does not have;
- :meth:`MpsDaemon.stop` ends it with ``quit``, and kills it and its servers if they are still
  there after :data:`STOP_TIMEOUT`.

Nothing here changes the GPU's settings (compute mode, MIG).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fedact_app.cli.flwr import LaunchError
from fedact_app.cli.procs import KILLED_WAIT, descendants, kill_quietly, same_process

CONTROL = "nvidia-cuda-mps-control"
SOCKET = "control"  # the daemon's socket in the pipe directory, made once it listens
START_TIMEOUT = 10.0  # seconds for the daemon to listen
STOP_TIMEOUT = 10.0  # seconds for ``quit`` to be taken, as many for the daemon to end; then SIGKILL
HELP = ("clients sharing a GPU can run their kernels side by side under a private CUDA MPS daemon "
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
    proc: subprocess.Popen[bytes] | None = None
    listening: bool = False  # its socket has been seen
    servers: set[int] = field(default_factory=set)  # its descendants seen (MPS servers), start times noted

    @property
    def env(self) -> dict[str, str]:
        """What a process needs in its environment to use this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}

    @classmethod
    def start(cls, env: Mapping[str, str]) -> MpsDaemon:
        """Start a daemon for the processes that will be given :attr:`env` (``env``: the environment
        it starts in, less ``CUDA_VISIBLE_DEVICES``). LaunchError if the binary is missing or
        cannot run, or the daemon ends or does not listen within :data:`START_TIMEOUT` seconds;
        the error carries the daemon's output and log."""
        control = control_binary(env)
        # the pipe directory holds unix sockets, and their paths must stay under 108 bytes
        root = Path(tempfile.mkdtemp(prefix="fedact-mps-", dir="/tmp" if os.path.isdir("/tmp") else None))
        daemon = cls(control, root)
        daemon_env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"} | daemon.env
        try:
            for sub in ("pipe", "log"):
                (root / sub).mkdir()
            with (root / "log" / "control.out").open("wb") as out:
                daemon.proc = subprocess.Popen([control, "-f"], env=daemon_env,  # noqa: S603
                                               stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                               start_new_session=True)
            daemon._wait_ready(time.monotonic() + START_TIMEOUT)
        except OSError as err:
            daemon.stop()
            raise LaunchError(f"{control} -f cannot run: {err}") from err
        except BaseException:
            daemon.stop()
            raise
        return daemon

    def _wait_ready(self, until: float) -> None:
        pipe = self.root / "pipe"
        while time.monotonic() < until:
            if self.proc is not None and self.proc.poll() is not None:
                raise LaunchError(f"{self.control} -f ended with status {self.proc.returncode}{self.log_tail()}")
            try:
                self.listening = stat.S_ISSOCK(os.stat(pipe / SOCKET).st_mode)
            except OSError:  # not there yet
                pass
            if self.listening:
                return
            time.sleep(0.05)
        raise LaunchError(f"{self.control} -f did not listen in {pipe} within {START_TIMEOUT:g} s{self.log_tail()}")

    def alive(self) -> bool:
        """Whether the daemon still runs."""
        return self.proc is not None and self.proc.poll() is None

    def remember_children(self) -> None:
        """Note the daemon's descendants (its MPS servers), so that :meth:`stop` finds them even
        after the daemon died and they were re-parented (the engine calls it whenever it checks
        its processes; a server started after the last call, whose daemon then died, is missed)."""
        if self.alive():
            self.servers |= descendants(self.proc.pid)

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the daemon's output and control log, for an error message."""
        text = []
        for name in ("control.out", "control.log"):
            path = self.root / "log" / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                text += [f"{name}:", *(f"  {line}" for line in tail)]
        return (":\n" + "\n".join(text)) if text else " (it wrote no output)"

    def stop(self) -> tuple[int, ...]:
        """Send ``quit`` (the daemon then stops its MPS servers once no client is left), wait for
        the daemon to end, SIGKILL it, its session and its servers if they have not, and remove
        the directories. Returns every pid seen. A daemon that never listened gets SIGKILL at once.
        Call it after the processes that use the daemon have stopped; a second call does nothing."""
        self.remember_children()
        proc = self.proc
        if proc is not None and proc.poll() is None and self.listening:
            try:
                subprocess.run([self.control], input=b"quit\n", env={**os.environ, **self.env},  # noqa: S603
                               capture_output=True, timeout=STOP_TIMEOUT)
            except (OSError, subprocess.TimeoutExpired):
                pass  # SIGKILL below
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        if proc is not None and proc.poll() is None:
            _kill_session(proc.pid)
            proc.kill()
            try:
                proc.wait(timeout=KILLED_WAIT)
            except subprocess.TimeoutExpired:  # stuck in the driver: left, and its pid reported
                pass

        def left() -> list[int]:
            return [pid for pid in self.servers if same_process(pid)]

        if left():  # servers that outlived their daemon (their own session or group)
            for pid in left():
                kill_quietly(pid, signal.SIGKILL)
            _gone(left)
        shutil.rmtree(self.root, ignore_errors=True)
        return tuple(sorted(self.servers | ({proc.pid} if proc is not None else set())))


def _kill_session(leader: int) -> None:
    """SIGKILL the process group the daemon leads (its servers, unless they left it)."""
    try:
        os.killpg(leader, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _gone(left: Callable[[], list[int]]) -> None:
    """Wait until ``left()`` is empty, at most :data:`KILLED_WAIT` seconds."""
    until = time.monotonic() + KILLED_WAIT
    while left() and time.monotonic() < until:
        time.sleep(0.05)
