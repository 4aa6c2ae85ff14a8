"""scripts/sweep.py: Hydra multirun, one Flower run per combination, one folder, failures listed."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

APP_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(APP_DIR / "scripts"))

import sweep  # noqa: E402

from fedact_app.cli.launch import RunResult  # noqa: E402
from fedact_app.config import compose  # noqa: E402

TINY = ["num_rounds=1", "num_clients=2", "min_train_nodes=2", "fraction_train=1.0", "local_steps=2"]


@pytest.mark.e2e
def test_sweep_runs_each_combination_and_lists_the_failure(tmp_path):
    """Two combinations, the first invalid (tau=2): it is reported and the second still runs
    as a real Flower run; both land in one folder."""
    proc = subprocess.run(
        [sys.executable, str(APP_DIR / "scripts" / "sweep.py"), "-m", "algorithm.tau=2,0.5", *TINY,
         f"hydra.sweep.dir={tmp_path}", "--timeout", "300"],
        cwd=tmp_path, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # not everything completed
    rows = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert [r["job"] for r in rows] == ["0", "1"]
    bad, good = rows
    assert bad["status"] == "invalid config" and "algorithm.tau" in bad["error"]
    assert "job 0: invalid config (algorithm.tau=2" in proc.stdout and \
        "Invalid config value algorithm.tau=2.0" in proc.stdout  # the reason on the console too
    assert good["status"] == "completed", good
    assert "algorithm.tau=0.5" in good["overrides"]
    run_dir = Path(good["run_dir"])
    assert run_dir.parent == tmp_path / "1" and (run_dir / "metrics.jsonl").is_file()
    assert good["final_test_accuracy"] == json.loads((run_dir / "summary.json").read_text())[
        "final_test_accuracy"]
    assert (tmp_path / "1" / "flower.log").read_text()
    summary = (tmp_path / "summary.md").read_text()
    assert "2 runs, 1 completed, 1 not" in summary and "job 0 (algorithm.tau=2" in summary
    assert "HTTP Request" not in proc.stdout + proc.stderr  # the engine's polls of the SuperLink (httpx)


def test_a_failed_flower_run_is_recorded_and_the_sweep_goes_on(tmp_path, monkeypatch, fake_engine):
    """Every outcome of a run becomes a row; nothing raises (the launcher is faked here)."""
    outcomes = iter([
        RunResult(run_id=1, status="finished:failed", completed=False, log="boom", seconds=1.0,
                  details="Simulation failed with exception: DatasetUnavailableError"),
        RunResult(run_id=2, status="running", completed=False, log="", seconds=1.0, timed_out=True),
        RuntimeError("flower-superlink did not become ready"),
        RunResult(run_id=3, status="finished:completed", completed=True, log="ok", seconds=1.0),
    ])
    seen = []

    def fake_run(app_dir, overrides, num_supernodes, **kwargs):
        seen.append((overrides, num_supernodes, kwargs))
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    fake_engine(fake_run)
    monkeypatch.setattr(sweep, "SWEEP_DIRS", set())
    code = sweep.cli(["-m", "seed=1,2,3,4", *TINY, "output_dir=/elsewhere", "--num-gpus", "0.5",
                      f"hydra.sweep.dir={tmp_path}",
                      "hydra/job_logging=none", "hydra/hydra_logging=none"])  # leave pytest's logging alone
    assert code == 1
    rows = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["failed", "timed out", "launch error", "completed"]
    assert "DatasetUnavailableError" in rows[0]["error"] and "superlink" in rows[2]["error"]
    overrides, supernodes, kwargs = seen[0]
    assert supernodes == 2 and kwargs["num_gpus_per_client"] == 0.5
    assert compose(overrides).output_dir == str(tmp_path / "0") and "/elsewhere" not in overrides
    assert (tmp_path / "0" / "flower.log").read_text() == "boom"
    assert "4 runs, 1 completed, 3 not" in (tmp_path / "summary.md").read_text()


def test_max_parallel_has_the_jobs_in_flight_at_once(tmp_path, monkeypatch, fake_engine):
    """--max-parallel 2: both jobs wait for each other inside the engine's run (a barrier that
    breaks after 20 s, one at a time), and both rows land in the summary."""
    both_in_flight = threading.Barrier(2, timeout=20)

    def fake_run(app_dir, overrides, num_supernodes, **kwargs):
        both_in_flight.wait()
        return RunResult(run_id=1, status="finished:completed", completed=True, log="", seconds=1.0)

    fake_engine(fake_run)
    monkeypatch.setattr(sweep, "SWEEP_DIRS", set())
    code = sweep.cli(["-m", "seed=1,2", *TINY, "--max-parallel", "2", f"hydra.sweep.dir={tmp_path}",
                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    rows = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert code == 0 and [r["status"] for r in rows] == ["completed", "completed"], rows


def test_an_interrupted_sweep_writes_no_outcome_for_the_run_it_stopped(tmp_path, monkeypatch, fake_engine):
    """Ctrl-C while two jobs are in flight: the sweep stops, and the job still running when the
    engine was closed (here: it then returns failed) leaves no result.json or summary row
    claiming that outcome."""
    second_started = threading.Event()

    def fake_run(app_dir, overrides, num_supernodes, **kwargs):
        if "seed=1" in overrides:
            assert second_started.wait(20)
            raise KeyboardInterrupt  # reaches the main thread through the job's future
        second_started.set()
        assert sweep.STOPPING.wait(20)  # still running when the sweep closes the engine
        return RunResult(run_id=2, status="finished:failed", completed=False, log="", seconds=1.0,
                         details="the SuperLink exited")

    fake_engine(fake_run)
    monkeypatch.setattr(sweep, "SWEEP_DIRS", set())
    with pytest.raises(KeyboardInterrupt):
        sweep.cli(["-m", "seed=1,2", *TINY, "--max-parallel", "2", f"hydra.sweep.dir={tmp_path}",
                   "hydra/job_logging=none", "hydra/hydra_logging=none"])
    assert sorted(tmp_path.glob("*/result.json")) == []
    assert not (tmp_path / "summary.jsonl").exists() or not (tmp_path / "summary.jsonl").read_text().strip()


def test_launch_options_are_split_from_hydra_arguments():
    options, rest = sweep.parse_launch_options(["-m", "--num-gpus", "0.25", "a=1,2", "--timeout", "60"])
    assert options == sweep.LaunchOptions(num_gpus=0.25, num_cpus=1, timeout=60.0, max_parallel=1)
    assert sweep.parse_launch_options(["--max-parallel", "3"])[0].max_parallel == 3
    with pytest.raises(SystemExit):
        sweep.parse_launch_options(["--max-parallel", "0"])
    assert rest == ["-m", "a=1,2"]
    assert sweep.with_default_dirs(["hydra.sweep.dir=x"]) == ["hydra.sweep.dir=x",
                                                               f"hydra.run.dir={sweep.DEFAULT_DIR}"]


def test_a_job_folder_with_equals_signs_reaches_the_run_as_its_output_dir(tmp_path, fake_engine, monkeypatch):
    """study.py names a --grid job ``<method>_partition.alpha=0.6_s<seed>_<hash>``: the run must get
    that folder as output_dir, not a Hydra grammar error (every such job failed before)."""
    seen = []

    def fake_run(app_dir, overrides, num_supernodes, **kwargs):
        seen.append(overrides)
        return RunResult(run_id=1, status="finished:completed", completed=True, log="", seconds=1.0)

    engine = fake_engine(fake_run)
    job_dir = tmp_path / "fedavg_partition.alpha=0.6_s0_0123abcd"
    job_dir.mkdir()
    monkeypatch.setattr(sweep, "to_config", lambda cfg: compose(" ".join(TINY)))  # not what this test is about
    row = sweep.run_combination(sweep.OmegaConf.create({}), [*TINY, "partition.alpha=0.6"], job_dir,
                                sweep.LaunchOptions(), engine)
    assert row["status"] == "completed", row
    assert compose(seen[0]).output_dir == str(job_dir)
