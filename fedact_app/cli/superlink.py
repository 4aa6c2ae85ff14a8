"""A private simulation SuperLink process for :mod:`.engine`: started on a free loopback port
(``flower-superlink --insecure --simulation --disable-runtime-dependency-installation``; in Flower
1.41 the Control, Runtime (ServerAppIo) and Fleet APIs are all served over HTTP on that single
``--host/--port``), ready once it answers ``/health``, and stopped with everything it spawned."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from fedact_app.cli.flwr import LaunchError, console_script, free_port, strip_ansi
from fedact_app.cli.procs import descendants, stop_tree

STARTUP_TIMEOUT = 60.0  # seconds for the SuperLink to answer /health
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL


@dataclass
class SimulationSuperLink:
    """A running ``flower-superlink`` (simulation mode) and the pids of its process tree seen so far."""

    proc: subprocess.Popen[bytes]
    port: int
    log_file: Path
    seen: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, home: Path, env: dict[str, str], cwd: Path, deadline: float) -> SimulationSuperLink:
        """Start on a free loopback port; retry with another port if it dies while starting."""
        errors = []
        for attempt in range(3):
            port = free_port()
            log_file = home / f"superlink-{port}.log"
            cmd = [
                console_script("flower-superlink"),
                "--insecure",
                "--simulation",
                "--disable-runtime-dependency-installation",
                "--host", "127.0.0.1",
                "--port", str(port),
                "--log-file", str(log_file),
            ]  # fmt: skip
            with (home / f"superlink-{port}.out").open("wb") as out:
                proc = subprocess.Popen(  # noqa: S603
                    cmd,
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # own process group: Ctrl-C reaches us, we clean up
                )
            link = cls(proc, port, log_file)
            try:
                if link._wait_ready(min(deadline, time.monotonic() + STARTUP_TIMEOUT)):
                    return link
            except BaseException:
                link.stop()
                raise
            link.stop()
            errors.append(f"attempt {attempt + 1} (port {port}): {link.output_tail()}")
            if time.monotonic() >= deadline:
                break
        raise LaunchError("flower-superlink did not become ready:\n" + "\n".join(errors))

    def _wait_ready(self, until: float) -> bool:
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310 - loopback
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        return False

    def output_tail(self, chars: int = 3000) -> str:
        out = self.log_file.with_suffix(".out")
        text = out.read_text(encoding="utf-8", errors="replace") if out.exists() else ""
        return strip_ansi(text)[-chars:]

    def remember_children(self) -> None:
        """Note the processes it spawned so far, so that they can be stopped even after it died."""
        if self.proc.poll() is None:
            self.seen |= descendants(self.pid)

    def stop(self, kill_at_once: bool = False) -> tuple[int, ...]:
        """Stop the SuperLink and everything it spawned; return all pids seen.

        SIGTERM to the SuperLink lets it stop its SuperExec, but a ``flwr-simulation`` process
        and its Ray cluster (own process group, under the SuperExec) survive it; so the whole tree
        is stopped (:func:`fedact_app.cli.procs.stop_tree`; ``kill_at_once``: SIGKILL only).
        """
        return stop_tree(self.proc, self.seen, 0.0 if kill_at_once else STOP_GRACE)
