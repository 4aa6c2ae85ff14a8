"""The run folder: metrics.jsonl rows, the live progress line, TensorBoard scalars, the summary."""

import json
import logging

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedact_app.config import compose
from fedact_app.results import RunRecorder, _format_row

ROWS = [
    {"round": 0, "test_loss": 2.3, "test_accuracy": 0.1},
    {"round": 1, "train_loss": 2.0, "lr": 3e-4, "test_loss": 1.5, "test_accuracy": 0.4, "seconds": 2.0,
     "direction_consistency": 0.31, "positive_ratio": 0.52, "clients": 2},
    {"round": 2, "train_loss": 1.2, "lr": 1e-4, "test_loss": 1.0, "test_accuracy": 0.6, "seconds": 3.0,
     "direction_consistency": 0.45, "positive_ratio": 0.55, "clients": 2},
]


def test_progress_line_shows_round_loss_accuracy_dc_time_and_eta():
    line = _format_row(ROWS[1], num_rounds=4, elapsed=10.0)
    assert line.startswith("round 1/4 | train loss 2.0000 | test acc 0.4000 loss 1.5000 | DC 0.310")
    assert "2.0 s" in line and "elapsed 10 s, eta 30 s" in line  # 10 s per round, 3 rounds to go


def test_recorder_writes_rows_tensorboard_scalars_and_summary(tmp_path, caplog):
    cfg = compose(["num_rounds=2"])
    recorder = RunRecorder(tmp_path, cfg, earlier_rows=ROWS[:1])  # as when resuming after round 0
    with caplog.at_level(logging.INFO, logger="flwr"):
        for row in ROWS[1:]:
            recorder.record_round(row)
    summary = recorder.finish({"w": torch.zeros(2)})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == ROWS
    assert summary["final_test_accuracy"] == 0.6 and summary["best_test_accuracy"] == 0.6
    assert summary["initial_test_accuracy"] == 0.1
    assert "round 2/2" in caplog.text and "DC 0.450" in caplog.text

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"test_accuracy", "direction_consistency", "positive_ratio", "train_loss"} <= set(scalars)
    assert [(e.step, e.value) for e in events.Scalars("test_accuracy")] == \
        [(0, pytest.approx(0.1)), (1, pytest.approx(0.4)), (2, pytest.approx(0.6))]
    assert [e.step for e in events.Scalars("direction_consistency")] == [1, 2]


def test_tensorboard_can_be_switched_off(tmp_path):
    recorder = RunRecorder(tmp_path, compose(["tensorboard=false"]))
    recorder.record_round(ROWS[0])
    assert not (tmp_path / "tensorboard").exists()


def test_summary_counts_the_replies_lost_and_warns(tmp_path, caplog):
    """summary.json sums the rounds' accepted, rejected (of them failed) and missing replies and
    the rounds without an update; the end of the log says when some were lost."""
    recorder = RunRecorder(tmp_path, compose(["num_rounds=3", "tensorboard=false"]))
    counts = [(2, 1, 1, 0), (0, 2, 0, 1), (3, 0, 0, 0)]  # clients, rejected, failed, missing per round
    rows = [{"round": 0, "test_accuracy": 0.1, "test_loss": 2.0}] + [
        {"round": r, "clients": c, "rejected": rej, "failed": f, "missing": m, "test_accuracy": 0.3, "test_loss": 1.5}
        for r, (c, rej, f, m) in enumerate(counts, start=1)]
    with caplog.at_level(logging.INFO, logger="flwr"):
        for row in rows:
            recorder.record_round(row)
        summary = recorder.finish({"w": torch.zeros(2)})
    assert {k: summary[k] for k in ("replies_accepted", "replies_rejected", "replies_failed", "replies_missing",
                                    "rounds_without_update")} == {
        "replies_accepted": 5, "replies_rejected": 3, "replies_failed": 1, "replies_missing": 1,
        "rounds_without_update": 1}
    assert json.loads((tmp_path / "summary.json").read_text())["replies_rejected"] == 3
    assert "Not every sampled client contributed: replies_rejected 3, replies_failed 1, replies_missing 1, " \
           "rounds_without_update 1" in caplog.text


def test_summary_of_a_clean_run_warns_of_nothing(tmp_path, caplog):
    recorder = RunRecorder(tmp_path, compose(["num_rounds=2", "tensorboard=false"]))
    with caplog.at_level(logging.INFO, logger="flwr"):
        for row in ROWS:
            recorder.record_round(row)
        summary = recorder.finish({"w": torch.zeros(2)})
    assert summary["replies_accepted"] == 4 and summary["replies_rejected"] == 0
    assert "Not every sampled client" not in caplog.text


def test_a_final_model_holding_non_finite_values_fails_and_writes_no_model_or_summary(tmp_path):
    """A diverged or poisoned run must not end 'completed' with NaN in model.safetensors: finish
    raises (the ServerApp raising fails the Flower run) before writing either file."""
    recorder = RunRecorder(tmp_path, compose(["num_rounds=2", "tensorboard=false"]))
    for row in ROWS:
        recorder.record_round(row)
    final = {"w": torch.tensor([[0.0, float("nan")], [1.0, float("inf")]]), "b": torch.ones(2),
             "bn.num_batches_tracked": torch.tensor(3)}
    with pytest.raises(RuntimeError, match=r"final global model holds non-finite values \(NaN or inf\) "
                                           r"in \['w'\]"):
        recorder.finish(final)
    assert not (tmp_path / "model.safetensors").exists() and not (tmp_path / "summary.json").exists()


def test_a_run_evaluated_on_the_validation_holdout_summarizes_val_accuracy_not_test(tmp_path, caplog):
    """dataset.holdout_fraction > 0: the rows hold val_*; the summary's test columns stay NaN."""
    recorder = RunRecorder(tmp_path, compose(["num_rounds=2", "tensorboard=false", "dataset.holdout_fraction=0.1"]))
    rows = [{key.replace("test_", "val_"): value for key, value in row.items()} for row in ROWS]
    with caplog.at_level(logging.INFO, logger="flwr"):
        for row in rows:
            recorder.record_round(row)
        summary = recorder.finish({"w": torch.zeros(2)})
    assert (summary["initial_val_accuracy"], summary["final_val_accuracy"], summary["best_val_accuracy"]) == (
        0.1, 0.6, 0.6)
    assert summary["final_test_accuracy"] != summary["final_test_accuracy"]  # NaN
    assert "val acc 0.6000" in caplog.text and "final val accuracy 0.6000" in caplog.text
