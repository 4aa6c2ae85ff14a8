"""The ``flwr`` CLI and the Control API, driven the one way both the local engine (:mod:`.engine`)
and ``scripts/deploy/local_cluster.py`` need them.

- :func:`console_script`, :func:`free_port` - Flower's console scripts, a free loopback port;
- :func:`write_connection` - a ``FLWR_HOME/config.toml`` holding one connection, also the default
  (insecure, or TLS with a CA certificate), so the user's ``~/.flwr`` is never touched;
- :func:`run_flwr` - one bounded ``flwr`` call with that ``FLWR_HOME``; :func:`json_payload` - the
  JSON object of its ``--format json`` output;
- :func:`toml_value`, :func:`toml_table` - run-config values as TOML (a run config is passed as a
  file, which sidesteps all shell/regex quoting of ``--run-config "k='v'"``);
- :func:`submit_run` (``flwr run``), :func:`run_status` (``flwr ls --run-id``), :class:`ControlClient`
  (the same status from this process) and :func:`follow_run`: ``flwr log --stream`` until the run
  finishes, with the status as the source of truth (``flwr run --stream`` exits 0 even for a failed
  run).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLI_TIMEOUT = 60.0  # seconds for one short flwr CLI call (run / ls / register)
BASE_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class LaunchError(RuntimeError):
    """A Flower process or a ``flwr`` command could not be started, or did not start the run."""


def strip_ansi(text: Any) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI.sub("", str(text))


def console_script(name: str) -> str:
    """A console script (flwr, flower-superlink, ray) from this interpreter's environment, else from PATH."""
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


def write_connection(home: Path, name: str, address: str, *, root_certificates: Path | None = None,
                     header: str = "") -> None:
    """``home/config.toml``: the one connection ``name`` (also the default) to ``address``; TLS
    trusting ``root_certificates`` when given, else insecure. ``header``: comment lines on top."""
    home.mkdir(parents=True, exist_ok=True)
    security = (f'root-certificates = "{root_certificates.resolve()}"\n' if root_certificates is not None
                else "insecure = true\n")
    (home / "config.toml").write_text(
        f'{header}[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{address}"\n{security}',
        encoding="utf-8",
    )


def flwr_env(home: Path, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment, :data:`BASE_ENV`, ``env`` and ``FLWR_HOME=home``."""
    return {**os.environ, **BASE_ENV, **(env or {}), "FLWR_HOME": str(home)}


def run_flwr(home: Path, args: tuple[str, ...] | list[str], *, env: Mapping[str, str] | None = None,
             timeout: float = CLI_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """``flwr ARGS`` with ``FLWR_HOME=home`` (also its working directory), bounded by ``timeout``
    (``subprocess.TimeoutExpired`` past it)."""
    return subprocess.run(  # noqa: S603
        [console_script("flwr"), *args], cwd=home, env=flwr_env(home, env), capture_output=True,
        text=True, timeout=max(timeout, 1.0), check=False)


def json_payload(stdout: str) -> dict[str, Any]:
    """The JSON object a ``flwr ... --format json`` call printed ({} when there is none)."""
    start = stdout.find("{")
    if start < 0:
        return {}
    try:
        payload = json.loads(stdout[start:])
    except json.JSONDecodeError:
        return {}
    return payload if isinstance(payload, dict) else {}


def toml_value(value: Any) -> str:
    """A run-config value as TOML; TypeError for anything but a bool, number or string."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    raise TypeError(f"unsupported run-config value {value!r} ({type(value).__name__})")


def toml_table(config: Mapping[str, Any], prefix: str = "") -> str:
    """Flat TOML for a run config; nested mappings become dotted keys (Flower flattens them)."""
    lines = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            lines.append(toml_table(value, f"{name}."))
        else:
            lines.append(f"{json.dumps(name)} = {toml_value(value)}")
    return "\n".join(line for line in lines if line) + ("\n" if not prefix else "")


def submit_run(home: Path, app: Path, connection: str, run_config: Mapping[str, Any], *,
               federation_config: Mapping[str, Any] | None = None,
               env: Mapping[str, str] | None = None) -> int:
    """``flwr run <app> <connection> [--run-config <file>] [--federation-config ...] --format json``;
    the run id, or LaunchError with what ``flwr`` said. The run config goes through a TOML file in
    ``home``, removed afterwards."""
    args = ["run", str(app), connection, "--format", "json"]
    config_file = None
    if run_config:
        with tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="run-config-", dir=home, delete=False,
                                         encoding="utf-8") as fh:
            fh.write(toml_table(run_config))
        config_file = Path(fh.name)
        args += ["--run-config", str(config_file)]
    if federation_config:
        args += ["--federation-config", " ".join(f"{k}={toml_value(v)}" for k, v in federation_config.items())]
    try:
        proc = run_flwr(home, args, env=env)
    finally:
        if config_file is not None:
            config_file.unlink(missing_ok=True)
    payload = json_payload(proc.stdout)
    if proc.returncode != 0 or not payload.get("success") or payload.get("run-id") is None:
        raise LaunchError(
            f"`flwr {' '.join(args)}` did not start a run (rc={proc.returncode}):\n"
            f"{strip_ansi(payload.get('error-message') or proc.stdout)}\n{strip_ansi(proc.stderr)[-3000:]}"
        )
    return int(payload["run-id"])


def run_status(home: Path, connection: str, run_id: int | str, *, env: Mapping[str, str] | None = None
               ) -> tuple[str, str]:
    """(status, status-details) from ``flwr ls --run-id``, e.g. ("finished:completed", ""); ("unknown",
    why) when ``flwr ls`` fails."""
    try:
        proc = run_flwr(home, ["ls", connection, "--run-id", str(run_id), "--format", "json"], env=env)
    except subprocess.TimeoutExpired:
        return "unknown", "flwr ls timed out"
    payload = json_payload(proc.stdout)
    runs = payload.get("runs") or []
    if not payload.get("success") or not runs:
        why = payload.get("error-message") or proc.stdout + proc.stderr
        return "unknown", strip_ansi(why).strip()[-500:]
    return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", ""))


class ControlClient:
    """Flower's Control API of a local, insecure SuperLink, called from this process: a run's status
    in milliseconds, where each ``flwr ls`` is a new Python process (about 1 CPU-second, taken from
    the runs on a small machine). Flower 1.41's own client (``flwr.supercore.control``), as its CLI
    uses it."""

    def __init__(self, address: str) -> None:
        from flwr.supercore.control import ControlHttpClient
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

        self._client = ControlHttpClient.from_server_address(
            server_address=address, insecure=True, root_certificates=None,
            interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI")])

    def stop_run(self, run_id: int | str) -> None:
        """Ask the SuperLink to stop a run (``flwr stop``); a failure is ignored (the caller goes on
        as if the run had not stopped)."""
        from flwr.proto.control_pb2 import StopRunRequest

        try:
            self._client.StopRun(StopRunRequest(run_id=int(run_id)))
        except Exception:  # noqa: BLE001, S110 - see above
            pass

    def close(self) -> None:
        self._client.close()

    def run_status(self, run_id: int | str) -> tuple[str, str]:
        """(status, status-details) as ``flwr ls`` gives them; ("unknown", why) when the call fails."""
        from flwr.proto.control_pb2 import ListRunsRequest

        try:
            runs = self._client.ListRuns(ListRunsRequest(run_id=int(run_id))).run_dict
        except Exception as err:  # noqa: BLE001 - any failure of the call reads as "not known yet"
            return "unknown", f"{type(err).__name__}: {err}"[-500:]
        if int(run_id) not in runs:
            return "unknown", f"run {run_id} not listed"
        status = runs[int(run_id)].status
        return (f"{status.status}:{status.sub_status}" if status.sub_status else status.status), status.details


@dataclass
class FollowedRun:
    """What :func:`follow_run` saw: the last status it was given, its details (or why following
    stopped), the run's log (colours stripped) and whether the deadline passed first."""

    status: str
    details: str
    log: str
    timed_out: bool

    @property
    def finished(self) -> bool:
        return self.status.startswith("finished")


def follow_run(  # noqa: PLR0913 - the caller's connection, files and clocks
    home: Path, connection: str, run_id: int | str, log_path: Path, *, deadline: float,
    poll_interval: float, env: Mapping[str, str] | None = None,
    superlink_gone: Callable[[], str | None] = lambda: None, stream_stderr: int = subprocess.DEVNULL,
    status_of: Callable[[int | str], tuple[str, str]] | None = None,
) -> FollowedRun:
    """Follow a run until it finishes or ``deadline`` (``time.monotonic()``) passes, its log going to
    ``log_path``.

    The ``flwr log --stream`` process ends by itself once the run is finished (the server closes the
    stream), so it is both the log collector and the cheap "maybe finished" signal; the status is
    asked when the stream ends and every ``poll_interval`` seconds as a safety net. A stream that ends before the run does (not started yet, a
    hiccup) is opened again; it replays the log from the start. ``superlink_gone()`` says why
    following is pointless (the SuperLink exited), None while it is not; ``stream_stderr`` is where
    the stream's stderr goes (``subprocess.STDOUT``: into the log). ``status_of(run_id)`` gives the
    status (default: :func:`run_status`, a ``flwr ls`` process, about a CPU-second each; a local
    engine passes :meth:`ControlClient.run_status`, cheap enough to ask every half second).
    """
    if status_of is None:
        def status_of(run: int | str) -> tuple[str, str]:
            return run_status(home, connection, run, env=env)

    def follow() -> subprocess.Popen[bytes]:
        with log_path.open("wb") as out:
            return subprocess.Popen(  # noqa: S603
                [console_script("flwr"), "log", str(run_id), connection, "--stream"], cwd=home,
                env=flwr_env(home, env), stdin=subprocess.DEVNULL, stdout=out, stderr=stream_stderr)

    streamer = follow()
    status, details = "unknown", ""
    try:
        next_poll = time.monotonic() + poll_interval
        while time.monotonic() < deadline:
            why = superlink_gone()
            if why is not None:
                details = why
                break
            ended = streamer.poll() is not None
            if ended or time.monotonic() >= next_poll:
                status, details = status_of(run_id)
                next_poll = time.monotonic() + poll_interval
                if status.startswith("finished"):
                    break
                if ended:
                    time.sleep(1.0)
                    streamer = follow()
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
            log = run_flwr(home, ["log", str(run_id), connection, "--stream"], env=env).stdout
        except subprocess.TimeoutExpired as err:
            log = err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or ""
    return FollowedRun(status, details, strip_ansi(log), timed_out)
