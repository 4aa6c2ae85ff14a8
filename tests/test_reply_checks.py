"""A reply is believed only where it cannot lie: the round's K and learning rate are the server's,
every other number is checked, and a round the replies would poison changes nothing.

Each case is a forged reply as a hostile or broken client could send it through Flower (real
Flower Message and record types), fed to the strategy's ``aggregate_train``."""

import json
import logging
import math
import time

import pytest
import torch
from flwr.app import Message, MessageType, Metadata, MetricRecord, RecordDict

from fedact_app.aggregation import Aggregation
from fedact_app.algorithms import ALGORITHMS
from fedact_app.config import compose
from fedact_app.strategy import AlgorithmStrategy
from fedact_app.wire import packed_record

STATE = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1.0, -1.0]), "bn.n": torch.tensor(3)}
TRAINABLE = ["w", "b"]
K, LR, BATCH = 5, 0.1, 4  # the round's own terms: lr-sum = K * LR = 0.5, num-examples <= 20
METRICS = {"num-examples": 20, "num-steps": K, "lr-sum": K * LR, "train-loss": 1.5, "train-seconds": 0.2}


def content(delta_scale=1.0, v=0.04, **metrics):
    return RecordDict({
        "delta": packed_record({"w": torch.full((2, 3), 0.25 * delta_scale),
                              "b": torch.tensor([0.5, -0.5]) * delta_scale, "bn.n": torch.tensor(1)}),
        "v": packed_record({"w": torch.full((2, 3), v), "b": torch.full((2,), v)}),
        "metrics": MetricRecord({**METRICS, **metrics}),
    })


def reply(node, record):
    metadata = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0,
                        reply_to_message_id=f"q{node}", group_id="1", created_at=time.time(), ttl=60.0,
                        message_type=MessageType.TRAIN)
    return Message(metadata=metadata, content=record)


def fedact_strategy(min_train_nodes=1, **kwargs) -> AlgorithmStrategy:
    cfg = compose(["algorithm=fedact"]).algorithm
    strategy = AlgorithmStrategy(ALGORITHMS["fedact"].server(cfg, TRAINABLE), trainable=TRAINABLE,
                                 local_steps=K, lr_schedule=lambda r: LR, fraction_train=1.0,
                                 min_train_nodes=min_train_nodes, batch_size=BATCH, **kwargs)
    strategy.state = {n: t.clone() for n, t in STATE.items()}
    return strategy


def unchanged(strategy, rule_state=None) -> bool:
    return (all(torch.equal(strategy.state[n], STATE[n]) for n in STATE)
            and strategy.rule.state_dict().keys() == (rule_state or {}).keys()
            and all(torch.equal(strategy.rule.state_dict()[k][n], t)
                    for k, arrays in (rule_state or {}).items() for n, t in arrays.items()))


FORGED = {
    # the round's terms are the server's: Delta_G = -mean(Delta) / lr-sum would take a forged one
    "lr-sum 1e-9": {"lr-sum": 1e-9},
    "lr-sum 1e-300": {"lr-sum": 1e-300},
    "lr-sum 10x": {"lr-sum": 5.0},
    "num-steps other than K": {"num-steps": K + 1},
    "num-steps not an integer": {"num-steps": 4.5},
    # weighting=examples would hand this client the whole aggregate
    "num-examples 1e15": {"num-examples": 1e15},
    "num-examples above K x batch": {"num-examples": K * BATCH + 1},
    "train-loss NaN": {"train-loss": math.nan},
    "train-loss inf": {"train-loss": math.inf},
    "train-loss a list": {"train-loss": [1.0, 2.0]},
    "train-seconds negative": {"train-seconds": -1.0},
    "work-start negative": {"work-start": -1.0},
    "work-start inf": {"work-start": math.inf},
    "work-start a list": {"work-start": [1.0, 2.0]},
    # an int beyond float's range: isfinite overflows (it raised OverflowError, not a rejection)
    "work-start 10**400": {"work-start": 10**400},
    "train-loss 10**400": {"train-loss": 10**400},
    "positive-ratio above 1": {"positive-ratio": 1.5},
    "top-p-mass negative": {"top-p-mass": -0.1},
    "amplified-fraction NaN": {"amplified-fraction": math.nan},
    # a partition-id the server could not order by (it crashed the ServerApp before)
    "partition-id a list": {"partition-id": [1.0, 2.0]},
    "partition-id inf": {"partition-id": math.inf},
    "partition-id negative": {"partition-id": -2},
}


@pytest.mark.parametrize("name", sorted(FORGED))
def test_a_forged_number_is_rejected_and_moves_nothing(name, caplog):
    strategy = fedact_strategy()
    strategy.messages_sent = 1
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy.aggregate_train(1, [reply(7, content(**FORGED[name]))])
    assert arrays is None and (metrics["clients"], metrics["rejected"]) == (0, 1)
    assert unchanged(strategy)
    assert "rejected reply of node 7" in caplog.text


def test_delta_g_divides_by_the_servers_own_k_lr():
    """An honest reply's Delta_G = -Delta / (K lr) exactly (seed, Algorithm 1 line 23)."""
    strategy = fedact_strategy()
    strategy.messages_sent = 1
    arrays, metrics = strategy.aggregate_train(1, [reply(7, content())])
    assert arrays is not None and metrics["clients"] == 1
    delta_g = strategy.rule.state_dict()["delta_g"]
    torch.testing.assert_close(delta_g["w"], torch.full((2, 3), -0.25 / (K * LR)), rtol=0, atol=0)


def test_an_absurd_second_moment_is_rejected_and_the_others_aggregate(caplog):
    """v = 1e30 (finite, >= 0) among honest v ~ 0.04: rejected; v_bar is the honest mean."""
    strategy = fedact_strategy(min_train_nodes=2)
    strategy.messages_sent = 3
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, metrics = strategy.aggregate_train(1, [reply(1, content(v=0.04)), reply(2, content(v=1e30)),
                                                  reply(3, content(v=0.05))])
    assert (metrics["clients"], metrics["rejected"]) == (2, 1)
    assert "rejected reply of node 2: 'v' norm" in caplog.text
    torch.testing.assert_close(strategy.rule.state_dict()["v_bar"]["w"], torch.full((2, 3), 0.045))


def test_a_lone_absurd_second_moment_is_measured_against_v_bar():
    strategy = fedact_strategy()
    strategy.messages_sent = 1
    strategy.aggregate_train(1, [reply(1, content(v=0.04))])
    kept = {k: dict(v) for k, v in strategy.rule.state_dict().items()}
    state = dict(strategy.state)
    arrays, metrics = strategy.aggregate_train(2, [reply(2, content(v=1e30))])
    assert arrays is None and metrics["rejected"] == 1
    assert all(torch.equal(strategy.state[n], state[n]) for n in state)
    assert all(torch.equal(strategy.rule.state_dict()[k][n], t) for k, a in kept.items() for n, t in a.items())


def test_a_zero_second_moment_is_rejected_and_does_not_make_honest_ones_outliers():
    """v = 0 passes the >= 0 check, but no honest v is 0 after K steps: it is rejected as far
    below the others, and the honest reply is kept (a zero median once rejected it)."""
    strategy = fedact_strategy()
    strategy.messages_sent = 2
    _, metrics = strategy.aggregate_train(1, [reply(1, content(v=0.04)), reply(2, content(v=0.0))])
    assert (metrics["clients"], metrics["rejected"]) == (1, 1)
    torch.testing.assert_close(strategy.rule.state_dict()["v_bar"]["w"], torch.full((2, 3), 0.04))


def test_more_replies_than_scaffold_has_clients_change_nothing(caplog):
    """Two SuperNodes started with one partition can bring more replies than N: SCAFFOLD's rule
    refuses them, and the round changes nothing instead of crashing the ServerApp."""
    cfg = compose(["algorithm=scaffold"]).algorithm
    strategy = AlgorithmStrategy(ALGORITHMS["scaffold"].server(cfg, TRAINABLE, num_clients=1), trainable=TRAINABLE,
                                 local_steps=K, lr_schedule=lambda r: LR, fraction_train=1.0, min_train_nodes=1,
                                 batch_size=BATCH)
    strategy.state = {n: t.clone() for n, t in STATE.items()}
    strategy.messages_sent = 2
    record = content()
    del record["v"]
    record["delta_c"] = packed_record({"w": torch.zeros(2, 3), "b": torch.zeros(2)})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy.aggregate_train(1, [reply(1, record), reply(2, record)])
    assert arrays is None and metrics["clients"] == 0 and unchanged(strategy)
    assert "the server rule refused the 2 replies" in caplog.text


def test_the_moment_check_can_be_turned_off():
    strategy = fedact_strategy(max_moment_ratio=0)
    strategy.messages_sent = 2
    _, metrics = strategy.aggregate_train(1, [reply(1, content(v=0.04)), reply(2, content(v=1e30))])
    assert metrics["clients"] == 2


def test_a_round_with_fewer_accepted_replies_than_min_train_nodes_changes_nothing(caplog):
    strategy = fedact_strategy(min_train_nodes=2)
    strategy.messages_sent = 2
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy.aggregate_train(1, [reply(1, content()), reply(2, content(**{"lr-sum": 1e-9}))])
    assert arrays is None and (metrics["clients"], metrics["rejected"]) == (0, 2)
    assert unchanged(strategy)
    assert "1 usable replies, fewer than min_train_nodes=2" in caplog.text


def test_an_aggregate_that_overflows_changes_nothing(caplog):
    """Two finite float32 deltas whose mean overflows in x + mean: the round is dropped."""
    strategy = fedact_strategy(max_moment_ratio=0)
    strategy.state = {**strategy.state, "w": torch.full((2, 3), 3.3e38)}
    before = dict(strategy.state)
    strategy.messages_sent = 2
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy.aggregate_train(1, [reply(1, content(delta_scale=1.2e38)),
                                                       reply(2, content(delta_scale=1.2e38))])
    assert arrays is None and metrics["clients"] == 0
    assert all(torch.equal(strategy.state[n], before[n]) for n in before)
    assert strategy.rule.state_dict() == {}
    assert "is not finite" in caplog.text


def test_a_reply_naming_another_partition_than_its_node_is_rejected():
    strategy = fedact_strategy()
    strategy.client_keys = {7: (0, 3, "")}
    strategy.messages_sent = 2
    _, metrics = strategy.aggregate_train(1, [reply(7, content(**{"partition-id": 4}))])
    assert metrics["rejected"] == 1
    _, metrics = strategy.aggregate_train(1, [reply(7, content(**{"partition-id": 3}))])
    assert metrics["clients"] == 1


def test_forged_evaluation_replies_are_left_out():
    strategy = fedact_strategy()
    good = MetricRecord({"num-examples": 10, "test-accuracy": 0.5})
    forged = [MetricRecord({"num-examples": 10 ** 15, "test-accuracy": 0.0}),
              MetricRecord({"num-examples": 10.5, "test-accuracy": 0.0}),
              MetricRecord({"num-examples": 10, "test-accuracy": math.nan})]
    replies = [reply(1, RecordDict({"metrics": good}))] + [reply(i + 2, RecordDict({"metrics": m}))
                                                           for i, m in enumerate(forged)]
    assert dict(strategy.aggregate_evaluate(1, replies)) == {"client_test_accuracy": 0.5}


def test_a_non_finite_metric_is_written_as_json_null():
    """metrics.jsonl stays strict JSON (a bare NaN breaks other readers, e.g. JSON.parse, jq)."""
    from fedact_app.results import json_line

    line = json_line({"round": 3, "test_loss": math.nan, "train_loss": math.inf, "clients": 2})
    assert json.loads(line) == {"round": 3, "test_loss": None, "train_loss": None, "clients": 2}
    assert "NaN" not in line and "Infinity" not in line


def test_a_scaled_update_is_rejected_with_both_norms_and_the_others_aggregate(caplog):
    """Delta x 1e4 among honest replies: more than max_update_ratio (default 10) times the round's
    lower median norm; x moves by the mean of the other two, and the log names both numbers."""
    strategy = fedact_strategy(min_train_nodes=2)
    strategy.messages_sent = 3
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, metrics = strategy.aggregate_train(1, [reply(1, content()), reply(2, content(delta_scale=1e4)),
                                                  reply(3, content(delta_scale=0.8))])
    assert (metrics["clients"], metrics["rejected"]) == (2, 1)
    norm = (6 * 0.25 ** 2 + 2 * 0.5 ** 2) ** 0.5  # ||Delta|| over the trainable w, b at delta_scale 1
    # the lower median of (0.8, 1, 1e4) x norm is norm
    assert (f"rejected reply of node 2: update norm {1e4 * norm:.4g} is {1e4:.4g} times the round's median "
            f"{norm:.4g}, more than max_update_ratio=10") in caplog.text
    torch.testing.assert_close(strategy.state["w"], STATE["w"] + 0.25 * 0.9)
    assert metrics["update_norm_ratio"] == pytest.approx(1.0)  # the largest accepted norm over the median


def test_the_update_bound_uses_the_lower_median_so_one_of_two_cannot_raise_it():
    strategy = fedact_strategy()
    strategy.messages_sent = 2
    _, metrics = strategy.aggregate_train(1, [reply(1, content()), reply(2, content(delta_scale=11.0))])
    assert (metrics["clients"], metrics["rejected"]) == (1, 1)
    strategy = fedact_strategy()
    strategy.messages_sent = 2
    _, metrics = strategy.aggregate_train(1, [reply(1, content()), reply(2, content(delta_scale=9.0))])
    assert (metrics["clients"], metrics["rejected"]) == (2, 0) and metrics["update_norm_ratio"] == pytest.approx(9.0)


def test_the_update_bound_can_be_turned_off_and_a_reply_failing_two_bounds_counts_once(caplog):
    strategy = fedact_strategy(max_update_ratio=0)
    strategy.messages_sent = 2
    _, metrics = strategy.aggregate_train(1, [reply(1, content()), reply(2, content(delta_scale=1e4))])
    assert metrics["clients"] == 2 and metrics["update_norm_ratio"] == pytest.approx(1e4)
    strategy = fedact_strategy()
    strategy.messages_sent = 3
    with caplog.at_level(logging.WARNING, logger="flwr"):
        _, metrics = strategy.aggregate_train(1, [reply(1, content()), reply(2, content(delta_scale=1e4, v=1e30)),
                                                  reply(3, content())])
    assert (metrics["clients"], metrics["rejected"]) == (2, 1)
    assert "rejected reply of node 2: 'v' norm" in caplog.text and "; update norm" in caplog.text


@pytest.mark.parametrize("aggregation", ["trimmed_mean", "median"])
def test_a_robust_rule_takes_the_middle_of_the_accepted_replies(aggregation):
    """Through the strategy: the bound off, a client 5x the others is kept, and the robust rule
    (3 replies: trimmed_mean drops one at each end, as median does) gives the middle one."""
    cfg = compose(["algorithm=fedact"]).algorithm
    rule = ALGORITHMS["fedact"].server(cfg, TRAINABLE, aggregation=Aggregation(aggregation))
    strategy = AlgorithmStrategy(rule, trainable=TRAINABLE, local_steps=K, lr_schedule=lambda r: LR,
                                 fraction_train=1.0, min_train_nodes=1, batch_size=BATCH, max_update_ratio=0)
    strategy.state = {n: t.clone() for n, t in STATE.items()}
    strategy.messages_sent = 3
    _, metrics = strategy.aggregate_train(1, [reply(1, content(delta_scale=1.0)), reply(2, content(delta_scale=5.0)),
                                              reply(3, content(delta_scale=1.5))])
    assert metrics["clients"] == 3
    torch.testing.assert_close(strategy.state["w"], STATE["w"] + 0.25 * 1.5)
    torch.testing.assert_close(strategy.rule.state_dict()["delta_g"]["w"], torch.full((2, 3), -0.25 * 1.5 / (K * LR)))


def test_a_round_too_small_for_the_trim_changes_nothing(caplog):
    cfg = compose(["algorithm=fedact"]).algorithm
    rule = ALGORITHMS["fedact"].server(cfg, TRAINABLE, aggregation=Aggregation("trimmed_mean"))
    strategy = AlgorithmStrategy(rule, trainable=TRAINABLE, local_steps=K, lr_schedule=lambda r: LR,
                                 fraction_train=1.0, min_train_nodes=1, batch_size=BATCH)
    strategy.state = {n: t.clone() for n, t in STATE.items()}
    strategy.messages_sent = 2
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, metrics = strategy.aggregate_train(1, [reply(1, content()), reply(2, content())])
    assert arrays is None and metrics["clients"] == 0 and unchanged(strategy)
    assert "the server rule refused the 2 replies (trimmed_mean with trim_fraction=0.2" in caplog.text


def test_the_attack_client_forges_its_update_in_the_runs_reply_dtype(monkeypatch):
    """scripts/attack_client.py reads the honest Delta and sends the forged one as the run's
    clients send replies: with reply_dtype=bfloat16, as bfloat16's bits (else its forgery would
    read the bits as integers and leave them honest)."""
    import sys
    from pathlib import Path

    from flwr.app import Context

    from fedact_app.wire import to_wire, unpacked

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import attack_client

    honest = {"w": torch.tensor([0.5, -0.25, 3e-3]), "n": torch.tensor(3)}
    metadata = Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=5, reply_to_message_id="",
                        group_id="1", created_at=time.time(), ttl=60.0, message_type=MessageType.TRAIN)
    msg = Message(metadata=metadata, content=RecordDict({"model": packed_record({"w": torch.zeros(3),
                                                                                  "n": torch.tensor(0)})}))
    monkeypatch.setattr(attack_client.client_app, "train", lambda m, _: Message(
        content=RecordDict({"delta": packed_record(to_wire(honest, "bfloat16"))}), reply_to=m))
    context = Context(run_id=1, node_id=5, state=RecordDict(), node_config={"partition-id": attack_client.ATTACKER},
                      run_config={"overrides": "reply_dtype=bfloat16"})
    forged = unpacked(attack_client.train(msg, context).content["delta"])
    assert forged["w"].dtype == torch.int16 and torch.equal(forged["n"], honest["n"])
    sent = honest["w"].bfloat16().float()
    assert torch.equal(forged["w"].view(torch.bfloat16), (sent * 1e4).bfloat16())
