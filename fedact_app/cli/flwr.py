"""The ``flwr`` CLI and the Control API, driven the one way both the local engine (:mod:`.engine`)
and ``scripts/deploy/local_cluster.py`` need them.

- :func:`console_script`, :func:`free_port` - Flower's console scripts, a free loopback port;
- :func:`write_connection` - a ``FLWR_HOME/config.toml`` holding one connection, also the default
  (insecure, or TLS with a CA certificate), so the user's ``~/.flwr`` is never touched;
- :func:`run_flwr` - one bounded ``flwr`` call with that ``FLWR_HOME``; :func:`json_payload` - the
  JSON object of its ``--format json`` output;
- :func:`toml_value`, :func:`toml_table` - run-config values as TOML (a run config is passed as a
  file, which sidesteps all shell/regex quoting of ``--run-config "k='v'"``);
- :func:`submit_run` (``flwr run``), :func:`run_status` (``flwr ls --run-id``), :class:`CliLogStream`
  (``flwr log --stream``): each a new Python process, as a user runs them (a deployment with TLS);
- :class:`ControlClient`: the same three from this process through Flower's own Control API client
  (a local, insecure SuperLink: the engine's), without a Python process (about a CPU-second) each;
- :func:`follow_run`: a run's log stream until the run finishes, with the status as the source of
  truth (``flwr run --stream`` exits 0 even for a failed run).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

CLI_TIMEOUT = 60.0  # seconds for one short flwr CLI call (run / ls / register)
BASE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    # how often a SuperExec asks for work: Flower's default 1.0 s is waited at every run's start
    # and, in a deployment, at every message (0.5 s on average); each poll costs CPU all the time,
    # runs computing or not: idle, 6 % of a core at 0.1 s, 2.4 % at 0.25 s, 0.9 % at 1.0 s
    # (docs/PERFORMANCE.md, "Fixed settings of the engine")
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.25",
}
ENDED = "ended:completed"  # follow_run's status for a run whose app said it ended (its `ended` argument)
ENDED_DETAILS = "the ServerApp ended with its results written; Flower's shutdown of the run was not waited for"
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
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports free on ``host`` right now: each socket stays bound until all
    are chosen, since a port the OS handed out and got back may be handed out again at once (two
    of a Ray head's ports once came out equal, and it refused to start)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


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


def toml_loads(text: str) -> dict[str, Any]:
    """TOML text as a dict (``tomllib``; ``tomli`` before Python 3.11); ``TOMLDecodeError`` (a
    ValueError) for bad TOML."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: Flower's own dependency
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(text)


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


def _control_http_client(address: str) -> Any:
    """Flower 1.41's own Control API client (``flwr.supercore.control``) for a local, insecure
    SuperLink, made as its CLI makes it. Its transport, httpx, logs every request at INFO: a
    followed run's status is asked for twice a second, which a program logging at INFO (a sweep,
    through Hydra's logging) would print as most of its output. The ``httpx`` logger is set to
    WARNING unless it has a level of its own."""
    from flwr.supercore.control import ControlHttpClient
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

    httpx_logger = logging.getLogger("httpx")
    if httpx_logger.level == logging.NOTSET:
        httpx_logger.setLevel(logging.WARNING)

    return ControlHttpClient.from_server_address(
        server_address=address, insecure=True, root_certificates=None,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="flwr CLI")])


class LogStream(Protocol):
    """A run's log streamed into a file until the SuperLink ends the stream (at the end of the run).
    ``error``: why the stream ended early ("" when the server ended it, or while it is open)."""

    error: str

    def ended(self) -> bool:
        """True once the stream has ended (the run finished, or the stream broke)."""

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the stream to end."""

    def stop(self) -> None:
        """Write nothing more to the file (at once, whether or not the stream has ended)."""


class CliLogStream:
    """``flwr log RUN_ID CONNECTION --stream`` into ``log_path``, ``stderr`` where its stderr goes;
    :meth:`stop` kills the process."""

    def __init__(self, home: Path, connection: str, run_id: int | str, log_path: Path, *,
                 env: Mapping[str, str] | None = None, stderr: int = subprocess.DEVNULL) -> None:
        with log_path.open("wb") as out:
            self._proc = subprocess.Popen(  # noqa: S603
                [console_script("flwr"), "log", str(run_id), connection, "--stream"], cwd=home,
                env=flwr_env(home, env), stdin=subprocess.DEVNULL, stdout=out, stderr=stderr)

    @property
    def error(self) -> str:
        code = self._proc.poll()
        return f"`flwr log` exited with code {code}" if code else ""

    def ended(self) -> bool:
        return self._proc.poll() is not None

    def wait(self, timeout: float) -> None:
        try:
            self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


class ControlLogStream:
    """The Control API's StreamLogs into ``log_path``, read by a thread of this process: what
    ``flwr log --stream`` writes to its stdout (each reply's ``log_output``), without its process.

    The thread ends when the server ends the stream (the run finished) or the connection breaks.
    A thread blocked in a read cannot be woken from outside, so :meth:`stop` only makes it write
    nothing more; it ends with the run or its SuperLink (the engine stops a run past its timeout)."""

    def __init__(self, address: str, run_id: int | str, log_path: Path) -> None:
        self.error = ""
        self._stopped = threading.Event()
        self._done = threading.Event()
        threading.Thread(target=self._read, args=(address, int(run_id), log_path), daemon=True,
                         name=f"flwr-log-{run_id}").start()

    def _read(self, address: str, run_id: int, log_path: Path) -> None:
        from flwr.proto.control_pb2 import StreamLogsRequest

        client = _control_http_client(address)
        try:
            with log_path.open("w", encoding="utf-8") as out:
                for reply in client.StreamLogs(StreamLogsRequest(run_id=run_id, after_timestamp=0.0)):
                    if self._stopped.is_set():
                        break
                    out.write(reply.log_output)
                    out.flush()
        except Exception as err:  # noqa: BLE001 - any failure ends the stream; follow_run reopens it
            self.error = f"{type(err).__name__}: {err}"[-500:]
        finally:
            client.close()
            self._done.set()

    def ended(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> None:
        self._done.wait(timeout)

    def stop(self) -> None:
        self._stopped.set()


class ControlClient:
    """Flower's Control API of a local, insecure SuperLink, called from this process: a run started
    (:meth:`start_run`), its status (:meth:`run_status`) and its log (:meth:`log_stream`) without the
    ``flwr run``, ``flwr ls`` and ``flwr log`` processes, each about a CPU-second taken from the runs
    on a small machine. Flower 1.41's own client and request builders, as its CLI uses them."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._client = _control_http_client(address)

    def start_run(self, app: Path, run_config: Mapping[str, Any], *,
                  federation_config: Mapping[str, Any] | None = None) -> int:
        """What ``flwr run APP CONNECTION --run-config FILE --federation-config ...`` sends (the app's
        ``pyproject.toml`` checked, its FAB built, the run config read as :func:`toml_table`'s TOML);
        the run id, or LaunchError with Flower's message."""
        import hashlib

        import click
        from flwr.cli.build import build_fab_from_disk
        from flwr.cli.config_utils import load_and_validate
        from flwr.cli.utils import flwr_cli_exc_handler
        from flwr.common.config import flatten_dict
        from flwr.common.serde import fab_to_proto, user_config_to_proto
        from flwr.proto.control_pb2 import StartRunRequest
        from flwr.supercore.fab import Fab
        from flwr.supercore.utils import simulation_config_from_json

        try:
            load_and_validate(app / "pyproject.toml", check_module=False)  # the SuperExec imports it
            fab_bytes = build_fab_from_disk(app)
            federation = None
            if federation_config:
                parsed = toml_loads(toml_table(federation_config))
                federation = simulation_config_from_json({k.replace("-", "_"): v for k, v in parsed.items()})
            request = StartRunRequest(
                fab=fab_to_proto(Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})),
                override_config=user_config_to_proto(flatten_dict(toml_loads(toml_table(run_config)))),
                federation="", override_federation_config=federation, app_spec="")
            with flwr_cli_exc_handler():
                reply = self._client.StartRun(request)
        except (click.ClickException, ValueError) as err:
            message = err.format_message() if isinstance(err, click.ClickException) else str(err)
            raise LaunchError(f"the SuperLink did not start a run of {app}: {strip_ansi(message)}") from None
        if not reply.HasField("run_id"):
            raise LaunchError(f"the SuperLink did not start a run of {app}: no run id in its reply")
        return int(reply.run_id)

    def log_stream(self, run_id: int | str, log_path: Path) -> ControlLogStream:
        """The run's log streamed into ``log_path`` (:class:`ControlLogStream`)."""
        return ControlLogStream(self._address, run_id, log_path)

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
    open_stream: Callable[[], LogStream] | None = None,
    ended: Callable[[], str | None] | None = None,
) -> FollowedRun:
    """Follow a run until it finishes or ``deadline`` (``time.monotonic()``) passes, its log going to
    ``log_path``.

    The log stream ends by itself once the run is finished (the server closes it), so it is both
    the log collector and the cheap "maybe finished" signal; the status is asked when the stream
    ends and every ``poll_interval`` seconds as a safety net. A stream that ends before the run does
    (not started yet, a hiccup) is opened again; it replays the log from the start.
    ``superlink_gone()`` says why following is pointless (the SuperLink exited), None while it is
    not. ``status_of(run_id)`` gives the status (default: :func:`run_status`, a ``flwr ls`` process,
    about a CPU-second each) and ``open_stream()`` opens the log stream into ``log_path`` (default: a
    :class:`CliLogStream`, its stderr to ``stream_stderr``; ``subprocess.STDOUT``: into the log); a
    local engine passes :class:`ControlClient`'s, cheap enough to ask every half second. A finished
    run whose log came back empty has its whole log streamed once more into ``log_path``. An
    unfinished run's ``details`` also name why its log stream last broke, if it did. ``ended()``
    gives the run's log once the app has said that it ended with its results written and the log
    holds all that the app logged before (:mod:`fedact_app.serverapp_done`), None until then;
    following then stops at once with status :data:`ENDED` and that log, without waiting for
    Flower to shut the run down.
    """
    if status_of is None:
        def status_of(run: int | str) -> tuple[str, str]:
            return run_status(home, connection, run, env=env)
    if open_stream is None:
        def open_stream() -> LogStream:
            return CliLogStream(home, connection, run_id, log_path, env=env, stderr=stream_stderr)

    streamer = open_stream()
    status, details, stream_error, ended_log = "unknown", "", "", None
    try:
        next_poll = time.monotonic() + poll_interval
        while time.monotonic() < deadline:
            why = superlink_gone()
            if why is not None:
                details = why
                break
            if ended is not None and (ended_log := ended()) is not None:
                status, details = ENDED, ENDED_DETAILS  # (its log: what ended() read, not a stream reopened since)
                break
            stream_ended = streamer.ended()
            if stream_ended or time.monotonic() >= next_poll:
                status, details = status_of(run_id)
                next_poll = time.monotonic() + poll_interval
                if status.startswith("finished"):
                    break
                if stream_ended:
                    stream_error = streamer.error or stream_error
                    time.sleep(1.0)
                    streamer = open_stream()
                    continue
            time.sleep(0.25)
        finished = status.startswith("finished")
        unfinished = not finished and status != ENDED
        timed_out = unfinished and time.monotonic() >= deadline
        if finished:  # the server ends the stream right after the final log lines
            streamer.wait(max(1.0, min(30.0, deadline - time.monotonic() + 10)))
    finally:
        streamer.stop()
    if unfinished and stream_error:
        details = f"{details}; log stream: {stream_error}" if details else f"log stream: {stream_error}"
    log = read_log(log_path) if ended_log is None else ended_log
    if finished and not log.strip():  # the stream died early: the finished run's whole log, once
        streamer = open_stream()
        try:
            streamer.wait(CLI_TIMEOUT)
        finally:
            streamer.stop()
        log = read_log(log_path)
    return FollowedRun(status, details, strip_ansi(log), timed_out)


def read_log(path: Path) -> str:
    """The log written to ``path`` so far ("" before there is one)."""
    return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
