"""Tune each method's learning rate (and FedACT's trust settings) on a validation split, never on
the test set, with Optuna's ask/tell API; write the best overrides for scripts/study.py --tuned.

    python scripts/tune.py --out tuning/fmnist --methods fedact fedadamw fedavg --trials 20 \\
        --seeds 1000 1001 --storage sqlite:///tuning/fmnist/optuna.db -- dataset=fashion_mnist ...
    python scripts/study.py run --out studies/fmnist-tuned --tuned tuning/fmnist/tuned.yaml ...

One Optuna study per method (``optuna.create_study``, maximize; TPE seeded with ``--sampler-seed``);
a trial is ``study.ask()``, one app run per tuning seed through scripts/study.py's job runner, then
``study.tell()``. The runs hold out ``--holdout`` of the training split (``dataset.holdout_fraction``:
seed-fixed rows removed before partitioning) and the server evaluates on it as ``val_accuracy``;
the objective is the mean over the tuning seeds of the final (``--metric best``: the best)
``val_accuracy``. The test split is never evaluated in a tuning run.

Search space: ``algorithm.lr`` log-uniform, for methods with a local Adam in [3e-5, 3e-3], for the
SGD family in [3e-3, 1] (the seed's grids widened; ``--lr-range`` sets one range for all);
for methods whose trust modulation is on (fedact, fedact_local): ``algorithm.tau`` uniform in
[0.1, 1], ``algorithm.gamma`` uniform in [0, 1] and ``algorithm.scale_matched`` in {false, true}.
With ``--lr-grid N`` only ``algorithm.lr`` is searched, on N log-spaced values over the range (the
ends included; one trial per value) and the trust settings keep their config values: the seed's
(the paper's) protocol, and a choice for small budgets. A second call runs the values that have
no completed trial yet (failed or interrupted).
A run that failed (the model diverged) scores 0; a trial whose run could not be launched or timed
out is told FAIL. With ``--storage`` (e.g. ``sqlite:///tuning/optuna.db``) the studies persist and a
second call adds trials until each method has ``--trials`` finished ones; the jobs' folders under
``<out>/jobs`` are reused the same way as the study's.

``<out>/tuned.yaml``: per method its best trial's overrides, score and trial count, and the
tuning seeds (scripts/study.py refuses a study on any of them). Methods an earlier call wrote there
with the same seeds and objective are kept, so the SGD and the Adam families can be tuned by two
calls (each with its own ``--lr-range``) into one file.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
for path in (APP_DIR, APP_DIR / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import optuna  # noqa: E402
import yaml  # noqa: E402

import study as study_script  # noqa: E402  (scripts/study.py: the job runner)
from fedact_app.algorithms import ALGORITHMS  # noqa: E402
from fedact_app.report import METHODS, load_run  # noqa: E402

# log-uniform lr ranges around the seed's grids (its appendix: SGD family {1e-2 .. 3e-1}, AdamW
# family {1e-4 .. 1e-3}), widened about 3x on each side
SGD_LR_RANGE = (3e-3, 1.0)
ADAM_LR_RANGE = (3e-5, 3e-3)
TAU_RANGE = (0.1, 1.0)
GAMMA_RANGE = (0.0, 1.0)

Objective = Callable[[str, list[str], int], float]  # (method, overrides, trial number) -> score


class TrialFailed(RuntimeError):
    """A trial's run could not give a score (not launched, timed out): told to Optuna as FAIL."""


def tunes_trust(method: str) -> bool:
    """Whether the method's trust modulation is on, so tau/gamma/scale_matched change it
    (FedAdamW accepts the keys but ignores them)."""
    algorithm = ALGORITHMS[method]
    return "tau" in algorithm.uses and algorithm.required.get("trust_signal") != "none"


def default_lr_range(method: str) -> tuple[float, float]:
    """ADAM_LR_RANGE for methods with a local Adam (they read ``betas``), else SGD_LR_RANGE."""
    return ADAM_LR_RANGE if "betas" in ALGORITHMS[method].uses else SGD_LR_RANGE


def lr_grid(lr_range: tuple[float, float], points: int) -> list[float]:
    """``points`` log-spaced learning rates from ``lr_range[0]`` to ``lr_range[1]``, both included."""
    low, high = lr_range
    if points < 2 or not 0 < low < high:
        raise ValueError(f"an lr grid needs at least 2 points over 0 < low < high, got {points} over {lr_range}")
    inner = [float(f"{low * (high / low) ** (i / (points - 1)):.6g}") for i in range(1, points - 1)]
    return [float(low), *inner, float(high)]  # the ends exactly: rounded, they could leave the range


def suggest(trial: optuna.Trial, method: str, lr_range: tuple[float, float] | None = None,
            lr_only: bool = False) -> list[str]:
    """The trial's Hydra overrides for ``method`` (see the module docstring for the space);
    ``lr_only``: the lr alone, the trust settings left at their config values."""
    lr_range = lr_range or default_lr_range(method)
    overrides = [f"algorithm.lr={trial.suggest_float('lr', *lr_range, log=True)!r}"]
    if tunes_trust(method) and not lr_only:
        overrides += [f"algorithm.tau={trial.suggest_float('tau', *TAU_RANGE)!r}",
                      f"algorithm.gamma={trial.suggest_float('gamma', *GAMMA_RANGE)!r}",
                      f"algorithm.scale_matched={str(trial.suggest_categorical('scale_matched', [False, True])).lower()}"]
    return overrides


def make_sqlite_folder(storage: str | None) -> None:
    """Make the folder of an SQLite storage's file (``sqlite:///tuning/x/optuna.db``, relative;
    ``sqlite:////abs/path.db``; any SQLite driver, with or without a query), which SQLite does
    not make: ``--out`` and ``--storage`` usually name a folder that no run has made yet. An
    in-memory SQLite database and other storages are left to Optuna."""
    from sqlalchemy.engine import make_url  # Optuna's own dependency for its RDB storages

    if not storage:
        return
    url = make_url(storage)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        Path(url.database).parent.mkdir(parents=True, exist_ok=True)


def tune_method(method: str, objective: Objective, trials: int, storage: str | None = None,
                study_name: str | None = None, sampler_seed: int = 0,
                lr_range: tuple[float, float] | None = None, grid_points: int | None = None) -> optuna.Study:
    """Ask/tell until the method's study has ``trials`` finished trials (a persisted study is
    continued; an SQLite file's folder is made first); returns the study.

    ``grid_points``: instead the lr alone, on that many log-spaced values (``lr_grid``), one trial
    for each value that has no completed trial yet (``trials`` is not used): a second call runs
    again what failed or was interrupted. The values are enqueued trials, not Optuna's
    ``GridSampler``, which calls ``Study.stop()`` when the grid is used up, and that fails outside
    ``Study.optimize()``."""
    make_sqlite_folder(storage)
    study = optuna.create_study(direction="maximize", storage=storage, study_name=study_name or method,
                                load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=sampler_seed))
    if grid_points is None:
        while (done := len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,
                                                                    optuna.trial.TrialState.FAIL)))) < trials:
            run_trial(study, method, objective, f"{done + 1}/{trials}", lr_range, lr_only=False)
        return study
    grid = lr_grid(lr_range or default_lr_range(method), grid_points)
    for number, lr in enumerate(grid, 1):
        completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
        if not any(math.isclose(t.params.get("lr", -1.0), lr, rel_tol=1e-9) for t in completed):
            study.enqueue_trial({"lr": lr})
            run_trial(study, method, objective, f"lr {number}/{len(grid)}", lr_range, lr_only=True)
    return study


def run_trial(study: optuna.Study, method: str, objective: Objective, progress: str,
              lr_range: tuple[float, float] | None, lr_only: bool) -> None:
    """One trial: ``study.ask()``, the objective's runs, ``study.tell()`` (FAIL when they gave no score)."""
    trial = study.ask()
    overrides = suggest(trial, method, lr_range, lr_only=lr_only)
    trial.set_user_attr("overrides", overrides)
    try:
        value = objective(method, overrides, trial.number)
    except TrialFailed as err:
        trial.set_user_attr("error", str(err)[-1000:])
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        print(f"[tune] {method} trial {trial.number} ({progress}): failed: {err}", flush=True)
        return
    study.tell(trial, value)
    print(f"[tune] {method} trial {trial.number} ({progress}): {value:.4f} ({' '.join(overrides)}); "
          f"best {study.best_value:.4f}", flush=True)


def best_overrides(study: optuna.Study) -> list[str]:
    """The overrides of the study's best trial."""
    return list(study.best_trial.user_attrs["overrides"])


def flower_objective(jobs_dir: Path, shared: Sequence[str], seeds: Sequence[int], holdout: float,
                     launch, engine, kind: str = "final") -> Objective:
    """The real objective: one study job per tuning seed (the shared overrides, then
    ``dataset.holdout_fraction``, the method and the trial's overrides), scored by the mean of
    their final (``kind`` best: best) ``val_accuracy``; every run on ``engine``."""
    if not 0 < holdout < 1:
        raise ValueError(f"--holdout must be in (0, 1), got {holdout}: tuning needs a validation split")

    def objective(method: str, overrides: list[str], number: int) -> float:
        scores = []
        for seed in seeds:
            job_overrides = (*shared, f"dataset.holdout_fraction={holdout}", f"algorithm={method}", *overrides,
                             f"seed={seed}")
            job = study_script.Job(study_script.job_name(method, [f"t{number}"], seed, job_overrides), job_overrides)
            row = study_script.run_job(jobs_dir, job, launch, engine)
            scores.append(run_score(jobs_dir / job.name, row, kind))
        return statistics.mean(scores)

    return objective


def run_score(job_dir: Path, row: dict, kind: str) -> float:
    """A tuning job's ``val_accuracy`` (final or best); 0 for a run that failed (diverged);
    TrialFailed when it was not run or timed out, or evaluated no validation split."""
    if row["status"] == "failed":
        return 0.0
    if row["status"] != "completed":
        raise TrialFailed(f"job {row['job']}: {row['status']}: {row.get('error', '')}")
    value = load_run(job_dir / Path(row["run_dir"]).name).value("val_accuracy", kind)
    if value is None or math.isnan(value):
        raise TrialFailed(f"job {row['job']}: no val_accuracy (dataset.holdout_fraction was 0?)")
    return value


def write_tuned(path: Path, studies: dict[str, optuna.Study], seeds: Sequence[int], objective: str,
                searches: dict[str, str] | None = None) -> None:
    """``tuned.yaml``: what scripts/study.py --tuned reads (methods -> overrides, seeds), the scores
    and how each method was searched. The other methods of an existing file with the same seeds and
    objective are kept; a file with other seeds or another objective is replaced, with a warning
    naming the methods it loses (they were tuned for another question)."""
    tuned = {"objective": objective, "seeds": list(seeds), "methods": {}, "scores": {}, "trials": {}, "search": {}}
    if path.exists():
        earlier = yaml.safe_load(path.read_text()) or {}
        if earlier.get("objective") == objective and earlier.get("seeds") == list(seeds):
            for key in tuned.keys() - {"objective", "seeds"}:
                tuned[key].update(earlier.get(key) or {})
        elif lost := sorted(set(earlier.get("methods") or {}) - set(studies)):
            print(f"warning: {path} was tuned with other seeds or another objective; its entries for "
                  f"{', '.join(lost)} are dropped", file=sys.stderr)
    for method, s in studies.items():
        tuned["methods"][method] = best_overrides(s)
        tuned["scores"][method] = round(float(s.best_value), 6)
        tuned["trials"][method] = len(s.trials)
        tuned["search"][method] = (searches or {}).get(method, "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by scripts/tune.py; use with scripts/study.py run --tuned\n"
                    + yaml.safe_dump(tuned, sort_keys=False))


def search_description(method: str, lr_range: tuple[float, float] | None, grid_points: int | None,
                       trials: int) -> str:
    """How ``method`` was searched, for tuned.yaml's ``search``."""
    lr_range = lr_range or default_lr_range(method)
    if grid_points is not None:
        return f"algorithm.lr on the grid {lr_grid(lr_range, grid_points)}"
    trust = ", algorithm.tau, algorithm.gamma, algorithm.scale_matched" if tunes_trust(method) else ""
    return f"TPE, {trials} trials: algorithm.lr log-uniform in {list(lr_range)}{trust}"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    shared = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for jobs/ and tuned.yaml")
    parser.add_argument("--methods", nargs="+", required=True, choices=list(METHODS))
    parser.add_argument("--trials", type=int, default=None, help="finished trials per method (default 20; "
                                                                 "not with --lr-grid)")
    parser.add_argument("--seeds", nargs="+", default=["1000"], help="tuning seeds (default 1000), none of the study's")
    parser.add_argument("--holdout", type=float, default=0.1, help="dataset.holdout_fraction (default 0.1)")
    parser.add_argument("--metric", choices=("final", "best"), default="final", help="val_accuracy at the end or best")
    parser.add_argument("--lr-range", type=float, nargs=2, default=None, metavar=("LOW", "HIGH"),
                        help=f"lr range of every method (default: {ADAM_LR_RANGE} for local-Adam methods, "
                             f"{SGD_LR_RANGE} for the SGD family)")
    parser.add_argument("--lr-grid", type=int, default=None, metavar="N",
                        help="search the lr alone on N log-spaced values over the range, one trial each; "
                             "the trust settings keep their config values")
    parser.add_argument("--storage", default=None, help="Optuna storage URL, e.g. sqlite:///tuning/optuna.db")
    parser.add_argument("--study-name", default="fedact-tune", help="prefix of the Optuna study names")
    parser.add_argument("--sampler-seed", type=int, default=0)
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="GPUs per simulated client (default: the automatic share of fedact_app/cli/resources.py)")
    parser.add_argument("--num-cpus", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=86400.0, help="seconds per run")
    parser.add_argument("--mps", action="store_true", help=study_script.sweep.MPS_HELP)
    args = parser.parse_args(argv)
    seeds = study_script.parse_seeds(args.seeds)
    lr_range = tuple(args.lr_range) if args.lr_range else None
    if args.lr_grid is not None and args.trials is not None:
        parser.error("--trials and --lr-grid exclude each other: a grid runs one trial per value")
    trials = 20 if args.trials is None else args.trials
    if args.lr_grid is not None:
        try:
            for method in args.methods:
                lr_grid(lr_range or default_lr_range(method), args.lr_grid)
        except ValueError as err:
            print(f"error: --lr-grid {args.lr_grid}: {err}", file=sys.stderr)
            return 2
    launch = study_script.sweep.LaunchOptions(args.num_gpus, args.num_cpus, args.timeout, mps=args.mps)
    with launch.engine() as engine:
        try:
            objective = flower_objective(args.out / "jobs", shared, seeds, args.holdout, launch, engine,
                                         args.metric)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        studies = {}
        for method in args.methods:
            name = f"{args.study_name}-{method}" + ("" if args.lr_grid is None else f"-lr-grid{args.lr_grid}")
            studies[method] = tune_method(method, objective, trials, args.storage, name, args.sampler_seed,
                                          lr_range, args.lr_grid)
    if failed := [m for m, s in studies.items() if not any(t.value is not None for t in s.trials)]:
        print(f"error: no trial of {', '.join(failed)} finished: see {args.out / 'jobs' / 'summary.md'}",
              file=sys.stderr)
        return 1
    description = (f"{args.metric} val_accuracy (dataset.holdout_fraction={args.holdout}), mean over the "
                   f"tuning seeds; shared overrides: {' '.join(shared)}")
    write_tuned(args.out / "tuned.yaml", studies, seeds, description,
                {m: search_description(m, lr_range, args.lr_grid, trials) for m in studies})
    print((args.out / "tuned.yaml").read_text())
    print(json.dumps({m: s.best_value for m, s in studies.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
