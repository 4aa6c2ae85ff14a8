"""Sweep: Hydra multirun over the app's config, every combination its own Flower run, one folder.

    python scripts/sweep.py -m algorithm=fedact,fedadamw,fedavg partition.alpha=0.6,0.1
    python scripts/sweep.py -m experiment=table_vit_swin algorithm=fedact --num-gpus 0.25
    python scripts/sweep.py -m experiment=ablation_rho hydra.sweep.dir=sweeps/rho

Hydra expands the overrides (``-m``; ``a=x,y`` sweeps a key; ``hydra.sweeper.params`` in an
``experiment=`` preset sweeps its grid) and calls :func:`main` once per combination. Each one is
validated (fedact_app.config) and then run as its own Flower run with ``num_clients`` SuperNodes
on one private local engine the whole sweep shares (``fedact_app.cli.engine.LocalEngine``: one
SuperLink and one Ray cluster, one job computing at a time while the last one shuts down; a
job's metrics are those of the same run launched alone): a run that fails, times out or has an
invalid value is recorded and the sweep goes on. A value Hydra itself cannot compose (an unknown
key, a wrong type) stops the sweep before any run starts: Hydra composes every combination first.

Launcher options, given before or between the Hydra overrides:
    --num-gpus F     GPUs per simulated client (default: where a GPU is visible and device is not
                     cpu, GPUs / (clients training at once x --max-parallel), else 0;
                     fedact_app/cli/resources.py)
    --num-cpus N     CPUs per simulated client (default 1)
    --timeout S      seconds per run (default 86400)
    --max-parallel N runs computing at once (default 1: one Ray cluster, a job starting while the
                     last one shuts down; N > 1: each run starts its own Ray cluster)
    --mps            a private CUDA MPS daemon for the clients sharing a GPU (fedact_app/cli/mps.py)

The folder (``hydra.sweep.dir``, default ``sweeps/<date>-<time>``)::

    summary.jsonl   one line per combination: job, overrides, status, run_dir, accuracies, seconds, error
    summary.md      the same as a table
    <job>/          Hydra's job folder: .hydra/ (the job's config and overrides), result.json,
                    flower.log (the run's log) and the run folder <time>_<algorithm>_..._s<seed>/

After each job the script prints ``[sweep] <done>/<total> job <n>: <status> (<overrides>)``: the
jobs finished so far and the number of combinations. ``status`` is ``completed``, ``failed`` (the
run did not finish as completed; ``error`` has the reason), ``timed out``, ``invalid config`` or
``launch error``. The summary is rebuilt from the jobs' ``result.json`` after every job. The
jobs need this script's engine: run them in parallel with ``--max-parallel``, not with a Hydra
launcher plugin. With the default launcher the script exits 1 when any combination did not
complete. The app's ``output_dir`` is set to the job folder by the sweep. With
``--max-parallel N`` Hydra still composes the jobs one after another, and up to N of them run at
once; the progress lines come in the order the jobs finish.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
if str(APP_DIR) not in sys.path:
    sys.path.insert(0, str(APP_DIR))

import hydra  # noqa: E402
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from fedact_app.config import CONF_DIR, to_config  # noqa: E402  (also registers the schema)
from fedact_app.cli.engine import LocalEngine  # noqa: E402
from fedact_app.cli.mps import HELP as MPS_HELP  # noqa: E402  (study.py and tune.py use it too)
from fedact_app.cli.resources import client_gpus  # noqa: E402

DEFAULT_DIR = "sweeps/${now:%Y%m%d-%H%M%S}"
SUMMARY_COLUMNS = ("job", "status", "final_test_accuracy", "best_test_accuracy", "seconds", "overrides")


@dataclass(frozen=True)
class LaunchOptions:
    num_gpus: float | None = None  # None: fedact_app.cli.resources's automatic share, per job
    num_cpus: int = 1
    timeout: float = 86400.0
    max_parallel: int = 1
    mps: bool = False  # a private CUDA MPS daemon for the engine's clients (fedact_app.cli.mps)

    def engine(self) -> LocalEngine:
        """The engine the jobs share (it starts with the first job that runs); the jobs run on
        ``engine.max_parallel`` threads (LocalEngine.for_sweep)."""
        return LocalEngine.for_sweep(self.max_parallel, mps=self.mps)


def parse_launch_options(argv: list[str]) -> tuple[LaunchOptions, list[str]]:
    """Split this script's own options off the command line; the rest goes to Hydra."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--num-gpus", type=float, default=None)
    parser.add_argument("--num-cpus", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=86400.0)
    parser.add_argument("--max-parallel", type=int, default=1)
    parser.add_argument("--mps", action="store_true", help=MPS_HELP)
    known, rest = parser.parse_known_args(argv)
    if known.max_parallel < 1:
        parser.error(f"--max-parallel must be >= 1, got {known.max_parallel}")
    if known.num_gpus is not None and not known.num_gpus >= 0:
        parser.error(f"--num-gpus must be >= 0 (GPUs per client), got {known.num_gpus}")
    return LaunchOptions(known.num_gpus, known.num_cpus, known.timeout, known.max_parallel, known.mps), rest


def with_default_dirs(args: list[str]) -> list[str]:
    """Put runs under ``sweeps/`` unless the user chose ``hydra.sweep.dir`` / ``hydra.run.dir``."""
    extra = [f"{key}={DEFAULT_DIR}" for key in ("hydra.sweep.dir", "hydra.run.dir")
             if not any(a.startswith(key + "=") for a in args)]
    return args + extra


# ------------------------------------------------------------------ one combination


def run_combination(cfg: DictConfig, overrides: list[str], job_dir: Path, launch: LaunchOptions,
                    engine: LocalEngine) -> dict:
    """Validate and run one combination as its own Flower run on ``engine``; return its summary row
    (never raises for a failure of the run: the row says what went wrong)."""
    started = time.monotonic()
    row = {"job": job_dir.name, "overrides": " ".join(overrides), "status": "", "run_dir": None,
           "final_test_accuracy": None, "best_test_accuracy": None, "error": ""}

    def done(status: str, error: str = "", seconds: float | None = None) -> dict:
        row.update(status=status, error=error,
                   seconds=round(time.monotonic() - started if seconds is None else seconds, 1))
        return row

    try:
        config = to_config(cfg)
        num_gpus = client_gpus(config, launch.num_cpus, launch.num_gpus, runs_at_once=launch.max_parallel)
    except Exception as err:  # ConfigError and anything else the schema checks raise; device=cuda without a GPU
        return done("invalid config", f"{type(err).__name__}: {err}")
    run_overrides = [o for o in overrides if not o.startswith("output_dir=")]
    run_overrides.append(f"output_dir={hydra_quoted(str(job_dir))}")
    try:
        result = engine.run(APP_DIR, overrides=" ".join(shlex.quote(o) for o in run_overrides),
                            num_supernodes=config.num_clients, num_cpus_per_client=launch.num_cpus,
                            num_gpus_per_client=num_gpus, timeout=launch.timeout)
    except Exception as err:  # the SuperLink did not start or the run was not accepted
        return done("launch error", f"{type(err).__name__}: {err}")
    (job_dir / "flower.log").write_text(result.log)
    summaries = sorted(job_dir.glob("*/summary.json"))
    if summaries:
        summary = json.loads(summaries[-1].read_text())
        row.update(run_dir=summary["run_dir"], final_test_accuracy=summary["final_test_accuracy"],
                   best_test_accuracy=summary["best_test_accuracy"])
    # a run's seconds leave out its wait for the job before (LocalEngine.run)
    if result.completed:
        return done("completed", seconds=result.seconds)
    reason = result.details or result.tail(20)
    return done("timed out" if result.timed_out else "failed", f"{result.status}: {reason}", result.seconds)


def hydra_quoted(value: str) -> str:
    """``value`` as a quoted Hydra override value: a job folder may hold ``=`` (study.py names one
    ``fedavg_partition.alpha=0.6_s0_<hash>``), which Hydra's grammar refuses unquoted."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# ------------------------------------------------------------------ the folder's summary


def write_summary(sweep_dir: Path) -> list[dict]:
    """Rebuild ``summary.jsonl`` and ``summary.md`` from every job's ``result.json``."""
    rows = [json.loads(p.read_text()) for p in sweep_dir.glob("*/result.json")]
    rows.sort(key=lambda r: (len(r["job"]), r["job"]))
    _write_atomic(sweep_dir / "summary.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    failed = [r for r in rows if r["status"] != "completed"]
    lines = [f"# Sweep: {len(rows)} runs, {len(rows) - len(failed)} completed, {len(failed)} not", "",
             "| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    lines += ["| " + " | ".join(_cell(c, r.get(c)) for c in SUMMARY_COLUMNS) + " |" for r in rows]
    if failed:
        lines += ["", "## Not completed", ""]
        lines += [f"- job {r['job']} ({r['overrides']}): {r['status']}: "
                  f"{r['error'].strip().splitlines()[-1] if r['error'].strip() else ''}" for r in failed]
    _write_atomic(sweep_dir / "summary.md", "\n".join(lines) + "\n")
    return rows


def _cell(column: str, value) -> str:
    if value is None:
        return ""
    if column.endswith("accuracy"):
        return f"{value:.4f}"
    return str(value).replace("|", "\\|")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def sweep_size(sweep_dir: Path) -> int:
    """How many combinations the sweep has: Hydra's basic sweeper expands ``hydra.sweeper.params``
    (an ``experiment=`` preset's grid) and the command line's overrides, as saved in
    ``multirun.yaml`` before the first job, the same way here."""
    saved = OmegaConf.load(sweep_dir / "multirun.yaml").hydra
    arguments = [f"{key}={value}" for key, value in (saved.sweeper.params or {}).items()]
    arguments += list(saved.overrides.task)
    overrides = OverridesParser.create().parse_overrides(arguments)
    return sum(len(batch) for batch in BasicSweeper.split_arguments(overrides, max_batch_size=None))


# ------------------------------------------------------------------ Hydra entry point

LAUNCH = LaunchOptions()
SWEEP_DIRS: set[Path] = set()  # folders this process wrote to (the default launcher runs in-process)
ENGINE: LocalEngine | None = None  # the sweep's engine, set by cli()
POOL: ThreadPoolExecutor | None = None  # where the jobs run, set by cli()
PENDING: list[Future] = []
SUMMARY_LOCK = threading.Lock()
# Set when the sweep (or a study) is interrupted: the runs in flight are stopped, and what they
# return then (failed, the engine closed) is not written down as their outcome.
STOPPING = threading.Event()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir).resolve()
    multirun = hc.mode == RunMode.MULTIRUN
    sweep_dir = Path(hc.sweep.dir).resolve() if multirun else job_dir
    SWEEP_DIRS.add(sweep_dir)
    assert POOL is not None, "the sweep's jobs run inside cli(), on its engine"
    PENDING.append(POOL.submit(run_job, cfg, list(hc.overrides.task), job_dir, sweep_dir, multirun))


def run_job(cfg: DictConfig, overrides: list[str], job_dir: Path, sweep_dir: Path, multirun: bool) -> None:
    """One combination on the sweep's engine, its ``result.json``, the summary and a progress line."""
    assert ENGINE is not None, "the sweep's jobs run inside cli(), on its engine"
    row = run_combination(cfg, overrides, job_dir, LAUNCH, ENGINE)
    if STOPPING.is_set() and row["status"] != "completed":
        return
    _write_atomic(job_dir / "result.json", json.dumps(row, indent=2) + "\n")  # write_summary may read it now
    with SUMMARY_LOCK:
        rows = write_summary(sweep_dir)
        done, total = (len(rows), sweep_size(sweep_dir)) if multirun else (1, 1)
        print(f"[sweep] {done}/{total} job {row['job']}: {row['status']} ({row['overrides']})"
              + (f" final test accuracy {row['final_test_accuracy']:.4f}"
                 if row["final_test_accuracy"] is not None else "")
              + (f": {row['error'].splitlines()[-1][:300]}" if row["error"] else ""), flush=True)


def cli(argv: list[str]) -> int:
    global LAUNCH, ENGINE, POOL
    LAUNCH, hydra_args = parse_launch_options(argv)
    sys.argv = [sys.argv[0], *with_default_dirs(hydra_args)]
    with LAUNCH.engine() as ENGINE:
        POOL = ThreadPoolExecutor(ENGINE.max_parallel)
        try:
            main()
            for future in PENDING:
                future.result()
        except BaseException:  # Ctrl-C, SIGTERM: stop the runs in flight first, then their threads return
            STOPPING.set()
            ENGINE.close()
            raise
        finally:
            POOL.shutdown(wait=True, cancel_futures=True)
            STOPPING.clear()  # (the jobs' threads have returned)
            POOL, ENGINE = None, None
            PENDING.clear()
    rows = [row for d in sorted(SWEEP_DIRS) for row in write_summary(d)]
    for d in sorted(SWEEP_DIRS):
        print(f"[sweep] {d}/summary.md")
    return 1 if any(r["status"] != "completed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
