"""End to end: a run past its timeout, or a dead process, on a shared engine does not hold the next run;
a sweep's next run starts while the last one shuts down.

A sweep's jobs share one SuperLink and one Ray cluster (fedact_app.cli.engine.LocalEngine); a job
that hangs must come back as timed out, and the job after it must run as if alone, as must a job
after the Ray cluster died. That a job's
metrics equal the same run launched alone is tests/test_reproducible_e2e.py's check.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fedact_app.cli import flwr
from fedact_app.cli.engine import LocalEngine

pytestmark = pytest.mark.timeout(600)
APP_DIR = Path(__file__).resolve().parents[1]
TINY = "num_clients=2 fraction_train=1.0 min_train_nodes=2 local_steps=2 device=cpu"
HANGS = f"{TINY} num_rounds=2 debug.fail_partitions=[0,1] debug.fail_rounds=[1] debug.hang_seconds=300"


@pytest.mark.e2e
def test_a_run_past_its_timeout_or_a_dead_process_restarts_the_engine_and_the_next_run_completes(tmp_path):
    def completes(engine, name):
        result = engine.run(APP_DIR, overrides=f"{TINY} num_rounds=1 output_dir={tmp_path / name}",
                            num_supernodes=2, timeout=300)
        assert result.completed, f"{result.status} {result.details}\n{result.tail(60)}"
        (folder,) = list((tmp_path / name).iterdir())
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["round"] == 1 and rows[-1]["clients"] == 2  # both clients served
        return result

    with LocalEngine() as engine:
        hung = engine.run(APP_DIR, overrides=f"{HANGS} output_dir={tmp_path / 'hung'}", num_supernodes=2,
                          timeout=25)
        assert hung.timed_out and not hung.completed, hung
        after = completes(engine, "after")
        assert after.superlink_pid != hung.superlink_pid  # restarted: the hung run's actors are gone
        address = engine.ray.address
        engine.ray.proc.kill()  # the Ray cluster dies between two jobs
        engine.ray.proc.wait()
        revived = completes(engine, "revived")
        assert engine.ray.address != address and revived.superlink_pid != after.superlink_pid
    assert engine.link is None and engine.ray is None


@pytest.mark.e2e
def test_a_sweeps_next_run_starts_while_the_last_one_shuts_down_and_computes_the_same(tmp_path, monkeypatch):
    """LocalEngine.for_sweep(1): two runs in flight on one Ray cluster, the second submitted once the
    first's ServerApp has ended (its file in the engine's done folder) but before Flower has
    finished the first run; both complete, with the same metrics (same config and seed)."""
    submitted, returned = {}, {}
    real_start = flwr.ControlClient.start_run

    def start_run(self, app, run_config, **kwargs):
        run_id = real_start(self, app, run_config, **kwargs)
        submitted[run_config["overrides"].rsplit("/", 1)[-1]] = time.monotonic()
        return run_id

    monkeypatch.setattr(flwr.ControlClient, "start_run", start_run)

    def job(name):
        result = engine.run(APP_DIR, overrides=f"{TINY} num_rounds=2 output_dir={tmp_path / name}",
                            num_supernodes=2, timeout=300)
        returned[name] = time.monotonic()
        assert result.completed, f"{result.status} {result.details}\n{result.tail(60)}"
        (folder,) = list((tmp_path / name).iterdir())
        return [{k: v for k, v in json.loads(line).items() if "seconds" not in k}
                for line in (folder / "metrics.jsonl").read_text().splitlines()]

    engine = LocalEngine.for_sweep(1)
    assert engine.max_parallel == 2 and engine.shared_ray
    with engine, ThreadPoolExecutor(engine.max_parallel) as pool:
        first = pool.submit(job, "first")
        time.sleep(0.5)  # the first claims the engine first
        second = pool.submit(job, "second")
        rows_first, rows_second = first.result(), second.result()
        done = sorted(path.name for path in (engine.home / "serverapps-done").iterdir())
    assert submitted["first"] < submitted["second"] < returned["first"], (submitted, returned)
    assert rows_first == rows_second and [row["round"] for row in rows_first] == [0, 1, 2]
    assert len(done) == 2
