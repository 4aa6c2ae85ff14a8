"""End to end: the real app through `flwr run` on a real local SuperLink in simulation mode.

Every method runs once on digits with its YAML defaults (the seed's). A module fixture runs the
selected ones on the session's engine as a sweep runs its jobs (conftest.py ``on_flower_engine``).
"""

import json
import math
from pathlib import Path

import pytest

from fedact_app.algorithms import ALGORITHMS

# The module fixture runs every selected job inside the first test's setup, which pytest-timeout
# counts against that test: allow for all of them on a slow 2-core machine (about 12 runs of
# 10-60 s each), not for one.
pytestmark = pytest.mark.timeout(2400)
APP_DIR = Path(__file__).resolve().parents[1]
SHORT = "num_rounds=2 num_clients=2 fraction_train=1.0 min_train_nodes=2 local_steps=10"
LEARNS = ("algorithm=fedact num_rounds=3 num_clients=3 fraction_train=1.0 min_train_nodes=3 "
          "local_steps=15 algorithm.lr=3e-3")
FAST_OPTIONS = "wire_dtype=bfloat16 reply_dtype=bfloat16 precision=bf16 channels_last=true"
SGD_FAMILY = ("fedavg", "fedprox", "scaffold", "fedadam")  # no adaptive direction: no trust score
CLIENT_DIAGNOSTICS = ("positive_ratio", "top_p_mass")
JOBS = {**{name: (f"algorithm={name} {SHORT}", 2) for name in ALGORITHMS}, "fedact-learns": (LEARNS, 3),
        "fedact-fast-options": (f"algorithm=fedact {SHORT} {FAST_OPTIONS}", 2)}


def run_dir(output: Path) -> Path:
    (folder,) = list(output.iterdir())
    return folder


def job_name(item) -> str:
    """The JOBS key a test of this module checks: its ``algorithm`` parameter, or its ``JOB`` mark."""
    callspec = getattr(item, "callspec", None)
    if callspec and "algorithm" in callspec.params:
        return callspec.params["algorithm"]
    return item.get_closest_marker("job").args[0]


def selected_jobs(session) -> set[str]:
    """The JOBS keys of the tests of this module that pytest selected (a test may read two)."""
    return {name for item in session.items
            if item.module.__name__ == __name__ and "job" in getattr(item, "fixturenames", ())
            for name in (job_name(item), *(m.args[0] for m in item.iter_markers("also_job")))}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory, flower_engine, on_flower_engine) -> dict:
    """name -> (output folder, RunResult) for every selected job."""
    base = tmp_path_factory.mktemp("runs")

    def run(name):
        output = base / name
        overrides, supernodes = JOBS[name]
        try:
            result = flower_engine.run(APP_DIR, overrides=f"{overrides} output_dir={output}",
                                       num_supernodes=supernodes, timeout=420)
        except Exception as err:  # reported by the tests of this job only
            result = err
        return name, output, result

    jobs = sorted(selected_jobs(request.session))
    return {name: (output, result) for name, output, result in on_flower_engine(run, jobs)}


@pytest.fixture
def job(request, runs):
    output, result = runs[job_name(request.node)]
    if isinstance(result, Exception):
        raise result
    assert result.completed, f"{result.status} {result.details}\n{result.tail(60)}"
    folder = run_dir(output)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return folder, rows


@pytest.mark.e2e
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_method_completes_a_digits_run(algorithm, job, record_property):
    """2 clients, 2 rounds, 10 local steps, the method's defaults; final accuracy recorded."""
    folder, rows = job
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["clients"] == 2 and r["rejected"] == 0 for r in rows[1:])
    assert all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 for r in rows[1:])
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["test_loss"]) for r in rows[1:])
    # each client's local work, by its own clock, lies within the server's round
    assert all(0 < r["client_train_seconds_max"] <= min(r["client_train_seconds"], r["seconds"]) for r in rows[1:])
    # the last reply's path (one machine, one clock): each part >= 0, its training within its work, the
    # parts within the round, and every client starting after the push and within the round
    path = ("push_seconds", "last_reply_start_seconds", "last_reply_work_seconds", "last_reply_return_seconds")
    assert all(min(r[key] for key in path) >= 0 and r["last_reply_train_seconds"] <= r["last_reply_work_seconds"]
               and sum(r[key] for key in path) < r["seconds"]
               and 0 <= r["start_seconds_min"] and r["start_seconds_max"] < r["seconds"] for r in rows[1:])
    # the seed's diagnostics: defined ones recorded every round (K = 10 = diagnostics.trust_every)
    assert all(-1 <= r["direction_consistency"] <= 1 for r in rows[1:])
    has_score = algorithm not in SGD_FAMILY
    assert all((key in r) == has_score for r in rows[1:] for key in CLIENT_DIAGNOSTICS)
    fedact_family = ("fedact", "fedact_local", "fedadamw")
    assert all(("amplified_fraction" in r) == (algorithm in fedact_family) for r in rows[1:])
    assert all(("delta_g_norm" in r) == (algorithm in (*fedact_family, "fedlada")) for r in rows[1:])
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["final_test_accuracy"] == rows[-1]["test_accuracy"]
    startup = summary["startup"]  # the start-up's phases in order, before the run ended
    phases = [startup[phase] for phase in ("process", "serverapp", "data", "model", "task", "first_round")]
    assert phases == sorted(phases) and phases[-1] < summary["finished_at"]
    assert (folder / "config.yaml").read_text().count(f"name: {algorithm}") == 1
    assert (folder / "model.safetensors").stat().st_size > 0
    record_property("final_test_accuracy", rows[-1]["test_accuracy"])
    print(f"{algorithm}: test accuracy {rows[0]['test_accuracy']:.3f} -> {rows[-1]['test_accuracy']:.3f}")


@pytest.mark.e2e
@pytest.mark.job("fedact")
def test_a_run_leaves_no_lock_files_behind(job, runs):
    """One lock file per simulated node and run (fedact_app.node_slot), removed by the ServerApp at
    the run's end; a sweep of hundreds of runs used to leave thousands in the temporary directory."""
    from fedact_app.node_slot import locks_root, run_locks

    run_id = runs["fedact"][1].run_id
    assert not run_locks(run_id).exists()
    assert not list(locks_root().parent.glob(f"fedact-node-{run_id}-*.lock"))  # where they were


@pytest.mark.e2e
@pytest.mark.job("fedact-learns")
def test_fedact_run_learns(job):
    _, rows = job
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(r["clients"] == 3 and r["rejected"] == 0 for r in rows[1:])
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2  # 10 classes: chance 0.1


@pytest.mark.e2e
@pytest.mark.job("fedact-fast-options")
@pytest.mark.also_job("fedact")
def test_bf16_wire_autocast_and_channels_last_run(job, runs):
    """The speed options through real Flower: v_bar and Delta_G travel in 2 bytes per value (round 2
    is the first with them), so do the replies' Delta and v (from round 1), bf16 autocast and
    channels_last train, nothing is rejected."""
    from fedact_app.config import compose
    from fedact_app.tasks.vision.models import build_model

    _, rows = job
    fp32_rows = [json.loads(line) for line in (run_dir(runs["fedact"][0]) / "metrics.jsonl").read_text().splitlines()]
    assert all(r["clients"] == 2 and r["rejected"] == 0 for r in rows[1:])
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["test_loss"]) for r in rows[1:])
    cfg = compose("")
    model = build_model(cfg.model, cfg.dataset)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    saved = fp32_rows[2]["bytes_sent"] - rows[2]["bytes_sent"]
    expected = 2 * 2 * 2 * trainable  # 2 nodes x (v_bar, Delta_G) x 2 bytes saved per value
    assert abs(saved - expected) < 1024, (saved, expected)
    assert fp32_rows[1]["bytes_sent"] == rows[1]["bytes_sent"]  # round 1: the model only
    floats = sum(t.numel() for t in model.state_dict().values() if t.is_floating_point())
    for server_round in (1, 2):  # 2 nodes x (Delta over the model's floating entries, v over the trainable) x 2 bytes
        saved = fp32_rows[server_round]["bytes_received"] - rows[server_round]["bytes_received"]
        assert abs(saved - 2 * 2 * (floats + trainable)) < 1024, (server_round, saved, floats, trainable)


@pytest.mark.e2e
def test_bad_override_fails_the_run_with_the_reason(tmp_path, flower_engine):
    result = flower_engine.run(APP_DIR, overrides=f"algorithm.tau=2 output_dir={tmp_path}",
                               num_supernodes=2, timeout=300)
    assert not result.completed
    assert "algorithm.tau" in result.log + result.details


@pytest.mark.e2e
def test_rounds_without_usable_replies_stop_the_run_with_the_reason(tmp_path, flower_engine):
    # 1 client configured, 2 SuperNodes: every ClientApp refuses (num-partitions != num_clients),
    # the model stays unchanged and the run stops after max_empty_rounds with a clear message. (Not
    # more clients than SuperNodes: the first round would wait for the missing ones, 30 s.)
    result = flower_engine.run(APP_DIR, overrides=f"num_clients=1 min_train_nodes=1 fraction_train=1.0 "
                                                  f"num_rounds=5 max_empty_rounds=2 local_steps=2 "
                                                  f"output_dir={tmp_path}",
                               num_supernodes=2, timeout=300)
    assert not result.completed
    text = result.log + result.details
    assert "No usable client reply in 2 consecutive rounds" in text
    assert "num_clients=1" in text  # the ClientApp's reason reaches the run's log
    assert "local_steps=2 < diagnostics.trust_every=10: clients sample no trust-score" in text
    rows = [json.loads(line) for line in (run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["clients"] == 0 and r["rejected"] == 2 for r in rows[1:])
