"""End to end: the real app through `flwr run` on a real local SuperLink in simulation mode."""

import json
from pathlib import Path

import pytest

from fedact_app.launch import run_simulation

APP_DIR = Path(__file__).resolve().parents[1]


def run_dir(output: Path) -> Path:
    (folder,) = list(output.iterdir())
    return folder


@pytest.mark.e2e
@pytest.mark.parametrize("algorithm", ["fedact", "fedadamw"])
def test_digits_run_completes_and_learns(tmp_path, algorithm):
    overrides = (f"algorithm={algorithm} num_rounds=3 num_clients=3 fraction_train=1.0 "
                 f"min_train_nodes=3 local_steps=15 algorithm.lr=3e-3 output_dir={tmp_path}")
    result = run_simulation(APP_DIR, overrides=overrides, num_supernodes=3, timeout=420)
    assert result.completed, f"{result.status} {result.details}\n{result.tail(60)}"

    folder = run_dir(tmp_path)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(r["clients"] == 3 and r["rejected"] == 0 for r in rows[1:])
    assert all(r["bytes_sent"] > 0 and r["bytes_received"] > 0 for r in rows[1:])
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.2  # 10 classes: chance 0.1
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["final_test_accuracy"] == rows[-1]["test_accuracy"]
    assert (folder / "config.yaml").read_text().count(f"name: {algorithm}") == 1
    assert (folder / "model.safetensors").stat().st_size > 0


@pytest.mark.e2e
def test_bad_override_fails_the_run_with_the_reason(tmp_path):
    result = run_simulation(APP_DIR, overrides=f"algorithm.tau=2 output_dir={tmp_path}",
                            num_supernodes=2, timeout=300)
    assert not result.completed
    assert "algorithm.tau" in result.log + result.details
