"""fedact_app.report, scripts/plot.py and scripts/table.py on hand-written run folders; the sweep's
progress line."""

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

APP_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(APP_DIR / "scripts"))

import plot  # noqa: E402
import sweep  # noqa: E402
import table  # noqa: E402

from fedact_app import report  # noqa: E402
from fedact_app.cli.launch import RunResult  # noqa: E402
from fedact_app.report import ReportError, Setting  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALPHAS = (0.6, 0.1)
SEEDS = (1, 2)
TRUST_METRICS = ("direction_consistency", "positive_ratio", "top_p_mass")


def accuracies(algorithm: str, alpha: float, seed: int) -> list[float]:
    """Test accuracy of rounds 0..3: FedACT leads at Dir-0.6, FedAdamW at Dir-0.1; seeds differ."""
    lead = {("fedact", 0.6): 0.10, ("fedadamw", 0.1): 0.10}.get((algorithm, alpha), 0.0)
    top = 0.5 + lead + 0.013 * seed + (0.004 if algorithm == "fedact" else 0.0)
    return [0.1, 0.6 * top, top + 0.02, top]  # best is round 2, final is round 3


def trust_value(metric: str, algorithm: str, alpha: float, seed: int, rnd: int) -> float:
    return round(0.1 * TRUST_METRICS.index(metric) + 0.01 * rnd + 0.003 * seed + alpha / 10
                 + (0.05 if algorithm == "fedact" else 0.0), 6)


def write_run(folder: Path, algorithm: str, alpha: float, seed: int, trust: bool = True,
              finished: bool = True, rho: float = 0.5, local_steps: int = 50, num_rounds: int = 3,
              extra: str = "") -> Path:
    """A run folder as fedact_app.results writes it (the config reduced to the keys read)."""
    run_dir = folder / f"20260101-000000_{algorithm}_cifar10_vit_tiny_dir{alpha:g}_s{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        f"dataset:\n  name: cifar10\nmodel:\n  name: vit_tiny\npartition:\n  name: dirichlet\n"
        f"  alpha: {alpha}\nalgorithm:\n  name: {algorithm}\n  lr: 0.0003\n  rho: {rho}\n"
        f"num_rounds: {num_rounds}\nlocal_steps: {local_steps}\nseed: {seed}\n{extra}")
    rows = []
    for rnd, accuracy in enumerate(accuracies(algorithm, alpha, seed)):
        row = {"round": rnd, "test_loss": 2.0 - rnd / 10, "test_accuracy": accuracy}
        if rnd:
            row.update(train_loss=1.0, lr=3e-4, clients=2)
            if trust:
                row.update({m: trust_value(m, algorithm, alpha, seed, rnd) for m in TRUST_METRICS})
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (run_dir / "summary.json").write_text(json.dumps({
            "final_test_accuracy": rows[-1]["test_accuracy"], "rounds": 3, "run_dir": str(run_dir)}))
    return run_dir


@pytest.fixture
def sweep_dir(tmp_path) -> Path:
    """A fake sweep: FedACT and FedAdamW x 2 seeds x Dir-{0.6, 0.1}, one FedAvg run without trust
    metrics, one failed job with a finished-looking run (accuracy 0.99) that must not count, and a
    run folder that never finished."""
    root = tmp_path / "sweep"
    jobs = [("fedact", alpha, seed) for alpha in ALPHAS for seed in SEEDS]
    jobs += [("fedadamw", alpha, seed) for alpha in ALPHAS for seed in SEEDS]
    summary = []
    for job, (algorithm, alpha, seed) in enumerate(jobs):
        run_dir = write_run(root / str(job), algorithm, alpha, seed)
        summary.append({"job": str(job), "status": "completed", "run_dir": f"/elsewhere/{run_dir.name}",
                        "overrides": f"algorithm={algorithm} partition.alpha={alpha} seed={seed}"})
    fedavg = write_run(root / "8", "fedavg", 0.6, 1, trust=False)
    summary.append({"job": "8", "status": "completed", "overrides": "algorithm=fedavg",
                    "run_dir": str(fedavg)})
    failed = write_run(root / "9", "fedprox", 0.6, 1)
    (failed / "metrics.jsonl").write_text(json.dumps({"round": 0, "test_accuracy": 0.99}) + "\n")
    summary.append({"job": "9", "status": "failed", "overrides": "algorithm=fedprox",
                    "run_dir": str(failed), "error": "boom"})
    summary.append({"job": "10", "status": "invalid config", "overrides": "algorithm.tau=2",
                    "run_dir": None, "error": "ConfigError"})
    (root / "summary.jsonl").write_text("".join(json.dumps(r) + "\n" for r in summary))
    write_run(root / "11", "localadam", 0.6, 1, finished=False)
    return root


def expected_cell(algorithm: str, alpha: float, kind: str) -> str:
    """The table cell computed here independently: mean ± sample std in % over the seeds."""
    pick = (lambda acc: acc[-1]) if kind == "final" else max
    values = [100 * pick(accuracies(algorithm, alpha, seed)) for seed in SEEDS]
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


# ------------------------------------------------------------------ loading


def test_only_completed_runs_are_loaded_with_warnings(sweep_dir):
    warnings = []
    runs = report.load_runs([sweep_dir], warn=warnings.append)
    assert sorted((r.algorithm, r.setting.alpha, r.seed) for r in runs) == sorted(
        [(a, alpha, s) for a in ("fedact", "fedadamw") for alpha in ALPHAS for s in SEEDS]
        + [("fedavg", 0.6, 1)])
    text = "\n".join(warnings)
    assert "job 9 (algorithm=fedprox) is failed" in text and "job 10 (algorithm.tau=2)" in text
    assert "localadam" in text and "no summary.json" in text
    assert runs[0].setting == Setting("vit_tiny", "cifar10", "dirichlet", 0.6)
    assert runs[0].setting.title == "CIFAR-10 / ViT-Tiny / Dir-0.6"
    assert [r.method for r in runs[:5]] == ["FedAvg", "FedAdamW", "FedAdamW", "FedACT", "FedACT"]


def test_a_run_folder_itself_and_duplicates(sweep_dir, tmp_path):
    one = next((sweep_dir / "0").iterdir())
    assert [r.path for r in report.load_runs([one])] == [one]
    again = write_run(tmp_path / "rerun", "fedact", 0.6, 1)
    warnings = []
    runs = report.load_runs([sweep_dir, again.parent], warn=warnings.append)
    assert len(runs) == 9 and any("same method, settings and seed" in w for w in warnings)


def test_an_ablation_sweep_keeps_its_variants_apart(tmp_path, capsys):
    """Runs of one method that differ in a setting (rho here) are rows of their own, named by it."""
    for rho in (0.3, 0.5, 0.7):
        write_run(tmp_path / f"rho{rho}", "fedact", 0.6, 1, rho=rho)
    write_run(tmp_path / "adamw", "fedadamw", 0.6, 1)
    warnings = []
    runs = report.load_runs([tmp_path], warn=warnings.append)
    assert [r.method for r in runs] == ["FedAdamW", "FedACT (rho=0.3)", "FedACT (rho=0.5)", "FedACT (rho=0.7)"]
    assert warnings == []
    assert table.main([str(tmp_path), "--out", str(tmp_path / "tab")]) == 0
    markdown = (tmp_path / "tab" / "table.md").read_text()
    assert all(f"| FedACT (rho={rho}) |" in markdown for rho in (0.3, 0.5, 0.7))


def test_runs_that_differ_in_a_training_setting_are_rows_of_their_own(tmp_path):
    """Two sweeps of one method and seed with other local_steps: not one run kept as a duplicate
    of the other (nor two seeds of one row), but one row each, named by the setting."""
    write_run(tmp_path / "k5", "fedact", 0.6, 1, local_steps=5)
    write_run(tmp_path / "k50", "fedact", 0.6, 1, local_steps=50)
    warnings = []
    runs = report.load_runs([tmp_path], warn=warnings.append)
    assert sorted(r.method for r in runs) == ["FedACT (local_steps=5)", "FedACT (local_steps=50)"]
    assert warnings == []


def test_a_resumed_run_and_an_older_folder_are_the_same_run_as_their_twin(tmp_path):
    """Not told apart: a run resumed with a larger num_rounds (it continues the earlier one; the
    newest folder is kept), and a folder from before precision/wire_dtype/reply_dtype were written (it ran
    with their defaults)."""
    older = write_run(tmp_path / "a", "fedact", 0.6, 1, num_rounds=3)
    resumed = write_run(tmp_path / "b", "fedact", 0.6, 1, num_rounds=5,
                        extra="precision: fp32\nwire_dtype: float32\nreply_dtype: float32\n")
    resumed = resumed.rename(resumed.with_name(resumed.name.replace("20260101-000000", "20260102-000000")))
    warnings = []
    runs = report.load_runs([tmp_path], warn=warnings.append)
    assert [(r.method, r.path) for r in runs] == [("FedACT", resumed)]
    assert warnings == [f"{older}: same method, settings and seed as {resumed}: skipped"]


def test_mean_std():
    assert report.mean_std([1.0]) == (1.0, None)
    assert report.mean_std([1.0, 2.0, 4.0]) == (statistics.mean([1, 2, 4]), statistics.stdev([1, 2, 4]))


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "no such file or folder"),
    (lambda p: p, "no run folders"),
])
def test_bad_paths_give_a_clear_error(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(ReportError, match=message) as err:
        report.load_runs([path])
    assert str(path) in str(err.value)


def test_malformed_files_are_named(tmp_path):
    run_dir = write_run(tmp_path, "fedact", 0.6, 1)
    (run_dir / "metrics.jsonl").write_text('{"round": 0}\n{"round": 1, oops\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl, line 2: not JSON"):
        report.load_runs([tmp_path])
    (run_dir / "metrics.jsonl").write_text('{"round": 0}\n')
    (run_dir / "config.yaml").write_text("model:\n  name: vit_tiny\n")
    with pytest.raises(ReportError, match=r"config.yaml: no partition.name"):
        report.load_runs([tmp_path])


# ------------------------------------------------------------------ table


@pytest.mark.parametrize("kind", ["final", "best"])
def test_table_cells_are_mean_and_std_over_seeds_with_the_best_bold(sweep_dir, tmp_path, kind, capsys):
    out = tmp_path / "tables"
    assert table.main([str(sweep_dir), "--metric", kind, "--out", str(out)]) == 0
    markdown = (out / "table.md").read_text()
    assert capsys.readouterr().out.startswith(markdown)
    fedavg = f"{100 * accuracies('fedavg', 0.6, 1)[-1 if kind == 'final' else 2]:.2f}"
    assert "| Method | ViT-Tiny / CIFAR-10 / Dir-0.6 | ViT-Tiny / CIFAR-10 / Dir-0.1 |" in markdown
    assert f"| FedAvg | {fedavg} | – |" in markdown
    assert (f"| FedAdamW | {expected_cell('fedadamw', 0.6, kind)} | "
            f"**{expected_cell('fedadamw', 0.1, kind)}** |") in markdown
    assert (f"| FedACT | **{expected_cell('fedact', 0.6, kind)}** | "
            f"{expected_cell('fedact', 0.1, kind)} |") in markdown
    body = [line.split(" |")[0] for line in markdown.splitlines() if line.startswith("| Fed")]
    assert body == ["| FedAvg", "| FedAdamW", "| FedACT"]  # the paper's order; no FedProx (failed)
    latex = (out / "table.tex").read_text()
    for literal in ("\\toprule", "\\midrule", "\\bottomrule", "\\multirow{3}{*}{\\textbf{Method}}",
                    "\\multicolumn{2}{c}{\\textbf{ViT-Tiny}}", "\\multicolumn{2}{c}{\\textbf{CIFAR-10}}",
                    "\\cmidrule(lr){2-3}", "& Dir-0.6 & Dir-0.1 \\\\", f"FedAvg & {fedavg} & -- \\\\",
                    "FedACT & \\textbf{" + expected_cell("fedact", 0.6, kind).replace("±", "$\\pm$") + "}"):
        assert literal in latex, literal


def test_ties_are_all_bold_and_a_single_seed_shows_no_std():
    column = Setting("resnet18", "cifar100", "iid", None)
    cells = {"FedAvg": {column: (41.234, None)}, "FedACT": {column: (41.2349, 0.5)},
             "FedAdamW": {column: (40.0, 1.0)}}
    markdown = table.markdown_table(cells, "test_accuracy", "final")
    assert "| ResNet-18 / CIFAR-100 / IID |" in markdown
    assert "| FedAvg | **41.23** |" in markdown and "| FedACT | **41.23 ± 0.50** |" in markdown
    assert "| FedAdamW | 40.00 ± 1.00 |" in markdown


def write_language_run(folder: Path, algorithm: str, model: str, perplexities: list[float]) -> None:
    """A pre-training run folder as fedact_app.results writes it (config reduced to the keys read)."""
    run_dir = folder / f"20260101-000000_{algorithm}_c4_{model}_lm_pretrain_s1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        f"task: lm_pretrain\ndataset:\n  name: c4\nmodel:\n  name: {model}\npartition:\n  name: dirichlet\n"
        f"  alpha: 0.6\nalgorithm:\n  name: {algorithm}\nseed: 1\n")
    rows = [{"round": r, "test_loss": math.log(p), "test_perplexity": p} for r, p in enumerate(perplexities)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text("{}")


def test_language_runs_tabulate_perplexity_with_the_lowest_bold(tmp_path, capsys):
    write_language_run(tmp_path, "localadamw", "llama_60m", [300.0, 40.0, 37.09])
    write_language_run(tmp_path, "fedact", "llama_60m", [300.0, 35.0, 36.0])
    out = tmp_path / "tables"
    for kind, fedact_cell in (("final", "36.00"), ("best", "35.00")):
        assert table.main([str(tmp_path), "--column", "test_perplexity", "--metric", kind, "--out", str(out)]) == 0
        markdown = (out / "table.md").read_text()
        assert "| Method | Llama-60M / C4-en / lm_pretrain |" in markdown  # not the unused Dir-0.6
        assert "lower is better" in markdown.splitlines()[0]
        assert "| LocalAdamW | 37.09 |" in markdown  # its final is also its lowest
        assert f"| FedACT | **{fedact_cell}** |" in markdown
        assert "\\caption{Test perplexity" in (out / "table.tex").read_text()


def test_table_reports_a_bad_path(tmp_path, capsys):
    assert table.main([str(tmp_path / "nope")]) == 2
    assert f"error: {tmp_path / 'nope'}: no such file or folder" in capsys.readouterr().err


# ------------------------------------------------------------------ plots


def test_plot_series_equal_the_runs_and_skip_methods_without_the_metric(sweep_dir, tmp_path, capsys):
    runs = report.load_runs([sweep_dir], warn=lambda _: None)
    plotted = plot.plot_runs(runs, ["test_accuracy", *TRUST_METRICS, "amplified_fraction"], tmp_path / "f")
    for alpha in ALPHAS:
        setting = Setting("vit_tiny", "cifar10", "dirichlet", alpha)
        curve = plotted["test_accuracy"][setting]["FedAdamW"]
        assert curve.rounds == (0, 1, 2, 3) and curve.seeds == 2
        by_seed = [accuracies("fedadamw", alpha, seed) for seed in SEEDS]
        assert list(curve.mean) == [statistics.mean(v) for v in zip(*by_seed)]
        assert list(curve.std) == [statistics.stdev(v) for v in zip(*by_seed)]
        for metric in TRUST_METRICS:
            curve = plotted[metric][setting]["FedACT"]
            assert curve.rounds == (1, 2, 3)
            assert list(curve.mean) == [statistics.mean(trust_value(metric, "fedact", alpha, s, r)
                                                         for s in SEEDS) for r in (1, 2, 3)]
            assert set(plotted[metric][setting]) == {"FedAdamW", "FedACT"}  # no FedAvg
    fedavg = plotted["test_accuracy"][Setting("vit_tiny", "cifar10", "dirichlet", 0.6)]["FedAvg"]
    assert fedavg.seeds == 1 and list(fedavg.mean) == accuracies("fedavg", 0.6, 1)
    assert plotted["amplified_fraction"] == {}
    printed = capsys.readouterr().out
    assert "note: no amplified_fraction in the runs of CIFAR-10 / ViT-Tiny / Dir-0.1: figure skipped" in printed
    assert not list((tmp_path / "f").glob("amplified_fraction*"))
    assert str(tmp_path / "f" / "direction_consistency_cifar10_vit_tiny_dir0.1.pdf") in printed


def test_plot_main_writes_png_and_pdf(sweep_dir, tmp_path, capsys):
    out = tmp_path / "figures"
    assert plot.main([str(sweep_dir), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert names == {f"{metric}_cifar10_vit_tiny_dir{alpha}.{fmt}"
                     for metric in ("test_accuracy", *TRUST_METRICS)
                     for alpha in ALPHAS for fmt in ("png", "pdf")}
    for path in out.iterdir():
        assert path.read_bytes().startswith(PNG_MAGIC if path.suffix == ".png" else b"%PDF")
    assert plot.main([str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_metric_no_run_has_is_an_error_naming_the_columns(sweep_dir, tmp_path, capsys):
    """A mistyped --metric / --column writes nothing and fails, listing the columns the runs have
    (a metric only some methods have, as the trust scores, is a note per figure instead)."""
    assert plot.main([str(sweep_dir), "--out", str(tmp_path / "p"), "--metric", "test_acc"]) == 2
    err = capsys.readouterr().err
    assert "error: no run has the column test_acc; the runs' columns: clients, " in err and "test_accuracy" in err
    assert not (tmp_path / "p").exists()
    assert table.main([str(sweep_dir), "--column", "test_acc", "--out", str(tmp_path / "t")]) == 2
    assert "error: no run has test_acc; the runs' columns: clients, " in capsys.readouterr().err


def test_plot_script_runs_as_a_command(sweep_dir, tmp_path):
    out = tmp_path / "cmd"
    proc = subprocess.run([sys.executable, str(APP_DIR / "scripts" / "plot.py"), str(sweep_dir),
                           "--out", str(out), "--metric", "test_accuracy"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    written = [Path(line) for line in proc.stdout.splitlines() if line.startswith(str(out))]
    assert len(written) == 4 and all(p.stat().st_size > 0 for p in written)


# ------------------------------------------------------------------ sweep progress


def test_sweep_prints_done_over_total_including_a_presets_grid(tmp_path, monkeypatch, capsys, fake_engine):
    """experiment=ablation_local sweeps algorithm x model x alpha; the command line pins the
    algorithm, so 2 x 2 = 4 combinations (the launcher is faked)."""
    def fake_run(app_dir, overrides, num_supernodes, **kwargs):
        return RunResult(run_id=1, status="finished:completed", completed=True, log="", seconds=0.0)

    fake_engine(fake_run)
    monkeypatch.setattr(sweep, "SWEEP_DIRS", set())
    assert sweep.cli(["-m", "experiment=ablation_local", "algorithm=fedact", f"hydra.sweep.dir={tmp_path}",
                      "hydra/job_logging=none", "hydra/hydra_logging=none"]) == 0
    progress = [line.split(" job ")[0] for line in capsys.readouterr().out.splitlines()
                if line.startswith("[sweep] ") and " job " in line]
    assert progress == ["[sweep] 1/4", "[sweep] 2/4", "[sweep] 3/4", "[sweep] 4/4"]


def test_a_null_final_value_reads_as_nan_not_as_an_earlier_round():
    """metrics.jsonl writes a diverged (NaN/inf) value as null; the run's final value is NaN."""
    rows = ({"round": 0, "test_loss": 2.3}, {"round": 1, "test_loss": 1.1}, {"round": 2, "test_loss": None})
    run = report.Run(path=Path("/runs/fedact_s0"), algorithm="fedact",
                     setting=Setting("vit_tiny", "fashion_mnist", "dirichlet", 0.1), seed=0, rows=rows,
                     hyperparameters=())
    assert math.isnan(run.value("test_loss", "final"))
    assert list(run.series("test_loss")) == [0, 1, 2]


def test_a_methods_variants_get_colours_no_other_line_of_the_figure_has():
    """FedAvg keeps its fixed colour; FedACT's two variants (not names in the fixed map) took
    matplotlib's default cycle before, and one came out in FedAvg's blue."""
    labels = ["FedAvg", "FedAdamW", "FedACT (scale_matched=False)", "FedACT (scale_matched=True)"]
    colors = plot.figure_colors(labels)
    assert len(set(colors.values())) == len(labels)
    assert colors["FedAvg"] == plot.figure_colors(["FedAvg"])["FedAvg"]
