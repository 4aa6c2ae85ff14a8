"""End to end: a client that raises is counted and the run goes on; a run resumed in a new Flower
run from the checkpoint its predecessor wrote after round 2 ends bit-exactly where 4 straight
rounds end (a crash after round 2 leaves exactly that checkpoint behind).

Real `flwr run` simulations on digits/cnn_small, CPU, 2 clients that train every round, on the
session's engine as a sweep runs its jobs (conftest.py ``on_flower_engine``).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


# The module fixture's runs all happen in the first test's setup (see tests/test_e2e.py).
pytestmark = pytest.mark.timeout(1800)
APP_DIR = Path(__file__).resolve().parents[1]
BASE = ("num_rounds=4 num_clients=2 fraction_train=1.0 min_train_nodes=2 local_steps=3 batch_size=16 "
        "device=cpu checkpoint_every=1 keep_checkpoints=3")
METHODS = ("fedact", "scaffold")


def run(engine, output: Path, overrides: str):
    result = engine.run(APP_DIR, overrides=f"{overrides} output_dir={output}", num_supernodes=2, timeout=300)
    assert result.completed, f"{result.status} {result.details}\n{result.tail(60)}"
    (folder,) = list(output.iterdir())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return folder, rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory, flower_engine, on_flower_engine) -> dict:
    """name -> (run folder, metrics rows): per method 4 straight rounds and a run resumed from the
    straight run's round-2 checkpoint; plus a FedACT run whose partition 1 raises in round 1."""
    base = tmp_path_factory.mktemp("resume")
    first = {m: f"algorithm={m} {BASE}" for m in METHODS}
    # partition 1 raises in round 1 and min_train_nodes=1 lets the round aggregate partition 0 alone
    first["fault"] = ("algorithm=fedact num_clients=2 fraction_train=1.0 min_train_nodes=1 local_steps=3 "
                      "num_rounds=2 device=cpu debug.fail_partitions=[1] debug.fail_rounds=[1]")

    def run_all(specs):  # name -> overrides
        return dict(on_flower_engine(lambda name: (name, run(flower_engine, base / name, specs[name])), specs))

    done = run_all(first)
    resumed = {f"{m}-resumed": f"algorithm={m} {BASE} resume={done[m][0]}/checkpoints/round-00002.safetensors"
               for m in METHODS}
    done.update(run_all(resumed))
    return done


@pytest.mark.e2e
@pytest.mark.parametrize("method", METHODS)
def test_resumed_run_equals_straight_run_exactly(method, runs):
    straight, straight_rows = runs[method]
    resumed, resumed_rows = runs[f"{method}-resumed"]
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a), "resumed model differs from the straight run"
    round2 = load_file(str(straight / "checkpoints" / "round-00002.safetensors"))
    assert not all(torch.equal(a[name], round2[f"model/{name}"]) for name in a)  # rounds 3-4 trained
    if method == "scaffold":  # the clients' c_i went through the checkpoint
        assert sum(key.startswith("client/0/c_i/") for key in round2) == len(
            [k for k in round2 if k.startswith("rule/c/")])
    assert [r["round"] for r in resumed_rows] == [0, 1, 2, 3, 4]  # earlier rows carried over
    for key in ("test_accuracy", "test_loss", "train_loss", "clients", "lr"):
        assert [r.get(key) for r in resumed_rows] == [r.get(key) for r in straight_rows], key
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == [
        "round-00002.safetensors", "round-00003.safetensors", "round-00004.safetensors"]  # 1 rotated out


@pytest.mark.e2e
def test_a_client_that_raises_is_counted_and_the_run_completes(runs):
    _, rows = runs["fault"]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert (rows[1]["clients"], rows[1]["rejected"], rows[1]["failed"], rows[1]["missing"]) == (1, 1, 1, 0)
    assert (rows[2]["clients"], rows[2]["rejected"], rows[2]["failed"]) == (2, 0, 0)
