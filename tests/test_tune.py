"""scripts/tune.py: Optuna ask/tell over a stub objective (no Flower here), the search space, the
scoring of a run on val_accuracy only, and the tuned file the study reads."""

import json
import math
import sys
from pathlib import Path

import optuna
import pytest

from fedact_app.config import compose

APP_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(APP_DIR / "scripts"))

import study  # noqa: E402
import tune  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


def stub_objective(calls: list):
    """Scores a trial by how close its lr is to 1e-3 (log scale); records every call."""

    def objective(method, overrides, number):
        calls.append((method, overrides, number))
        lr = float(next(o for o in overrides if o.startswith("algorithm.lr=")).split("=")[1])
        return -abs(math.log10(lr) + 3)

    return objective


def test_two_trials_per_method_through_ask_and_tell_and_a_tuned_file_the_study_takes(tmp_path):
    calls = []
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    studies = {m: tune.tune_method(m, stub_objective(calls), trials=2, storage=storage, study_name=f"t-{m}")
               for m in ("fedact", "fedavg")}
    assert [(m, n) for m, _, n in calls] == [("fedact", 0), ("fedact", 1), ("fedavg", 0), ("fedavg", 1)]
    fedact_keys = {o.split("=")[0] for o in calls[0][1]}
    assert fedact_keys == {"algorithm.lr", "algorithm.tau", "algorithm.gamma", "algorithm.scale_matched"}
    assert {o.split("=")[0] for o in calls[2][1]} == {"algorithm.lr"}  # FedAvg: the lr only
    for method, overrides, _ in calls:  # each family in its own range
        low, high = tune.ADAM_LR_RANGE if method == "fedact" else tune.SGD_LR_RANGE
        assert low <= float(overrides[0].split("=")[1]) <= high
    best = max(calls[:2], key=lambda c: stub_objective([])(*c))
    assert tune.best_overrides(studies["fedact"]) == best[1]

    tuned_file = tmp_path / "tuned.yaml"
    tune.write_tuned(tuned_file, studies, [1000, 1001], "stub")
    jobs = study.study_jobs(["fedact", "fedavg"], [0], [], ["num_rounds=2"], study.read_tuned(tuned_file))
    assert jobs[0].overrides == ("num_rounds=2", "algorithm=fedact", *best[1], "seed=0")
    with pytest.raises(ValueError, match="tuning seeds"):
        study.study_jobs(["fedact"], [1001], [], [], study.read_tuned(tuned_file))
    for job in jobs:  # the tuned overrides compose into a valid config
        assert compose(list(job.overrides)).algorithm.name in ("fedact", "fedavg")

    # the persisted study is continued: one more trial makes three, not 2 + 3
    tune.tune_method("fedavg", stub_objective(calls), trials=3, storage=storage, study_name="t-fedavg")
    assert len(calls) == 5 and calls[-1][2] == 2


@pytest.mark.parametrize("relative", [True, False], ids=["relative", "absolute"])
def test_an_sqlite_storage_in_a_folder_not_yet_made_is_made(tmp_path, monkeypatch, relative):
    """``--out tuning/x --storage sqlite:///tuning/x/optuna.db`` on a fresh checkout: SQLite does
    not make the file's folder, and Optuna could not open the database."""
    monkeypatch.chdir(tmp_path)
    path = Path("tuning/x/optuna.db") if relative else tmp_path / "tuning" / "x" / "optuna.db"
    calls = []
    tune.tune_method("fedavg", stub_objective(calls), trials=1, storage=f"sqlite:///{path}", study_name="t")
    assert (tmp_path / "tuning" / "x" / "optuna.db").is_file() and len(calls) == 1


def test_only_an_sqlite_files_folder_is_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tune.make_sqlite_folder(f"sqlite+pysqlite:///{tmp_path}/driver/optuna.db")
    tune.make_sqlite_folder("sqlite:///query/optuna.db?timeout=5")
    for url in ("sqlite://", "sqlite:///:memory:", "postgresql://user@host/optuna", None):
        tune.make_sqlite_folder(url)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["driver", "query"]
    assert [p.name for p in (tmp_path / "query").iterdir()] == []  # the folder, not the file


def test_a_trial_whose_run_did_not_finish_is_told_fail_and_tuning_goes_on():
    outcomes = iter([tune.TrialFailed("launch error"), 0.5])

    def objective(method, overrides, number):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    result = tune.tune_method("fedadamw", objective, trials=2)
    states = [t.state for t in result.trials]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE]
    assert result.trials[0].user_attrs["error"] == "launch error" and result.best_value == 0.5
    assert not tune.tunes_trust("fedadamw") and tune.tunes_trust("fedact_local")


def write_job(job_dir: Path, status: str, val: list | None) -> dict:
    run_dir = job_dir / "20260101-000000_fedact_digits_cnn_small_dir0.6_s1000"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("dataset: {name: digits}\nmodel: {name: cnn_small}\n"
                                         "partition: {name: dirichlet, alpha: 0.6}\nalgorithm: {name: fedact}\nseed: 1000\n")
    rows = [{"round": r, "test_accuracy": 0.99} if val is None else {"round": r, "val_accuracy": v}
            for r, v in enumerate(val or [0.2, 0.3])]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"job": job_dir.name, "status": status, "run_dir": str(run_dir), "error": ""}


def test_a_run_is_scored_on_val_accuracy_only(tmp_path):
    row = write_job(tmp_path / "a", "completed", [0.2, 0.6, 0.5])
    assert tune.run_score(tmp_path / "a", row, "final") == 0.5
    assert tune.run_score(tmp_path / "a", row, "best") == 0.6
    test_only = write_job(tmp_path / "b", "completed", None)  # a run that evaluated the test split
    with pytest.raises(tune.TrialFailed, match="no val_accuracy"):
        tune.run_score(tmp_path / "b", test_only, "final")
    assert tune.run_score(tmp_path / "c", {"job": "c", "status": "failed"}, "final") == 0.0  # diverged
    with pytest.raises(tune.TrialFailed, match="timed out"):
        tune.run_score(tmp_path / "d", {"job": "d", "status": "timed out"}, "final")
    with pytest.raises(ValueError, match="validation split"):
        tune.flower_objective(tmp_path, [], [1000], 0.0, study.sweep.LaunchOptions(), engine=None)


def test_an_lr_grid_runs_each_log_spaced_value_once_and_leaves_the_trust_settings_alone():
    assert tune.lr_grid((2.5e-4, 4e-3), 5) == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]
    with pytest.raises(ValueError, match="at least 2 points"):
        tune.lr_grid((1e-3, 1e-3), 3)
    calls = []
    result = tune.tune_method("fedact", stub_objective(calls), trials=99, lr_range=(2.5e-4, 4e-3), grid_points=5)
    assert len(calls) == 5 and len(result.trials) == 5  # the grid's size; trials is not used
    assert sorted(float(o[0].split("=")[1]) for _, o, _ in calls) == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]
    assert all(len(overrides) == 1 for _, overrides, _ in calls)  # no tau/gamma/scale_matched
    assert tune.best_overrides(result) == ["algorithm.lr=0.001"]
    assert tune.main(["--out", "unused", "--methods", "fedavg", "--lr-grid", "1"]) == 2
    with pytest.raises(SystemExit):  # a grid runs one trial per value
        tune.main(["--out", "unused", "--methods", "fedavg", "--lr-grid", "3", "--trials", "5"])


def test_a_second_grid_call_runs_the_values_that_failed_or_were_interrupted_and_no_others(tmp_path):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    calls = []

    def first(method, overrides, number):
        lr = float(overrides[0].split("=")[1])
        calls.append(lr)
        if lr == 1e-3:
            raise tune.TrialFailed("timed out")
        if lr == 2e-3:
            raise KeyboardInterrupt  # the user stops the call during this trial
        return -1.0

    with pytest.raises(KeyboardInterrupt):
        tune.tune_method("fedadamw", first, 0, storage, "g", lr_range=(5e-4, 2e-3), grid_points=3)
    assert calls == [5e-4, 1e-3, 2e-3]
    calls.clear()
    result = tune.tune_method("fedadamw", stub_objective([]), 0, storage, "g", lr_range=(5e-4, 2e-3), grid_points=3)
    again = [t.params["lr"] for t in result.trials if t.number >= 3]
    assert again == [1e-3, 2e-3]  # not 5e-4, and no value off the grid
    assert tune.best_overrides(result) == ["algorithm.lr=0.001"]
    assert tune.lr_grid((1.0000001e-4, 1.0000001e-2), 3)[::2] == [1.0000001e-4, 1.0000001e-2]  # the ends exact


def test_a_second_call_adds_its_methods_to_the_tuned_file_unless_the_question_changed(tmp_path, capsys):
    path = tmp_path / "tuned.yaml"
    fedact = tune.tune_method("fedact", stub_objective([]), trials=0, lr_range=(5e-4, 2e-3), grid_points=3)
    fedavg = tune.tune_method("fedavg", stub_objective([]), trials=0, lr_range=(1e-2, 1.0), grid_points=3)
    tune.write_tuned(path, {"fedact": fedact}, [1000, 1001], "final val", {"fedact": "grid A"})
    tune.write_tuned(path, {"fedavg": fedavg}, [1000, 1001], "final val", {"fedavg": "grid B"})
    tuned = study.read_tuned(path)
    assert tuned["methods"] == {"fedact": ["algorithm.lr=0.001"], "fedavg": ["algorithm.lr=0.01"]}
    assert tuned["trials"] == {"fedact": 3, "fedavg": 3}
    assert tuned["search"] == {"fedact": "grid A", "fedavg": "grid B"}
    refit = tune.tune_method("fedact", lambda m, o, n: 1.0 if o[0].endswith("0.0005") else 0.0, trials=0,
                             lr_range=(5e-4, 2e-3), grid_points=3)
    tune.write_tuned(path, {"fedact": refit}, [1000, 1001], "final val")  # a method tuned again: replaced
    assert study.read_tuned(path)["methods"]["fedact"] == ["algorithm.lr=0.0005"]
    assert capsys.readouterr().err == ""
    tune.write_tuned(path, {"fedavg": fedavg}, [7], "final val")  # other seeds: another question
    assert list(study.read_tuned(path)["methods"]) == ["fedavg"]
    assert "entries for fedact are dropped" in capsys.readouterr().err
    tune.write_tuned(path, {"fedact": fedact}, [7], "best val")  # another objective: another question
    assert list(study.read_tuned(path)["methods"]) == ["fedact"]
    assert "entries for fedavg are dropped" in capsys.readouterr().err
    assert "TPE, 20 trials" in tune.search_description("fedact", None, None, 20)
    assert "algorithm.tau" in tune.search_description("fedact", None, None, 20)
    assert tune.search_description("fedavg", (1e-2, 1.0), 3, 20) == "algorithm.lr on the grid [0.01, 0.1, 1.0]"
