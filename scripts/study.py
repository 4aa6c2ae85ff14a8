"""Study: methods x seeds (x settings) as paired Flower runs, then an honest paired report.

    python scripts/study.py run --out studies/fmnist --methods fedact fedadamw fedavg --seeds 0-9 \\
        --grid partition.alpha=0.1,0.6 -- dataset=fashion_mnist dataset.path=/data/fmnist num_rounds=60
    python scripts/study.py run --out studies/fmnist-tuned --tuned tuning/fmnist/tuned.yaml ...
    python scripts/study.py report studies/fmnist

``run`` makes one job per (setting of ``--grid``, method, seed): the overrides after ``--``, then the
setting's, then ``algorithm=<method>`` (and the method's tuned overrides from ``--tuned``, written by
scripts/tune.py), then ``seed=<seed>``. Each job is its own Flower run through scripts/sweep.py's
runner, all of them on one local engine (``fedact_app.cli.engine.LocalEngine``: one SuperLink
and, one job at a time, one Ray cluster; ``--max-parallel N`` runs N at once), in
``<out>/jobs/<job>/`` with the sweep's ``result.json``, ``flower.log`` and the run folder; the job's
name says its method, setting and seed. A job whose folder already holds a completed run of the
same overrides is skipped (``--rerun`` runs it again), so an interrupted study continues where it
stopped. ``run`` ends with ``report``.

``report`` writes ``<out>/study.md`` and ``study.tex``: per method and setting the test accuracy
(``--metric final|best``) as mean ± std over seeds (scripts/table.py), and for the reference method
(``--reference``, default fedact) against every other method: the per-seed difference
(reference − baseline, in points), their mean ± std, the sign count (wins/losses/ties) and two-sided
Wilcoxon signed-rank and paired t-test p-values (fedact_app.paired.paired_stats). Runs are paired
by seed within one setting and must have trained the same clients in every round (metrics.jsonl's
``sampled_clients``): otherwise the comparison is refused and study.md says why
(fedact_app.paired.pair_runs). The accuracy and direction-consistency curves are drawn with
scripts/plot.py into ``<out>/figures``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
for path in (APP_DIR, APP_DIR / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import yaml  # noqa: E402

import plot  # noqa: E402  (scripts/plot.py)
import sweep  # noqa: E402  (scripts/sweep.py: the job runner)
import table  # noqa: E402  (scripts/table.py)
from fedact_app.config import compose_unchecked  # noqa: E402
from fedact_app.paired import PairedComparison, paired_comparison, training_settings  # noqa: E402
from fedact_app.report import (  # noqa: E402
    METHODS, ReportError, Run, group_runs, load_runs, method_name, value_cells)

CURVES = ("test_accuracy", "direction_consistency")


# ------------------------------------------------------------------ jobs


@dataclass(frozen=True)
class Job:
    name: str
    overrides: tuple[str, ...]


def parse_seeds(text: list[str]) -> list[int]:
    """``0-9`` or ``0 1 2`` (or both) -> the seeds, in order, without repeats."""
    seeds: list[int] = []
    for item in text:
        low, sep, high = item.partition("-")
        for seed in (range(int(low), int(high) + 1) if sep else [int(item)]):
            if seed not in seeds:
                seeds.append(seed)
    return seeds


def expand_grid(grid: list[str]) -> list[list[str]]:
    """``["partition.alpha=0.1,0.6", "local_steps=5,10"]`` -> every combination as a list of overrides."""
    axes = []
    for item in grid:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--grid expects key=v1,v2,..., got {item!r}")
        axes.append([f"{key}={value}" for value in values.split(",")])
    return [list(combination) for combination in itertools.product(*axes)]


def read_tuned(path: Path) -> dict:
    """scripts/tune.py's file: ``methods`` (method -> overrides) and the tuning ``seeds``."""
    tuned = yaml.safe_load(path.read_text())
    if not isinstance(tuned, dict) or not isinstance(tuned.get("methods"), dict):
        raise ValueError(f"{path}: not a tuned file of scripts/tune.py (no 'methods' mapping)")
    return tuned


def study_jobs(methods: list[str], seeds: list[int], grid: list[str], shared: list[str],
               tuned: dict | None = None) -> list[Job]:
    """Every (setting, method, seed) job of the study, settings outermost, seeds innermost.

    With ``tuned`` each method gets its own tuned overrides (ValueError when a method has none, or
    when a study seed was a tuning seed: tuning and the study must not share a seed)."""
    if tuned is not None:
        if missing := [m for m in methods if m not in tuned["methods"]]:
            raise ValueError(f"the tuned file has no overrides for {', '.join(missing)}")
        if shared_seeds := sorted(set(seeds) & set(tuned.get("seeds", []))):
            raise ValueError(f"seeds {shared_seeds} were tuning seeds: a study must use other seeds")
    jobs = []
    for setting in expand_grid(grid):
        for method in methods:
            own = list(tuned["methods"][method]) if tuned is not None else []
            for seed in seeds:
                overrides = (*shared, *setting, f"algorithm={method}", *own, f"seed={seed}")
                jobs.append(Job(job_name(method, setting, seed, overrides), overrides))
    return jobs


def job_name(method: str, setting: list[str], seed: int, overrides: tuple[str, ...]) -> str:
    """``fedact_partition.alpha=0.1_s3_<hash of every override>``: readable, and a different set of
    overrides never reuses another job's folder."""
    digest = hashlib.sha256("\0".join(overrides).encode()).hexdigest()[:8]
    parts = [method, *[o.replace("/", "-") for o in setting], f"s{seed}", digest]
    return "_".join(parts)


def completed_row(job_dir: Path, overrides: tuple[str, ...]) -> dict | None:
    """The job's result row when its folder holds a completed run of these overrides, else None."""
    result = job_dir / "result.json"
    if not result.is_file():
        return None
    row = json.loads(result.read_text())
    done = (row.get("status") == "completed" and row.get("overrides") == " ".join(overrides)
            and row.get("run_dir") and (job_dir / Path(row["run_dir"]).name / "summary.json").is_file())
    return row if done else None


def run_job(jobs_dir: Path, job: Job, launch: sweep.LaunchOptions, engine: sweep.LocalEngine,
            rerun: bool = False) -> dict:
    """Run one job as a Flower run on ``engine`` in ``jobs_dir/<job.name>`` (skipped when already
    completed and not ``rerun``); returns its row (``skipped`` True when it was not run again). Never raises for a
    failed run or an invalid config: the row says what went wrong."""
    job_dir = jobs_dir / job.name
    if not rerun and (row := completed_row(job_dir, job.overrides)) is not None:
        return {**row, "skipped": True}
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        cfg = compose_unchecked(list(job.overrides))
    except Exception as err:  # noqa: BLE001 - Hydra's composition errors: an unknown key, a bad type
        row = {"job": job.name, "overrides": " ".join(job.overrides), "status": "invalid config",
               "run_dir": None, "final_test_accuracy": None, "best_test_accuracy": None,
               "error": f"{type(err).__name__}: {err}", "seconds": 0.0}
    else:
        row = sweep.run_combination(cfg, list(job.overrides), job_dir, launch, engine)
    if sweep.STOPPING.is_set() and row["status"] != "completed":  # interrupted: not this job's outcome
        return {**row, "skipped": False}
    sweep._write_atomic(job_dir / "result.json", json.dumps(row, indent=2) + "\n")
    with sweep.SUMMARY_LOCK:
        sweep.write_summary(jobs_dir)
    return {**row, "skipped": False}


def run_jobs(jobs_dir: Path, jobs: list[Job], launch: sweep.LaunchOptions, rerun: bool = False) -> list[dict]:
    """Every job, on one engine, from ``engine.max_parallel`` threads (LocalEngine.for_sweep); one
    progress line each as it finishes; the rows in the jobs' order."""
    rows: list[dict | None] = [None] * len(jobs)
    done = 0

    def one(index: int, engine: sweep.LocalEngine) -> None:
        nonlocal done
        job = jobs[index]
        row = rows[index] = run_job(jobs_dir, job, launch, engine, rerun)
        if sweep.STOPPING.is_set():
            return
        what = "already completed, skipped" if row["skipped"] else f"{row['status']} in {row['seconds']:.0f} s"
        with sweep.SUMMARY_LOCK:
            done += 1
            print(f"[study] {done}/{len(jobs)} {job.name}: {what}"
                  + (f": {row['error'].strip().splitlines()[-1][:300]}" if row.get("error", "").strip() else ""),
                  flush=True)

    with launch.engine() as engine:
        pool = ThreadPoolExecutor(engine.max_parallel)
        try:
            for future in [pool.submit(one, index, engine) for index in range(len(jobs))]:
                future.result()
        except BaseException:  # Ctrl-C, SIGTERM: stop the runs in flight, start no other job
            sweep.STOPPING.set()
            engine.close()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            sweep.STOPPING.clear()  # (the jobs' threads have returned)
    return rows


# ------------------------------------------------------------------ the report


def comparisons(runs: list[Run], reference: str, column: str, kind: str) -> list[PairedComparison | tuple]:
    """Per setting, every run group of the reference method (one per variant) against every other
    method's group trained with the same training settings (``TRAINING_KEYS``: a ``--grid`` over
    ``local_steps`` compares like with like): the PairedComparison, or (setting, reference,
    baseline, why) when they could not be compared (not paired, no value, no matching reference)."""
    found: list[PairedComparison | tuple] = []
    for setting, methods in group_runs(runs).items():
        references = {name: group for name, group in methods.items() if group[0].algorithm == reference}
        if not references:
            found.append((setting, method_name(reference), "every method", "the reference has no runs here"))
        for baseline, base in methods.items():
            if base[0].algorithm == reference:
                continue
            matching = [name for name, group in references.items()
                        if training_settings(group[0]) == training_settings(base[0])]
            if references and not matching:
                found.append((setting, method_name(reference), baseline,
                              f"no {method_name(reference)} runs with its training settings "
                              f"({training_settings(base[0])})"))
            for name in matching:
                try:
                    found.append(paired_comparison(references[name], base, column, kind))
                except ReportError as err:
                    found.append((setting, name, baseline, str(err)))
    return found


def _p(value: float | None) -> str:
    return "–" if value is None else (f"{value:.2g}" if value < 0.001 else f"{value:.3f}")


def _signed(value: float) -> str:
    return f"{value:+.2f}"


def paired_markdown(found: list[PairedComparison | tuple], column: str, kind: str) -> str:
    """The summary table (one row per setting and baseline) and a per-seed table per setting."""
    unit = " (points)" if column.endswith("accuracy") else ""
    lines = [f"## Paired differences: reference − baseline{unit}, {column} {table.CAPTIONS[kind]}", "",
             "Pairs are runs of one setting and seed that trained the same clients in every round "
             "(checked on metrics.jsonl's `sampled_clients`). W/L/T: seeds where the reference is "
             "ahead / behind / level. p: two-sided, Wilcoxon signed-rank (zero differences dropped) "
             "and paired t-test.", "",
             "| Setting | Reference | Baseline | Seeds | Mean ± std | W/L/T | Wilcoxon p | t-test p |",
             "|---|---|---|---:|---:|:---:|---:|---:|"]
    refused = []
    for item in found:
        if isinstance(item, PairedComparison):
            s = item.stats
            spread = "" if s.std is None else f" ± {s.std:.2f}"
            lines.append(f"| {item.setting.title} | {item.reference} | {item.baseline} | {s.n} | "
                         f"{_signed(s.mean)}{spread} | {s.wins}/{s.losses}/{s.ties} | {_p(s.wilcoxon_p)} | "
                         f"{_p(s.ttest_p)} |")
        else:
            refused.append(item)
    if refused:
        lines += ["", "### Not compared", ""]
        lines += [f"- {setting.title}, {ref} vs {base}: {why}" for setting, ref, base, why in refused]
    # one per-seed table per setting and reference (an ablation compares several references)
    by_reference: dict = {}
    for item in found:
        if isinstance(item, PairedComparison):
            by_reference.setdefault((item.setting, item.reference), []).append(item)
    for (setting, reference), items in by_reference.items():
        seeds = sorted({seed for item in items for seed in item.seeds})
        several = sum(key[0] == setting for key in by_reference) > 1
        lines += ["", f"### {setting.title}{f', {reference}' if several else ''}: per seed", "",
                  f"| Seed | {items[0].reference} | " + " | ".join(f"− {i.baseline}" for i in items) + " |",
                  "|---:|---:|" + "---:|" * len(items)]
        for seed in seeds:
            ref = next((dict(zip(i.seeds, i.reference_values))[seed] for i in items if seed in i.seeds), None)
            cells = [_signed(dict(zip(i.seeds, i.differences))[seed]) if seed in i.seeds else "–" for i in items]
            lines.append(f"| {seed} | {'–' if ref is None else f'{ref:.2f}'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def paired_latex(found: list[PairedComparison | tuple]) -> str:
    """The summary table as a booktabs tabular."""
    lines = ["\\begin{tabular}{lllrrcrr}", "  \\toprule",
             "  Setting & Reference & Baseline & Seeds & Mean $\\pm$ std & W/L/T & Wilcoxon $p$ & $t$-test $p$ \\\\",
             "  \\midrule"]
    for item in found:
        if isinstance(item, PairedComparison):
            s = item.stats
            spread = "" if s.std is None else f" $\\pm$ {s.std:.2f}"
            lines.append("  " + " & ".join([table.tex_escape(item.setting.title), table.tex_escape(item.reference),
                                            table.tex_escape(item.baseline), str(s.n), f"{_signed(s.mean)}{spread}",
                                            f"{s.wins}/{s.losses}/{s.ties}", _p(s.wilcoxon_p), _p(s.ttest_p)])
                         + " \\\\")
    lines += ["  \\bottomrule", "\\end{tabular}"]
    return "\n".join(lines) + "\n"


def write_report(study_dir: Path, reference: str = "fedact", column: str = "test_accuracy",
                 kind: str = "final", figures: bool = True) -> Path:
    """``study.md`` and ``study.tex`` (and the figures) of the completed runs under ``study_dir``."""
    runs = load_runs([study_dir])
    cells = value_cells(runs, column, kind)
    if not cells:
        raise ReportError(f"no run has {column}")
    found = comparisons(runs, reference, column, kind)
    seeds = sorted({run.seed for run in runs})
    lines = [f"# Study: {method_name(reference)} against each baseline", "",
             f"{len(runs)} completed runs, seeds {', '.join(map(str, seeds))}. Source: `{study_dir}`.", "",
             "## Mean ± std over seeds", "", table.markdown_table(cells, column, kind),
             paired_markdown(found, column, kind)]
    if figures:
        plotted = plot.plot_runs(runs, list(CURVES), study_dir / "figures")
        lines += ["## Curves (mean ± std over seeds)", ""]
        lines += [f"![{metric} {setting.title}](figures/{metric}_{setting.slug}.png)"
                  for metric in CURVES for setting in plotted.get(metric, {})]
    (study_dir / "study.md").write_text("\n".join(lines) + "\n")
    (study_dir / "study.tex").write_text(table.latex_table(cells, column, kind) + "\n" + paired_latex(found))
    return study_dir / "study.md"


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    shared = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run the study's jobs (skipping completed ones), then report")
    run.add_argument("--out", type=Path, required=True, help="the study folder")
    run.add_argument("--methods", nargs="+", required=True, choices=list(METHODS))
    run.add_argument("--seeds", nargs="+", required=True, help="e.g. 0-9, or 0 1 2")
    run.add_argument("--grid", nargs="*", default=[], help="settings swept, e.g. partition.alpha=0.1,0.6")
    run.add_argument("--tuned", type=Path, default=None, help="scripts/tune.py's tuned.yaml: each method's own overrides")
    run.add_argument("--rerun", action="store_true", help="run completed jobs again too")
    run.add_argument("--num-gpus", type=float, default=None,
                     help="GPUs per simulated client (default: the automatic share of fedact_app/cli/resources.py)")
    run.add_argument("--num-cpus", type=int, default=1, help="CPUs per simulated client")
    run.add_argument("--timeout", type=float, default=86400.0, help="seconds per run")
    run.add_argument("--max-parallel", type=int, default=1,
                     help="runs computing at once (default 1: one shared Ray cluster, a job starting while "
                          "the last one shuts down; N > 1: each run its own Ray cluster)")
    run.add_argument("--mps", action="store_true", help=sweep.MPS_HELP)
    report = commands.add_parser("report", help="study.md / study.tex / figures from a study folder")
    report.add_argument("out", type=Path, help="the study folder")
    for sub in (run, report):
        sub.add_argument("--reference", default="fedact", choices=list(METHODS))
        sub.add_argument("--metric", choices=("final", "best"), default="final")
        sub.add_argument("--column", default="test_accuracy")
    args = parser.parse_args(argv)
    if args.command == "run":
        try:
            tuned = read_tuned(args.tuned) if args.tuned else None
            jobs = study_jobs(args.methods, parse_seeds(args.seeds), args.grid, shared, tuned)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        if args.max_parallel < 1:
            parser.error(f"--max-parallel must be >= 1, got {args.max_parallel}")
        launch = sweep.LaunchOptions(args.num_gpus, args.num_cpus, args.timeout, args.max_parallel, args.mps)
        rows = run_jobs(args.out / "jobs", jobs, launch, args.rerun)
        failed = [r for r in rows if r["status"] != "completed"]
        if failed:
            print(f"[study] {len(failed)} of {len(rows)} jobs did not complete: {args.out / 'jobs' / 'summary.md'}")
    try:
        path = write_report(args.out, args.reference, args.column, args.metric)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path.read_text())
    print(path)
    return 1 if args.command == "run" and failed else 0


if __name__ == "__main__":
    sys.exit(main())
