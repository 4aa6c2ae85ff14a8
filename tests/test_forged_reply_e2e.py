"""End to end: a client that forges its reply cannot poison the run. A Flower app made in the test
from this project's ServerApp and a ClientApp that trains honestly but reports a forged number
(partition 0 in every round) runs through real `flwr run`; the server rejects partition 0's replies,
trains on the others and completes with a finite model that learned.

The forgeries are those that once got through: lr-sum = 1e-9 (Delta_G = -mean(Delta / lr-sum) gave ||Delta_G|| ~ 5e8
and a train loss of 1e17) and num-examples = 1e15 with weighting=examples (one client took the
whole aggregate)."""

import json
import math
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file


pytestmark = pytest.mark.timeout(900)
APP_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(APP_DIR / "scripts"))
from attack import app_with_client  # noqa: E402

RUN = ("num_clients=3 fraction_train=1.0 min_train_nodes=2 num_rounds=3 local_steps=10 device=cpu "
       "algorithm.lr=3e-3")

FORGING_CLIENT = '''"""The project's ClientApp, except that partition 0 reports {key} = {value}."""
from flwr.app import Message, MetricRecord
from flwr.clientapp import ClientApp

from fedact_app import client_app

app = ClientApp()
app.query()(client_app.identify)


@app.train()
def train(msg, context):
    reply = client_app.train(msg, context)
    if not reply.has_error() and int(context.node_config["partition-id"]) == 0:
        reply.content["metrics"] = MetricRecord({{**dict(reply.content["metrics"]), "{key}": {value}}})
    return reply
'''


def forging_app(folder: Path, key: str, value: float) -> Path:
    """An app folder whose ClientApp is ``forging_client:app`` (``FORGING_CLIENT``)."""
    return app_with_client(folder, "forging_client", FORGING_CLIENT.format(key=key, value=value))


@pytest.mark.e2e
@pytest.mark.parametrize("key, value, extra", [("lr-sum", 1e-9, ""),
                                               ("num-examples", 1e15, "algorithm.weighting=examples")])
def test_a_forged_number_is_rejected_and_the_run_learns_from_the_others(tmp_path, key, value, extra,
                                                                       flower_engine):
    app = forging_app(tmp_path / "app", key, value)
    output = tmp_path / "out"
    result = flower_engine.run(app, overrides=f"{RUN} {extra} output_dir={output}", num_supernodes=3, timeout=400)
    assert result.completed, f"{result.status} {result.details}\n{result.tail(60)}"
    (folder,) = list(output.iterdir())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert all((r["clients"], r["rejected"]) == (2, 1) for r in rows[1:]), rows
    assert f"metric '{key}'" in result.log
    assert all(math.isfinite(r["train_loss"]) and r["train_loss"] < 3 for r in rows[1:])
    assert rows[-1]["test_accuracy"] > rows[0]["test_accuracy"] + 0.1
    model = load_file(str(folder / "model.safetensors"))
    assert all(bool(t.isfinite().all()) for t in model.values() if t.is_floating_point())
