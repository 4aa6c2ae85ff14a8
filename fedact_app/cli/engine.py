"""A local simulation engine that serves many runs: one private SuperLink, and (by default) one
private Ray cluster they all attach to.

A run of the app on a fresh SuperLink pays, besides its rounds, for the SuperLink's start, a Ray
cluster's start and stop inside its ``flwr-simulation`` process, and the SuperLink's stop. A sweep
of N jobs pays that N times. A :class:`LocalEngine` pays the SuperLink once and, with a shared
cluster (``shared_ray``, the default for ``max_parallel=1``), Ray once: Flower 1.41's Ray backend
calls ``ray.init()`` without an address, so ``RAY_ADDRESS`` in the SuperLink's environment makes
every run's ``flwr-simulation`` attach to the engine's cluster (:mod:`.ray_cluster`). Each job stays
its own Flower run (run id, log, status, run folder, seed); the engine only removes fixed costs,
and a job's metrics are bit-identical to the same run on a fresh SuperLink
(tests/test_reproducible_e2e.py).

On a shared cluster runs compute one at a time: Flower sizes a run's actor pool from the whole
cluster's CPUs, so runs computing side by side on one cluster would wait on each other's actors,
past the round's and the identification's timeouts. Up to ``max_parallel`` runs may still be in
flight: a run is submitted once every other run in flight has said that its ServerApp ended with
no client still working (a file named after its run id in ``$FEDACT_ENGINE_DONE_DIR``,
:mod:`fedact_app.serverapp_done`; the FedACT ServerApp writes it). Flower 1.41 then still shuts the
last run down for 3-4 s (its simulation threads' queue waits, its Ray cluster's or actors' release,
a last wait for its log upload), which the next run's start (a new ``flwr-simulation`` process
importing flwr, Ray, torch and the app) overlaps; its actors wait for the last run's to leave the
cluster's CPUs. A run that ends otherwise (it failed, or a client did not answer in time and may
still be working) is waited for until Flower has finished it, and so are the runs of an app that
writes no such file. :meth:`LocalEngine.for_sweep` makes the engine a sweep uses. A run the engine
is closed after (``run_simulation``'s) need not wait for that shutdown at all: with
``stop_at_end`` it ends once the ServerApp has, and ``close`` kills the rest.

With ``shared_ray=False`` each run starts a Ray cluster of its own (``RAY_ADDRESS=local``), as
Flower does, and up to ``max_parallel`` runs compute side by side. No run ever attaches to a
cluster the engine did not start.

A run that outlives its ``timeout`` is stopped (the Control API's StopRun) and the engine is
restarted before its next run, once no other run is in flight: Flower marks a stopped run finished
at once, while its simulation process and actors may still be working, and a stuck run must not
slow or starve the next one. A SuperLink or Ray cluster that died is restarted the same way.
SIGTERM and SIGHUP raise SystemExit while the engine is open (main thread only), so that ``close``
stops every process it started; a closed engine runs nothing more.

    with LocalEngine() as engine:
        for overrides in ("seed=0", "seed=1"):
            result = engine.run(".", overrides=overrides, num_supernodes=10)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedact_app.cli import flwr
from fedact_app.cli.flwr import LaunchError
from fedact_app.cli.mps import MpsDaemon
from fedact_app.cli.procs import malloc_env
from fedact_app.cli.ray_cluster import RayCluster
from fedact_app.cli.superlink import SimulationSuperLink
from fedact_app.serverapp_done import DONE_DIR_ENV, done_line

STARTUP_TIMEOUT = 120.0  # seconds for the Ray cluster and the SuperLink to start
OVERLAPPED_RUNS = 2  # a sweep's runs in flight on one shared Ray cluster: one computing, the last one shutting down
CONNECTION = "fedact-launch"  # the only connection in the engine's config.toml (`flwr ls` while it runs)
BASE_ENV = {
    **flwr.BASE_ENV,
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    # when a cluster's first driver connects, Ray starts one idle worker per CPU for plain tasks;
    # Flower's actors run in a runtime env (RayBackend sets PYTHONPATH in one) and never use them,
    # and on 2 cores their start only slows the actors' (a run 0.7-1.7 s faster without them,
    # docs/PERFORMANCE.md, "Fixed settings of the engine")
    "RAY_prestart_worker_first_driver": "0",
}


@dataclass
class RunResult:
    """Outcome of one run, as reported by the SuperLink (with ``stop_at_end``, by its ServerApp's end)."""

    run_id: int
    status: str  # as `flwr ls` reports it: "finished:completed", "finished:failed", "running", ...; or
    # "ended:completed" (flwr.ENDED) for a run its engine stopped once the ServerApp had ended (``stop_at_end``)
    completed: bool  # True only for "finished:completed" and "ended:completed"
    log: str  # the run's log (ServerApp + simulation output), ANSI colours stripped
    seconds: float  # wall time of engine.run, less its wait for other runs (an engine's start included
    # when the run started it; run_simulation: the whole call, the SuperLink's stop included)
    details: str = ""  # `flwr ls` "status-details", e.g. "Simulation failed with exception: ..."
    timed_out: bool = False  # the run had not finished when `timeout` ran out
    superlink_pid: int = 0
    pids: tuple[int, ...] = field(default=(), repr=False)  # a lone run: all processes of the SuperLink tree

    def tail(self, lines: int = 40) -> str:
        """Last ``lines`` lines of the log."""
        return "\n".join(self.log.splitlines()[-lines:])


def serverapp_ended(done_dir: Path, run_id: int, log_path: Path) -> Callable[[], str | None]:
    """The run's log at ``log_path`` once the ServerApp of ``run_id`` has said that it ended (its
    file in ``done_dir``) and the line it logged first, with the file's token, is in that log,
    which then holds all that the ServerApp logged before (:mod:`fedact_app.serverapp_done`; the
    clients' output reaches the log through Ray, and a client's last lines may still be on their
    way); None until then."""
    done_file = done_dir / str(run_id)

    def ended() -> str | None:
        try:
            token = done_file.read_text()
        except OSError:  # not written yet
            return None
        log = flwr.read_log(log_path)
        return log if token and done_line(run_id, token) in log else None

    return ended


def exit_on_termination() -> Callable[[], None]:
    """Make SIGTERM/SIGHUP raise SystemExit (so ``finally`` blocks stop the engine's processes)
    while an engine is open; return a function restoring the previous handlers.

    Python's default for these signals kills the process without unwinding, which would leave the
    SuperLink, flwr-simulation and the Ray cluster running (seen): they run in their own sessions.
    Only handlers still at the default are replaced, and only in the main thread (Python allows no
    other).
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


class LocalEngine:
    """A private simulation SuperLink (and Ray cluster) for many runs; a context manager. It starts
    with its first run (so a sweep whose jobs are all done starts nothing) and stops on ``close``.

    Parameters
    ----------
    max_parallel: runs in flight at once (``run`` may be called from more threads; the others
        wait).
    shared_ray: one Ray cluster for all runs, which then compute one at a time (default: when
        ``max_parallel`` is 1); False: each run's ``flwr-simulation`` starts its own, as Flower
        does, and runs compute side by side.
    num_cpus, num_gpus: the shared Ray cluster's resources (default: this machine's CPUs; Ray's
        own GPU detection), as a run's own ``ray.init()`` would find them.
    env: extra environment for the SuperLink (and so the ServerApps and ClientApps) and ``flwr``.
    cwd: working directory of the SuperLink and hence of the running apps (default: the caller's).
    flwr_home: FLWR_HOME to use (kept afterwards); default: a temporary one, deleted by ``close``.
    mps: start a private CUDA MPS daemon with the SuperLink and give its address to every process
        (:mod:`.mps`), so that the clients sharing a GPU can run their kernels side by side; stopped
        after the SuperLink and the Ray cluster.
    """

    def __init__(self, *, max_parallel: int = 1, shared_ray: bool | None = None, num_cpus: int | None = None,
                 num_gpus: float | None = None, env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                 flwr_home: str | Path | None = None, mps: bool = False) -> None:
        if int(max_parallel) < 1:
            raise ValueError(f"max_parallel must be >= 1, got {max_parallel}")
        self.max_parallel = int(max_parallel)
        self.shared_ray = self.max_parallel == 1 if shared_ray is None else bool(shared_ray)
        self.num_cpus = int(num_cpus or os.cpu_count() or 1)
        self.num_gpus = num_gpus
        self.cwd = Path(cwd) if cwd else Path.cwd()
        self._own_home = flwr_home is None
        self.home = Path(flwr_home).expanduser().resolve() if flwr_home else None
        self._extra_env = dict(env or {})
        self.env: dict[str, str] = {}
        self.link: SimulationSuperLink | None = None
        self.control: flwr.ControlClient | None = None
        self.ray: RayCluster | None = None
        self.mps = bool(mps)
        self.mps_daemon: MpsDaemon | None = None
        self.pids: set[int] = set()  # every process the engine's SuperLinks and clusters had
        self._lock = threading.Lock()
        self._in_flight: dict[object, int | None] = {}  # a claim's token -> its run id once submitted
        self._restart = False
        self._closed = False
        self._cut_short = False  # the last run ended with stop_at_end: close kills its shutdown at once
        self._restore_signals: Callable[[], None] = lambda: None

    @classmethod
    def for_sweep(cls, max_parallel: int = 1, **kwargs: Any) -> LocalEngine:
        """The engine for a sweep whose jobs call :meth:`run` from ``engine.max_parallel`` threads:
        with ``max_parallel=1`` one shared Ray cluster and :data:`OVERLAPPED_RUNS` runs in flight, one
        computing while the last one shuts down; else ``max_parallel`` runs computing side by side,
        each with its own Ray cluster. ``kwargs``: the other parameters."""
        if int(max_parallel) == 1:
            return cls(max_parallel=OVERLAPPED_RUNS, shared_ray=True, **kwargs)
        return cls(max_parallel=max_parallel, shared_ray=False, **kwargs)

    # ------------------------------------------------------------------ life cycle

    def __enter__(self) -> LocalEngine:
        self._restore_signals = exit_on_termination()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            self._restore_signals()

    def _start(self) -> None:
        """Start the MPS daemon (if asked for), the shared Ray cluster (if any) and the SuperLink;
        LaunchError if one fails.
        Called by :meth:`_claim` only, under the lock, with no process of the engine running."""
        deadline = time.monotonic() + STARTUP_TIMEOUT
        if self.home is None:
            self.home = Path(tempfile.mkdtemp(prefix="fedact-flwr-")).resolve()
        self.home.mkdir(parents=True, exist_ok=True)
        # never a cluster the user's environment names or Ray finds on its own (/tmp/ray): the
        # engine's, or with "local" a new one per run
        done_dir = self.home / "serverapps-done"
        done_dir.mkdir(exist_ok=True)
        env = {**malloc_env(os.environ), **os.environ, **BASE_ENV, **self._extra_env, "FLWR_HOME": str(self.home),
               "RAY_ADDRESS": "local", DONE_DIR_ENV: str(done_dir)}
        try:
            if self.mps:  # first: every process started after it must find it
                self.mps_daemon = MpsDaemon.start(env)
                env.update(self.mps_daemon.env)
            if self.shared_ray:
                self.ray = RayCluster.start(self.num_cpus, self.num_gpus, env)
                env["RAY_ADDRESS"] = self.ray.address
            self.env = env
            self.link = SimulationSuperLink.start(self.home, env, self.cwd, deadline)
            flwr.write_connection(self.home, CONNECTION, f"127.0.0.1:{self.link.port}")
            self.control = flwr.ControlClient(f"127.0.0.1:{self.link.port}")
        except BaseException:
            self._stop_processes()
            raise

    def close(self) -> tuple[int, ...]:
        """Stop the SuperLink, the Ray cluster, everything they spawned and the MPS daemon; all pids
        seen."""
        with self._lock:  # not while a run starts the engine: it would start what nothing stops
            self._closed = True
            self._stop_processes(kill_at_once=self._cut_short)
        if self._own_home and self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
            self.home = None
        return tuple(sorted(self.pids))

    def _stop_processes(self, kill_at_once: bool = False) -> None:
        """Stop the SuperLink's and the cluster's process trees (SIGTERM first, unless
        ``kill_at_once``), then the MPS daemon."""
        try:
            if self.control is not None:
                self.control.close()
                self.control = None
            if self.link is not None:
                self.pids |= set(self.link.stop(kill_at_once))
                self.link = None
            if self.ray is not None:
                self.pids |= set(self.ray.stop(kill_at_once))
                self.ray = None
        finally:  # last, once its clients are gone; also when stopping them failed
            if self.mps_daemon is not None:
                self.pids |= set(self.mps_daemon.stop())
                self.mps_daemon = None

    def _healthy(self) -> bool:
        for process in (self.link, self.ray, self.mps_daemon):
            if process is not None:
                process.remember_children()
        return (self.link is not None and self.link.proc.poll() is None
                and (self.ray is None or self.ray.alive())
                and (self.mps_daemon is None or self.mps_daemon.alive()) and not self._restart)

    def _computing(self) -> bool:
        """Whether a run in flight may still compute: not yet submitted, or its ServerApp has not
        said it ended (:func:`fedact_app.serverapp_done.mark_done`)."""
        done_dir = Path(self.env[DONE_DIR_ENV])
        return any(run_id is None or not (done_dir / str(run_id)).exists() for run_id in self._in_flight.values())

    def _claim(self) -> tuple[object, float]:
        """One more run in flight: its token, and the time (``time.monotonic()``) it stopped waiting
        for other runs. Wait while ``max_parallel`` runs are in flight, or on a shared Ray cluster
        while another run computes (module docstring); start the engine first if it is not running,
        or restart it after a run past its timeout or when a process of it died (then only once no
        other run is in flight)."""
        token = object()
        while True:
            with self._lock:
                if self._closed:
                    raise LaunchError("the engine is closed")
                waiting_on_others = len(self._in_flight) >= self.max_parallel or (
                    self.shared_ray and self._in_flight and self._computing())
                if not waiting_on_others:
                    granted = time.monotonic()
                    self._cut_short = False  # a run after it: close stops that one gracefully
                    if self._healthy():
                        self._in_flight[token] = None
                        return token, granted
                    if not self._in_flight:
                        self._stop_processes()
                        self._restart = False
                        self._start()
                        self._in_flight[token] = None
                        return token, granted
            time.sleep(0.1 if waiting_on_others else 0.5)  # a file check; a scan of /proc

    # ------------------------------------------------------------------ runs

    def run(  # noqa: PLR0913 - the run's own flat, explicit settings
        self,
        app_dir: str | Path,
        overrides: str = "",
        num_supernodes: int = 2,
        num_cpus_per_client: int = 1,
        num_gpus_per_client: float = 0.0,
        run_config: Mapping[str, Any] | None = None,
        timeout: float = 600.0,
        *,
        federation_config: Mapping[str, Any] | None = None,
        poll_interval: float = 0.5,
        stop_at_end: bool = False,
    ) -> RunResult:
        """Submit one run of the Flower app in ``app_dir`` and wait for it (see
        :func:`fedact_app.cli.launch.run_simulation` for the parameters). LaunchError when the run
        could not be submitted.

        ``stop_at_end``: return as soon as the ServerApp has said that it ended with its results
        written and no client working, and its whole log has arrived
        (:mod:`fedact_app.serverapp_done`), with status ``ended:completed``, instead of waiting
        for Flower to shut the run down (3-4 s: its simulation threads' queue waits, the Ray
        cluster's stop, a last wait for its log upload); ``close`` then kills what is left of the
        run at once. For a run the engine is closed after (``run_simulation``'s). An app that
        writes no such line is waited for as without it."""
        app_path = Path(app_dir).expanduser().resolve()
        if not (app_path / "pyproject.toml").is_file():
            raise ValueError(f"{app_path} has no pyproject.toml; not a Flower app directory")
        if int(num_supernodes) < 1:
            raise ValueError("num_supernodes must be >= 1")
        if float(num_cpus_per_client) != int(num_cpus_per_client) or int(num_cpus_per_client) < 1:
            raise ValueError("num_cpus_per_client must be a positive integer (Flower's proto is int)")
        if self.shared_ray and (sized := sorted(k for k in federation_config or {} if k.startswith("init-args-num-"))):
            raise ValueError(f"{', '.join(sized)}: a run attached to the engine's shared Ray cluster cannot size "
                             "it (Ray refuses num_cpus/num_gpus when connecting); give the cluster's size to "
                             "LocalEngine(num_cpus=..., num_gpus=...), or use shared_ray=False")
        token, t0 = self._claim()
        try:
            return self._run(token, app_path, overrides, num_supernodes, num_cpus_per_client, num_gpus_per_client,
                             run_config, time.monotonic() + timeout, federation_config, poll_interval, t0,
                             stop_at_end)
        finally:
            with self._lock:
                del self._in_flight[token]

    def _run(self, token: object, app_path: Path, overrides: str, num_supernodes: int, num_cpus: int,
             num_gpus: float, run_config: Mapping[str, Any] | None, deadline: float,
             federation_config: Mapping[str, Any] | None, poll_interval: float, t0: float,
             stop_at_end: bool) -> RunResult:
        link, home = self.link, self.home
        config = dict(run_config or {})
        if overrides:
            config["overrides"] = overrides
        fed = {
            "num-supernodes": int(num_supernodes),
            "client-resources-num-cpus": int(num_cpus),
            "client-resources-num-gpus": float(num_gpus),
            **(federation_config or {}),
        }
        control = self.control
        try:
            run_id = control.start_run(app_path, config, federation_config=fed)
        except LaunchError as err:
            raise LaunchError(f"{err}\n--- SuperLink output ---\n{link.output_tail()}") from None
        with self._lock:
            self._in_flight[token] = run_id

        def gone() -> str | None:
            if link.proc.poll() is None:
                return None
            return f"the SuperLink exited (rc={link.proc.returncode}):\n{link.output_tail()}"

        log_path = home / f"run-{run_id}.log"
        run = flwr.follow_run(home, CONNECTION, run_id, log_path, deadline=deadline,
                              poll_interval=poll_interval, superlink_gone=gone,
                              status_of=control.run_status,
                              open_stream=lambda: control.log_stream(run_id, log_path),
                              ended=serverapp_ended(Path(self.env[DONE_DIR_ENV]), run_id, log_path)
                              if stop_at_end else None)
        if run.timed_out:
            self._stop_run(run_id)
        if run.status == flwr.ENDED:
            self._cut_short = True
        return RunResult(run_id=run_id, status=run.status, completed=run.status in ("finished:completed", flwr.ENDED),
                         log=run.log, seconds=time.monotonic() - t0, details=run.details,
                         timed_out=run.timed_out, superlink_pid=link.pid)

    def _stop_run(self, run_id: int) -> None:
        """Stop a run past its timeout, and restart the engine before the next run (see above)."""
        with self._lock:
            if self.control is not None:  # (None: the engine was closed meanwhile)
                self.control.stop_run(run_id)
            self._restart = True
