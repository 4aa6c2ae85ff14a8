"""scripts/study.py: the study's jobs, skipping completed ones, and its paired report."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

APP_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(APP_DIR / "scripts"))

import study  # noqa: E402

from fedact_app.cli.launch import RunResult  # noqa: E402
from fedact_app.config import compose  # noqa: E402

SAMPLES = [[0, 3], [1, 2], [2, 4]]  # rounds 1..3


def write_study_run(jobs: Path, algorithm: str, seed: int, final: float, samples=SAMPLES, alpha: float = 0.1,
                    **algorithm_keys) -> Path:
    """A completed job folder of the study (result.json + run folder), as run_job leaves it."""
    variant = "".join(f"_{key}={value}" for key, value in algorithm_keys.items())
    job = f"{algorithm}{variant}_partition.alpha={alpha}_s{seed}_00000000"
    run_dir = jobs / job / f"20260101-000000_{algorithm}_fashion_mnist_vit_tiny_dir{alpha}_s{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({
        "dataset": {"name": "fashion_mnist"}, "model": {"name": "vit_tiny"},
        "partition": {"name": "dirichlet", "alpha": alpha},
        "algorithm": {"name": algorithm, "lr": 0.001, **algorithm_keys},
        "num_clients": 20, "local_steps": 10, "batch_size": 32, "seed": seed}))
    rows = [{"round": 0, "test_accuracy": 0.1}]
    rows += [{"round": r, "sampled_clients": s, "test_accuracy": final * r / len(samples),
              **({"direction_consistency": 0.1 * r} if algorithm != "fedavg" else {})}
             for r, s in enumerate(samples, start=1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"final_test_accuracy": final}))
    (jobs / job / "result.json").write_text(json.dumps({
        "job": job, "status": "completed", "run_dir": str(run_dir), "overrides": f"seed={seed}",
        "error": "", "final_test_accuracy": final, "best_test_accuracy": final, "seconds": 1.0}))
    return run_dir


def test_jobs_cover_settings_methods_and_seeds_with_each_methods_tuned_overrides():
    tuned = {"methods": {"fedact": ["algorithm.lr=0.002", "algorithm.tau=0.4"], "fedavg": ["algorithm.lr=0.05"]},
             "seeds": [100, 101]}
    jobs = study.study_jobs(["fedact", "fedavg"], study.parse_seeds(["0-2", "2"]), ["partition.alpha=0.1,0.6"],
                            ["num_rounds=60"], tuned)
    assert len(jobs) == 2 * 2 * 3 and len({j.name for j in jobs}) == len(jobs)
    assert jobs[0].overrides == ("num_rounds=60", "partition.alpha=0.1", "algorithm=fedact",
                                 "algorithm.lr=0.002", "algorithm.tau=0.4", "seed=0")
    assert jobs[-1].overrides[-3:] == ("algorithm=fedavg", "algorithm.lr=0.05", "seed=2")
    with pytest.raises(ValueError, match="tuning seeds"):
        study.study_jobs(["fedact"], [100], [], [], tuned)
    with pytest.raises(ValueError, match="no overrides for fedadamw"):
        study.study_jobs(["fedadamw"], [0], [], [], tuned)


def test_a_completed_job_is_skipped_and_a_failed_one_runs_again(tmp_path, fake_engine):
    calls = []

    def fake_run(app_dir, overrides, num_supernodes, **kwargs):
        calls.append(overrides)
        out = Path(compose(overrides).output_dir)
        run_dir = out / f"20260101-00000{len(calls)}_fedact_digits_cnn_small_dir0.6_s0"
        run_dir.mkdir(parents=True)
        completed = len(calls) != 1  # the first launch fails
        if completed:
            (run_dir / "summary.json").write_text(json.dumps(
                {"run_dir": str(run_dir), "final_test_accuracy": 0.5, "best_test_accuracy": 0.5}))
        return RunResult(run_id=len(calls), status="finished:completed" if completed else "finished:failed",
                         completed=completed, log="", seconds=1.0)

    engine = fake_engine(fake_run)
    job = study.study_jobs(["fedact"], [0], [], ["num_rounds=1"])[0]
    launch = study.sweep.LaunchOptions()
    assert study.run_job(tmp_path, job, launch, engine)["status"] == "failed"
    assert study.run_job(tmp_path, job, launch, engine)["status"] == "completed" and len(calls) == 2
    again = study.run_job(tmp_path, job, launch, engine)
    assert again["skipped"] and again["status"] == "completed" and len(calls) == 2
    assert study.run_job(tmp_path, job, launch, engine, rerun=True)["skipped"] is False and len(calls) == 3
    assert (tmp_path / "summary.md").is_file()


def test_report_has_mean_std_paired_differences_sign_counts_and_curves(tmp_path):
    jobs = tmp_path / "jobs"
    for seed, (act, adamw, avg) in enumerate([(0.80, 0.78, 0.70), (0.82, 0.79, 0.71), (0.79, 0.80, 0.69)]):
        write_study_run(jobs, "fedact", seed, act)
        write_study_run(jobs, "fedadamw", seed, adamw)
        write_study_run(jobs, "fedavg", seed, avg)
    md = study.write_report(tmp_path).read_text()
    assert "80.33 ± 1.53" in md  # FedACT's mean ± std over the three seeds, in %
    assert "| Fashion-MNIST / ViT-Tiny / Dir-0.1 | FedACT | FedAdamW | 3 | +1.33 ± 2.08 | 2/1/0 |" in md
    assert "| FedACT | FedAvg | 3 | +10.33 ± 0.58 | 3/0/0 | 0.250 |" in md  # exact Wilcoxon: 2 * 1/8
    assert "| FedACT | FedAdamW | 3 | +1.33 ± 2.08 | 2/1/0 | 0.500 |" in md  # W- = 1: 2 * 2/8
    assert "| 2 | 79.00 | +10.00 | -1.00 |" in md  # per seed: FedAvg, then FedAdamW (the paper's order)
    assert "figures/test_accuracy_fashion_mnist_vit_tiny_dir0.1.png" in md
    assert "figures/direction_consistency_fashion_mnist_vit_tiny_dir0.1.png" in md
    assert (tmp_path / "figures" / "direction_consistency_fashion_mnist_vit_tiny_dir0.1.png").is_file()
    assert "Wilcoxon" in (tmp_path / "study.tex").read_text()


def test_report_refuses_runs_that_trained_other_clients_and_says_why(tmp_path):
    jobs = tmp_path / "jobs"
    for seed in (0, 1):
        write_study_run(jobs, "fedact", seed, 0.8)
        write_study_run(jobs, "fedadamw", seed, 0.7, samples=SAMPLES if seed == 0 else [[0, 3], [1, 5], [2, 4]])
    md = study.write_report(tmp_path, figures=False).read_text()
    assert "### Not compared" in md and "sampled different clients in round 2" in md
    assert "| FedACT | FedAdamW |" not in md  # no statistics from the unpaired seed


@pytest.mark.e2e
def test_study_runs_a_real_flower_job_skips_it_when_resumed_and_reports(tmp_path):
    """One tiny real Flower run through `study.py run`, then the same command again: skipped."""
    command = [sys.executable, str(APP_DIR / "scripts" / "study.py"), "run", "--out", str(tmp_path),
               "--methods", "fedact", "--seeds", "1", "--timeout", "200", "--",
               "num_rounds=2", "num_clients=2", "min_train_nodes=2", "fraction_train=1.0", "local_steps=2"]
    started = time.monotonic()
    first = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    assert first.returncode == 0, first.stdout + first.stderr
    assert "1/1 fedact_s1_" in first.stdout and "completed in" in first.stdout
    md = (tmp_path / "study.md").read_text()
    assert "FedACT" in md and "the reference has no runs here" not in md
    second = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and "already completed, skipped" in second.stdout, second.stdout + second.stderr
    print(f"one study job: {seconds:.1f} s")


def test_two_variants_of_the_reference_get_a_per_seed_table_each(tmp_path):
    """FedACT and FedACT (scale_matched=True) against FedAdamW: each per-seed table shows its
    own reference's values (one table over both showed only the first reference's)."""
    jobs = tmp_path / "jobs"
    for seed, (act, matched, adamw) in enumerate([(0.80, 0.90, 0.78), (0.82, 0.91, 0.79)]):
        write_study_run(jobs, "fedact", seed, act, scale_matched=False)
        write_study_run(jobs, "fedact", seed, matched, scale_matched=True)
        write_study_run(jobs, "fedadamw", seed, adamw)
    md = study.write_report(tmp_path).read_text()
    assert md.count(": per seed") == 2 and ", FedACT (scale_matched=True): per seed" in md
    assert "| 1 | 82.00 | +3.00 |" in md and "| 1 | 91.00 | +12.00 |" in md
