"""Run a Flower app to completion on a private, throw-away SuperLink (simulation mode).

``flwr run`` always talks to a SuperLink; with the default ``:local:`` connection it starts a
background SuperLink that keeps running, uses ``~/.flwr`` and fixed ports, installs the app's
dependencies for every run, and ``flwr run --stream`` exits 0 even when the run failed. This
module avoids all of that:

1. a temporary ``FLWR_HOME`` with a ``config.toml`` holding one connection (``fedact-launch``,
   for ``flwr ls`` / ``flwr log`` while it runs), so the user's ``~/.flwr`` and default SuperLink
   are never touched;
2. ``flower-superlink --insecure --simulation --disable-runtime-dependency-installation`` on a
   free loopback port (in Flower 1.41 the Control, Runtime (ServerAppIo) and Fleet APIs are all
   served over HTTP on that single ``--host/--port``; nothing else is bound by the SuperLink);
3. the run started through the SuperLink's Control API with Flower's own client, in this process:
   what ``flwr run <app> fedact-launch --run-config <file.toml> --federation-config "..."`` sends
   (``fedact_app.cli.flwr.ControlClient``);
4. its log streamed the same way (what ``flwr log <run> --stream`` prints; Flower ends the stream
   when the run finishes), with the Control API's ``ListRuns`` (what ``flwr ls`` shows) as the
   source of the status, except:
5. the run reported ``ended:completed`` as soon as the FedACT ServerApp has said that it ended
   with its results written and its last log line has arrived (:mod:`fedact_app.serverapp_done`),
   not 3-4 s later when Flower has shut the run down (another app: Flower's status);
6. in ``finally``: SIGTERM, then SIGKILL, for the SuperLink and every process it spawned
   (SuperExec, ``flwr-simulation``, the Ray cluster), also on errors, timeouts, Ctrl-C and
   SIGTERM (turned into ``SystemExit`` while a run is in progress, main thread only); SIGKILL at
   once after an ``ended:completed`` run, whose shutdown holds nothing worth waiting for.

One run is one :class:`fedact_app.cli.engine.LocalEngine` started and closed around it (its Ray
cluster started inside the run, as Flower does); a sweep keeps one engine for all its jobs.

Python use::

    from fedact_app.cli.launch import run_simulation
    result = run_simulation(".", overrides="num_rounds=2", num_supernodes=3)
    assert result.completed, result.log

Command line (exit code 0 only when the run ended or finished with sub-status ``completed``)::

    python -m fedact_app.cli.launch --app . --overrides "num_rounds=2" --num-supernodes 3
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from fedact_app.cli.engine import CONNECTION, LocalEngine, RunResult
from fedact_app.cli.flwr import LaunchError, toml_loads
from fedact_app.cli.procs import pid_alive
from fedact_app.cli import mps as mps_daemon, resources

__all__ = ["CONNECTION", "LaunchError", "RunResult", "pid_alive", "run_simulation", "app_config", "clients_of"]


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------
def run_simulation(  # noqa: PLR0913 - a flat, explicit signature reads best here
    app_dir: str | Path,
    overrides: str = "",
    num_supernodes: int = 2,
    num_cpus_per_client: int = 1,
    num_gpus_per_client: float | None = None,
    run_config: Mapping[str, Any] | None = None,
    timeout: float = 600.0,
    flwr_home: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    *,
    federation_config: Mapping[str, Any] | None = None,
    cwd: str | Path | None = None,
    poll_interval: float = 0.5,
    mps: bool = False,
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
        ClientApps see no GPU unless ``num_gpus_per_client > 0``; None (the default) gives each
        client the automatic share of :mod:`fedact_app.cli.resources` (0 where no GPU is visible,
        and where the overrides do not compose: the run then reports their error).
    run_config: further run-config keys (must exist in ``[tool.flwr.app.config]``).
    timeout: seconds for the run once the SuperLink is up (its start has a limit of its own,
        ``engine.STARTUP_TIMEOUT``); an unfinished run is reported with ``timed_out=True``.
    flwr_home: FLWR_HOME to use (kept afterwards); default: a temporary one, deleted afterwards.
    env: extra environment for the flwr CLI and the SuperLink (and so the ServerApp/ClientApps).
    federation_config: extra ``--federation-config`` keys, e.g. ``{"init-args-num-cpus": 2}``.
    cwd: working directory of the SuperLink and hence of the running app (default: the
        caller's). Apps should resolve their paths to absolute ones anyway.
    poll_interval: seconds between two status checks while the log stream is open (in-process
        calls of the Control API: cheap).
    mps: run the clients under a private CUDA MPS daemon (:mod:`fedact_app.cli.mps`), so that
        clients sharing a GPU can run their kernels side by side.

    Raises
    ------
    LaunchError: the SuperLink did not start or did not accept the run.
    """
    t0 = time.monotonic()
    submitted = overrides or str((run_config or {}).get("overrides", ""))
    if num_gpus_per_client is None:
        num_gpus_per_client = automatic_gpus(Path(app_dir), submitted, num_cpus_per_client)
    federation_config = {**batching_federation(Path(app_dir), submitted, num_cpus_per_client),
                         **(federation_config or {})}
    engine = LocalEngine(shared_ray=False, env=env, cwd=cwd, flwr_home=flwr_home, mps=mps)
    with engine:  # checks the arguments, then starts the SuperLink; stops it on the way out
        result = engine.run(app_dir, overrides, num_supernodes, num_cpus_per_client, num_gpus_per_client,
                            run_config, timeout, federation_config=federation_config,
                            poll_interval=poll_interval, stop_at_end=True)
    result.pids = tuple(sorted(engine.pids))
    result.seconds = time.monotonic() - t0
    return result


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _parse_run_config(items: Iterable[str]) -> dict[str, Any]:
    """``key=value`` pairs; values are parsed as TOML (numbers, booleans, quoted strings),
    anything that is not valid TOML is taken as a plain string."""
    config: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--run-config expects key=value, got {item!r}")
        try:
            config[key] = toml_loads(f"v = {raw}")["v"]
        except ValueError:  # TOMLDecodeError
            config[key] = raw
    return config


def app_config(app: Path, overrides: str) -> Any | None:
    """The composed config of a FedACT app (a checkout with ``fedact_app/config.py`` and
    ``conf/config.yaml``), None for another app. A bad key or value fails here in a second with
    its message (ValueError) instead of inside the run; so do the values naming files
    (:func:`check_local_files`)."""
    if not ((app / "fedact_app" / "config.py").is_file() and (app / "conf" / "config.yaml").is_file()):
        return None
    from fedact_app.config import compose  # Hydra: only for the app's own configuration

    try:
        cfg = compose(overrides, conf_dir=app / "conf")
    except Exception as err:  # noqa: BLE001 - ConfigError and Hydra's composition and type errors
        cause = f" ({err.__cause__})" if err.__cause__ is not None else ""
        raise ValueError(f"{err}{cause}".strip()) from None
    check_local_files(cfg)
    return cfg


def clients_of(cfg: Any | None, requested: int | None) -> int:
    """The number of SuperNodes to simulate: for a FedACT app (``cfg``, its composed config) one
    per client, ``num_clients``; another number is refused, since every ClientApp would refuse
    the run. Another app (``cfg`` None): ``requested``, default 2."""
    if cfg is None:
        return 2 if requested is None else requested
    if requested is not None and requested != cfg.num_clients:
        raise ValueError(f"--num-supernodes {requested} differs from num_clients={cfg.num_clients}: "
                         f"each SuperNode is one client; pass --num-supernodes {cfg.num_clients}, or "
                         f"num_clients={requested} in --overrides")
    return cfg.num_clients


def automatic_gpus(app: Path, overrides: str, num_cpus_per_client: int) -> float:
    """The automatic GPU share of :func:`run_simulation`: 0 without a visible GPU (no config
    composed then) or when the overrides do not compose."""
    if resources.visible_gpus() == 0:
        return 0.0
    try:
        return resources.client_gpus(app_config(app, overrides), num_cpus_per_client, None)
    except ValueError:  # the run itself reports what is wrong with the config
        return 0.0


def batching_federation(app: Path, overrides: str, num_cpus_per_client: int) -> dict[str, int]:
    """``init-args-num-cpus`` for a run with ``client_batch``: enough ClientApps for every client a
    round samples (:func:`resources.ray_cpus`); {} for other runs, other apps, or overrides that do
    not compose (the run reports their error)."""
    try:
        cfg = app_config(app, overrides)
    except ValueError:
        return {}
    if cfg is None or not cfg.client_batch:
        return {}
    return {"init-args-num-cpus": resources.ray_cpus(cfg, num_cpus_per_client, resources.machine_cpus())}


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
        from fedact_app.tasks.vision.splits import check_local_path  # imports torch: only with a path

        check_local_path(cfg.dataset)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedact_app.cli.launch",
        description="Run a Flower app on a private simulation SuperLink; exit 0 only if the "
        "run ended or finished with status completed.",
    )
    parser.add_argument("--app", default=".", help="Flower app directory (default: .)")
    parser.add_argument("--overrides", default="", help="value of the app's `overrides` key")
    parser.add_argument("--num-supernodes", type=int, default=None,
                        help="SuperNodes, one per client (default: num_clients of this FedACT app's "
                             "config with the overrides; 2 for another app)")
    parser.add_argument("--num-cpus", type=int, default=1, help="CPUs per ClientApp")
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="GPUs per ClientApp (default: GPUs / clients training at once where a GPU is "
                             "visible and device is not cpu, else 0; fedact_app/cli/resources.py)")
    parser.add_argument("--mps", action="store_true", help=mps_daemon.HELP)
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
        cfg = app_config(Path(args.app), submitted)
        num_supernodes = clients_of(cfg, args.num_supernodes)
        num_gpus = resources.client_gpus(cfg, args.num_cpus, args.num_gpus)
        if args.mps and num_gpus == 0:
            raise ValueError("--mps shares a GPU between clients, but they get none (no GPU visible, device=cpu "
                             "or --num-gpus 0): give them a GPU share, or leave --mps out")
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(f"[launch] {num_supernodes} SuperNodes; {resources.describe_share(num_gpus, args.num_gpus)}", flush=True)
    try:
        result = run_simulation(
            args.app,
            overrides=args.overrides,
            num_supernodes=num_supernodes,
            num_cpus_per_client=args.num_cpus,
            num_gpus_per_client=num_gpus,
            run_config=run_config,
            timeout=args.timeout,
            flwr_home=args.flwr_home,
            mps=args.mps,
        )
    except (LaunchError, ValueError) as err:
        print(f"launch error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the SuperLink was already stopped on the way out of the engine
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
