"""Run a Flower app to completion on a private, throw-away SuperLink (simulation mode).

``flwr run`` always talks to a SuperLink; with the default ``:local:`` connection it starts a
background SuperLink that keeps running, uses ``~/.flwr`` and fixed ports, installs the app's
dependencies for every run, and ``flwr run --stream`` exits 0 even when the run failed. This
module avoids all of that:

1. a temporary ``FLWR_HOME`` with a ``config.toml`` holding one connection (``fedact-launch``),
   so the user's ``~/.flwr`` and default SuperLink are never touched;
2. ``flower-superlink --insecure --simulation --disable-runtime-dependency-installation`` on a
   free loopback port (in Flower 1.41 the Control, Runtime (ServerAppIo) and Fleet APIs are all
   served over HTTP on that single ``--host/--port``; nothing else is bound by the SuperLink);
3. ``flwr run <app> fedact-launch --run-config <file.toml> --federation-config "..."
   --format json``;
4. ``flwr log <run> fedact-launch --stream`` (Flower ends the stream when the run finishes), with
   ``flwr ls fedact-launch --run-id <run> --format json`` as the source of truth for the status;
5. in ``finally``: SIGTERM, then SIGKILL, for the SuperLink and every process it spawned
   (SuperExec, ``flwr-simulation``, the Ray cluster), also on errors, timeouts, Ctrl-C and
   SIGTERM (turned into ``SystemExit`` while a run is in progress, main thread only).

Python use::

    from fedact_app.launch import run_simulation
    result = run_simulation(".", overrides="num_rounds=2", num_supernodes=3)
    assert result.completed, result.log

Command line (exit code 0 only when the run finished with sub-status ``completed``)::

    python -m fedact_app.launch --app . --overrides "num_rounds=2" --num-supernodes 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CONNECTION", "LaunchError", "RunResult", "pid_alive", "run_simulation", "supernodes_for"]

CONNECTION = "fedact-launch"  # name of the only connection in the private config.toml
STARTUP_TIMEOUT = 60.0  # seconds for the SuperLink to answer /health
CLI_TIMEOUT = 60.0  # seconds for one short flwr CLI call (run / ls)
STOP_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
BASE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class LaunchError(RuntimeError):
    """The SuperLink could not be started or the run could not be submitted."""


@dataclass
class RunResult:
    """Outcome of one run, as reported by the SuperLink."""

    run_id: int
    status: str  # as `flwr ls` reports it: "finished:completed", "finished:failed", "running", ...
    completed: bool  # True only for "finished:completed"
    log: str  # the run's log (ServerApp + simulation output), ANSI colours stripped
    seconds: float  # wall time of the whole call, SuperLink start and stop included
    details: str = ""  # `flwr ls` "status-details", e.g. "Simulation failed with exception: ..."
    timed_out: bool = False  # the run had not finished when `timeout` ran out
    superlink_pid: int = 0
    pids: tuple[int, ...] = field(default=(), repr=False)  # all processes of the SuperLink tree

    def tail(self, lines: int = 40) -> str:
        """Last ``lines`` lines of the log."""
        return "\n".join(self.log.splitlines()[-lines:])


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------
def run_simulation(  # noqa: PLR0913 - a flat, explicit signature reads best here
    app_dir: str | Path,
    overrides: str = "",
    num_supernodes: int = 2,
    num_cpus_per_client: int = 1,
    num_gpus_per_client: float = 0.0,
    run_config: Mapping[str, Any] | None = None,
    timeout: float = 600.0,
    flwr_home: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    *,
    federation_config: Mapping[str, Any] | None = None,
    cwd: str | Path | None = None,
    poll_interval: float = 10.0,
) -> RunResult:
    """Run the Flower app in ``app_dir`` on a private simulation SuperLink and wait for it.

    Parameters
    ----------
    app_dir: directory holding the app's ``pyproject.toml``.
    overrides: value of the app's ``overrides`` run-config key (a string of Hydra overrides);
        sent only when non-empty, so an app without that key works with the default.
    num_supernodes, num_cpus_per_client, num_gpus_per_client: simulation federation
        (``--federation-config num-supernodes=... client-resources-num-cpus=...
        client-resources-num-gpus=...``). Flower's proto field for CPUs is an integer.
        ClientApps see no GPU unless ``num_gpus_per_client > 0``.
    run_config: further run-config keys (must exist in ``[tool.flwr.app.config]``).
    timeout: seconds for the whole call; an unfinished run is reported with ``timed_out=True``.
    flwr_home: FLWR_HOME to use (kept afterwards); default: a temporary one, deleted afterwards.
    env: extra environment for the flwr CLI and the SuperLink (and so the ServerApp/ClientApps).
    federation_config: extra ``--federation-config`` keys, e.g. ``{"init-args-num-cpus": 2}``.
    cwd: working directory of the SuperLink and hence of the running app (default: the
        caller's). Apps should resolve their paths to absolute ones anyway.
    poll_interval: seconds between ``flwr ls`` checks while the log stream is open.

    Raises
    ------
    LaunchError: the SuperLink did not start or ``flwr run`` did not accept the run.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    app_path = Path(app_dir).expanduser().resolve()
    if not (app_path / "pyproject.toml").is_file():
        raise ValueError(f"{app_path} has no pyproject.toml; not a Flower app directory")
    if int(num_supernodes) < 1:
        raise ValueError("num_supernodes must be >= 1")
    if float(num_cpus_per_client) != int(num_cpus_per_client) or int(num_cpus_per_client) < 1:
        raise ValueError("num_cpus_per_client must be a positive integer (Flower's proto is int)")

    own_home = flwr_home is None
    home = Path(tempfile.mkdtemp(prefix="fedact-flwr-")) if own_home else Path(flwr_home)
    home = home.expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **BASE_ENV, **(env or {}), "FLWR_HOME": str(home)}

    link: _SuperLink | None = None
    restore = _exit_on_termination()
    try:
        link = _SuperLink.start(home, full_env, Path(cwd) if cwd else Path.cwd(), deadline)
        _write_connection(home, link.port)
        cli = _Cli(home, full_env)

        config = dict(run_config or {})
        if overrides:
            config["overrides"] = overrides
        fed = {
            "num-supernodes": int(num_supernodes),
            "client-resources-num-cpus": int(num_cpus_per_client),
            "client-resources-num-gpus": float(num_gpus_per_client),
            **(federation_config or {}),
        }
        run_id = cli.submit(app_path, config, fed, link)
        status, details, log, timed_out = _wait_for_run(cli, link, run_id, deadline, poll_interval)
    finally:
        pids: tuple[int, ...] = ()
        try:
            if link is not None:
                pids = link.stop()
            if own_home:
                shutil.rmtree(home, ignore_errors=True)
        finally:
            restore()

    return RunResult(
        run_id=run_id,
        status=status,
        completed=status == "finished:completed",
        log=log,
        seconds=time.monotonic() - t0,
        details=details,
        timed_out=timed_out,
        superlink_pid=link.pid,
        pids=pids,
    )


def pid_alive(pid: int) -> bool:
    """True if ``pid`` names a live process (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_state(pid) not in ("Z", "X", None) if Path("/proc").is_dir() else True


# --------------------------------------------------------------------------------------------
# SuperLink process
# --------------------------------------------------------------------------------------------
@dataclass
class _SuperLink:
    proc: subprocess.Popen[bytes]
    port: int
    log_file: Path
    seen: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, home: Path, env: dict[str, str], cwd: Path, deadline: float) -> _SuperLink:
        """Start on a free loopback port; retry with another port if it dies while starting."""
        errors = []
        for attempt in range(3):
            port = free_port()
            log_file = home / f"superlink-{port}.log"
            cmd = [
                flower_executable("flower-superlink"),
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
        return _ANSI.sub("", text)[-chars:]

    def stop(self) -> tuple[int, ...]:
        """Stop the SuperLink and everything it spawned; return all pids seen.

        SIGTERM to the SuperLink lets it stop its SuperExec, but a ``flwr-simulation`` process
        and its Ray cluster (own process group, under the SuperExec) survive it. So: snapshot
        the process tree, SIGTERM the SuperLink, then SIGTERM and finally SIGKILL whatever of the
        tree (and of the tree's process groups) is left.
        """
        self._snapshot()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                self._snapshot()
                self.proc.kill()
                self.proc.wait()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self._signal_leftovers(sig):
                break
            until = time.monotonic() + STOP_GRACE
            while time.monotonic() < until and any(pid_alive(p) for p in self.seen):
                time.sleep(0.1)
        return tuple(sorted(self.seen | {self.pid}))

    def _snapshot(self) -> None:
        self.seen |= descendants(self.pid)

    def _signal_leftovers(self, sig: int) -> bool:
        own_group = os.getpgrp()
        alive = [p for p in self.seen if pid_alive(p)]
        groups = {g for p in alive if (g := _pgid(p)) is not None and g != own_group}
        for pid in alive:  # their children too, before they are re-parented away
            self.seen |= descendants(pid)
        for target in sorted(self.seen):
            if pid_alive(target):
                kill_quietly(target, sig)
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        return bool(alive)


# --------------------------------------------------------------------------------------------
# flwr CLI
# --------------------------------------------------------------------------------------------
@dataclass
class _Cli:
    home: Path
    env: dict[str, str]

    def call(self, *args: str, timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(  # noqa: S603
            [flower_executable("flwr"), *args],
            cwd=self.home,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=max(timeout, 1.0),
            check=False,
        )

    def submit(
        self, app: Path, run_config: dict[str, Any], fed: dict[str, Any], link: _SuperLink
    ) -> int:
        args = ["run", str(app), CONNECTION, "--format", "json"]
        if run_config:
            # A TOML file sidesteps all shell/regex quoting of `--run-config "k='v'"`.
            cfg = self.home / "run_config.toml"
            cfg.write_text(_toml(run_config), encoding="utf-8")
            args += ["--run-config", str(cfg)]
        args += ["--federation-config", " ".join(f"{k}={_toml_value(v)}" for k, v in fed.items())]
        proc = self.call(*args)
        payload = _json_payload(proc.stdout)
        if proc.returncode != 0 or not payload.get("success") or payload.get("run-id") is None:
            raise LaunchError(
                f"`flwr {' '.join(args)}` did not start a run (rc={proc.returncode}):\n"
                f"{_ANSI.sub('', payload.get('error-message') or proc.stdout)}\n"
                f"{_ANSI.sub('', proc.stderr)[-3000:]}\n--- SuperLink output ---\n"
                f"{link.output_tail()}"
            )
        return int(payload["run-id"])

    def status(self, run_id: int) -> tuple[str, str]:
        """(status, status-details) from `flwr ls --run-id`; ("unknown", why) on a failure."""
        try:
            proc = self.call("ls", CONNECTION, "--run-id", str(run_id), "--format", "json")
        except subprocess.TimeoutExpired:
            return "unknown", "flwr ls timed out"
        payload = _json_payload(proc.stdout)
        runs = payload.get("runs") or []
        if not payload.get("success") or not runs:
            why = payload.get("error-message") or proc.stdout + proc.stderr
            return "unknown", _ANSI.sub("", str(why)).strip()[-500:]
        return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", ""))

    def open_log_stream(self, run_id: int, out: Path) -> subprocess.Popen[bytes]:
        with out.open("wb") as fh:
            return subprocess.Popen(  # noqa: S603
                [flower_executable("flwr"), "log", str(run_id), CONNECTION, "--stream"],
                cwd=self.home,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.DEVNULL,
            )


def _wait_for_run(
    cli: _Cli, link: _SuperLink, run_id: int, deadline: float, poll_interval: float
) -> tuple[str, str, str, bool]:
    """Follow the run until it finishes or the deadline passes: (status, details, log, timed_out).

    The `flwr log --stream` process ends by itself once the run is finished (the server closes
    the stream), so it is both the log collector and the cheap "maybe finished" signal;
    `flwr ls` is asked when the stream ends and every ``poll_interval`` seconds as a safety net.
    """
    log_path = cli.home / f"run-{run_id}.log"
    streamer = cli.open_log_stream(run_id, log_path)
    status, details = "unknown", ""
    try:
        next_poll = time.monotonic() + poll_interval
        while time.monotonic() < deadline:
            if link.proc.poll() is not None:
                details = f"the SuperLink exited (rc={link.proc.returncode}):\n{link.output_tail()}"
                break
            ended = streamer.poll() is not None
            if ended or time.monotonic() >= next_poll:
                status, details = cli.status(run_id)
                next_poll = time.monotonic() + poll_interval
                if status.startswith("finished"):
                    break
                if ended:  # stream ended early (e.g. run not started yet): follow it again
                    time.sleep(1.0)
                    streamer = cli.open_log_stream(run_id, log_path)
                    continue
            time.sleep(0.25)
        finished = status.startswith("finished")
        timed_out = not finished and time.monotonic() >= deadline
        if finished:  # the server ends the stream right after the final log lines
            try:
                streamer.wait(timeout=max(1.0, min(30.0, deadline - time.monotonic() + 10)))
            except subprocess.TimeoutExpired:
                pass
    finally:
        if streamer.poll() is None:
            streamer.kill()
            streamer.wait()
    log = log_path.read_text(encoding="utf-8", errors="replace") if log_path.exists() else ""
    if finished and not log.strip():  # the stream died early: fetch the finished run's log once
        try:
            log = cli.call("log", str(run_id), CONNECTION, "--stream").stdout
        except subprocess.TimeoutExpired as err:
            log = _text(err.stdout)
    return status, details, _ANSI.sub("", log), timed_out


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------
def _exit_on_termination() -> Callable[[], None]:
    """Make SIGTERM/SIGHUP raise SystemExit (so ``finally`` stops the SuperLink) while a run is
    in progress; return a function restoring the previous handlers.

    Python's default for these signals kills the process without unwinding, which would leave the
    SuperLink, flwr-simulation and the Ray cluster running (seen). Only handlers still at the
    default are replaced, and only in the main thread (Python allows no other).
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    raised = False

    def handler(signum: int, _frame: Any) -> None:
        nonlocal raised
        if not raised:  # a repeated signal must not interrupt the clean-up itself
            raised = True
            raise SystemExit(128 + signum)

    previous = {}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            previous[sig] = signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def _write_connection(home: Path, port: int) -> None:
    """The private Flower config: one connection, also the default, to our SuperLink."""
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n',
        encoding="utf-8",
    )


def flower_executable(name: str) -> str:
    """The Flower console script from this interpreter's environment, else from PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise LaunchError(f"`{name}` not found next to {sys.executable} or on PATH")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    raise TypeError(f"unsupported run-config value {value!r} ({type(value).__name__})")


def _toml(config: Mapping[str, Any], prefix: str = "") -> str:
    """Flat TOML for a run config; nested mappings become dotted keys (Flower flattens them)."""
    lines = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            lines.append(_toml(value, f"{name}."))
        else:
            lines.append(f"{json.dumps(name)} = {_toml_value(value)}")
    return "\n".join(line for line in lines if line) + ("\n" if not prefix else "")


def _json_payload(stdout: str) -> dict[str, Any]:
    start = stdout.find("{")
    if start < 0:
        return {}
    try:
        payload = json.loads(stdout[start:])
    except json.JSONDecodeError:
        return {}
    return payload if isinstance(payload, dict) else {}


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def kill_quietly(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``, ignoring processes that are gone or not ours."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def descendants(root: int) -> set[int]:
    """All current descendants of ``root`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*") if Path("/proc").is_dir() else ():
        try:
            ppid = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _parse_run_config(items: Iterable[str]) -> dict[str, Any]:
    """``key=value`` pairs; values are parsed as TOML (numbers, booleans, quoted strings),
    anything that is not valid TOML is taken as a plain string."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    config: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--run-config expects key=value, got {item!r}")
        try:
            config[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            config[key] = raw
    return config


def supernodes_for(app: Path, overrides: str, requested: int | None) -> int:
    """The number of SuperNodes to simulate. For a FedACT app (a checkout with
    ``fedact_app/config.py`` and ``conf/config.yaml``) the overrides are composed here first, so a
    bad key or value fails in a second with its message (ValueError) instead of inside the run;
    so do the values naming files (:func:`check_local_files`). There is one SuperNode per client:
    ``num_clients`` by default; another number is refused, since every ClientApp would refuse the
    run. Another app: ``requested``, default 2."""
    if not ((app / "fedact_app" / "config.py").is_file() and (app / "conf" / "config.yaml").is_file()):
        return 2 if requested is None else requested
    from fedact_app.config import compose  # Hydra: only for the app's own configuration

    try:
        cfg = compose(overrides, conf_dir=app / "conf")
    except Exception as err:  # noqa: BLE001 - ConfigError and Hydra's composition and type errors
        cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
        raise ValueError(f"{err}{cause}".strip()) from None
    check_local_files(cfg)
    if requested is not None and requested != cfg.num_clients:
        raise ValueError(f"--num-supernodes {requested} differs from num_clients={cfg.num_clients}: "
                         f"each SuperNode is one client; pass --num-supernodes {cfg.num_clients}, or "
                         f"num_clients={requested} in --overrides")
    return cfg.num_clients


def check_local_files(cfg: Any) -> None:
    """ConfigError (a ValueError) for a FedACT config's values that name files this machine lacks:
    ``resume`` (the checkpoint.resolve_resume check the ServerApp makes) and, for ``task=vision``,
    ``dataset.path`` (tasks.vision.splits.check_local_path). ``compose()`` cannot check them, since on a SuperNode
    they name that node's files; in simulation the ServerApp and every ClientApp run here, with
    the launcher's working directory. Language tasks' local files are not checked here."""
    if cfg.resume is not None:
        from fedact_app.checkpoint import resolve_resume

        resolve_resume(cfg.resume)
    if cfg.task == "vision" and cfg.dataset.path is not None:
        from fedact_app.tasks.vision.splits import check_local_path  # datasets: ~0.6 s, only when there is a path

        check_local_path(cfg.dataset)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedact_app.launch",
        description="Run a Flower app on a private simulation SuperLink; exit 0 only if the "
        "run finished with status completed.",
    )
    parser.add_argument("--app", default=".", help="Flower app directory (default: .)")
    parser.add_argument("--overrides", default="", help="value of the app's `overrides` key")
    parser.add_argument("--num-supernodes", type=int, default=None,
                        help="SuperNodes, one per client (default: num_clients of this FedACT app's "
                             "config with the overrides; 2 for another app)")
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs per ClientApp")
    parser.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per ClientApp")
    parser.add_argument(
        "--run-config", action="append", default=[], metavar="KEY=VALUE",
        help="another run-config key (repeatable)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds (default 3600)")
    parser.add_argument("--flwr-home", default=None, help="FLWR_HOME to use and keep")
    parser.add_argument("--tail", type=int, default=60, help="log lines to print (0: all)")
    parser.add_argument("--log-file", default=None, help="also write the full run log here")
    args = parser.parse_args(argv)
    try:
        run_config = _parse_run_config(args.run_config)
    except argparse.ArgumentTypeError as err:
        parser.error(str(err))

    try:
        submitted = args.overrides or str(run_config.get("overrides", ""))  # what run_simulation sends
        num_supernodes = supernodes_for(Path(args.app), submitted, args.num_supernodes)
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    try:
        result = run_simulation(
            args.app,
            overrides=args.overrides,
            num_supernodes=num_supernodes,
            num_cpus_per_client=args.num_cpus,
            num_gpus_per_client=args.num_gpus,
            run_config=run_config,
            timeout=args.timeout,
            flwr_home=args.flwr_home,
        )
    except (LaunchError, ValueError) as err:
        print(f"launch error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the SuperLink was already stopped by run_simulation's finally
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as err:  # SIGTERM/SIGHUP, after the same clean-up
        print("terminated", file=sys.stderr)
        return int(err.code or 1)

    if args.log_file:
        Path(args.log_file).write_text(result.log, encoding="utf-8")
    print(result.log if args.tail == 0 else result.tail(args.tail))
    print(
        f"run {result.run_id}: {result.status}"
        + (f" ({result.details})" if result.details not in ("", "N/A") else "")
        + (" [timed out]" if result.timed_out else "")
        + f" in {result.seconds:.1f} s"
    )
    return 0 if result.completed else 1


if __name__ == "__main__":
    sys.exit(main())
