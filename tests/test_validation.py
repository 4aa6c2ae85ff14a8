"""Bad input never reaches training or the global state: config values (each category of
bad value), configs the data cannot feed, and bad client replies built as real Flower messages."""

import logging
import math
import time
from types import SimpleNamespace
from dataclasses import fields, is_dataclass

import numpy as np
import pytest
import torch
from flwr.app import Error, Message, MessageType, Metadata, MetricRecord, RecordDict

from fedact_app.algorithms import ALGORITHMS
from fedact_app.config import Config, ConfigError, compose
from fedact_app.tasks.vision.data import train_labels
from fedact_app.tasks.vision.partition import check_partitions
from fedact_app.replies import ReplyError, decode_update, read_arrays
from fedact_app.strategy import AlgorithmStrategy
from fedact_app.wire import packed_record, to_wire, unpacked


@pytest.mark.parametrize("override, key", [
    # tau in (0, 1], rho in [0, 1], alpha >= gamma >= 0
    ("algorithm.tau=-0.5", "algorithm.tau"),
    ("algorithm.rho=2", "algorithm.rho"),
    ("algorithm.gamma=-0.1", "algorithm.gamma"),
    ("algorithm.alpha=0.2 algorithm.gamma=0.3", "algorithm.alpha"),
    # learning rates > 0
    ("algorithm.lr=-0.5", "algorithm.lr"),
    ("algorithm.lr_min=1", "algorithm.lr_min"),
    ("algorithm=fedadam algorithm.server_lr=0", "algorithm.server_lr"),
    # betas in [0, 1)
    ("algorithm.betas=[-0.1,0.999]", "algorithm.betas"),
    ("algorithm.betas=[0.9]", "algorithm.betas"),
    ("algorithm=fedadam algorithm.server_betas=[0.9,1.0]", "algorithm.server_betas"),
    # Dirichlet alpha > 0
    ("partition.alpha=-1", "partition.alpha"),
    # fractions in (0, 1]
    ("fraction_train=1.5", "fraction_train"),
    ("fraction_evaluate=-0.1", "fraction_evaluate"),
    # counts >= 1
    ("num_rounds=0", "num_rounds"),
    ("batch_size=0", "batch_size"),
    ("min_train_nodes=11", "min_train_nodes"),  # > num_clients = 10
    ("max_empty_rounds=0", "max_empty_rounds"),
    ("keep_checkpoints=0", "keep_checkpoints"),
    ("checkpoint_every=-1", "checkpoint_every"),
    # known names
    ("dataset.name=mnist", "dataset.name"),
    ("partition.name=shards", "partition.name"),
    ("algorithm.name=fedsgd", "algorithm.name"),
    # a key the method does not read, set away from its default
    ("algorithm=fedavg algorithm.rho=0.3", "algorithm.rho"),
    # reply bound, fault injection
    ("max_update_norm=0", "max_update_norm"),
    ("max_moment_ratio=0.5", "max_moment_ratio"),
    ("debug.fail_partitions=[10] debug.fail_rounds=[1]", "debug.fail_partitions"),
    ("debug.fail_partitions=[0] debug.fail_rounds=[11]", "debug.fail_rounds"),
    ("debug.fail_partitions=[0]", "debug.fail_rounds"),
    ("debug.fail_partitions=[0] debug.fail_rounds=[1] debug.hang_seconds=-1", "debug.hang_seconds"),
])
def test_each_bad_config_category_fails_naming_key_value_and_range(override, key):
    with pytest.raises(ConfigError) as err:
        compose(override.split())
    message = str(err.value)
    assert message.startswith(f"Invalid config value {key}=") and "allowed" in message
    shown = dict(item.split("=", 1) for item in override.split()).get(key)
    assert shown is None or shown in message.replace(" ", "")  # the bad value itself is shown


# a method that reads the key (else it must keep its default); model.lora needs its model
FLOAT_KEY_CONTEXT = {"algorithm.mu": "algorithm=fedprox", "algorithm.server_betas": "algorithm=fedadam",
                     "algorithm.server_eps": "algorithm=fedadam",
                     "model.lora.alpha": "task=sft dataset=alpaca_gpt4 model=lora_causal_lm",
                     "model.lora.dropout": "task=sft dataset=alpaca_gpt4 model=lora_causal_lm",
                     "language.dpo_beta": "task=dpo dataset=hh_rlhf model=lora_causal_lm"}


def _float_keys(node, prefix=""):
    """The dotted keys of the schema's float, optional float and float-list fields (annotations)."""
    keys = []
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            keys += _float_keys(value, f"{prefix}{f.name}.")
        elif f.type in ("float", "Optional[float]", "list[float]"):
            keys.append(prefix + f.name)
    return keys


@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("key", _float_keys(Config()))
def test_every_float_must_be_finite(key, bad):
    """inf passes checks like '> 0' and nan fails every comparison; either only makes rounds fail."""
    value = f"[{bad},{bad},{bad}]" if key in ("dataset.mean", "dataset.std") else (
        f"[0.9,{bad}]" if key.endswith("betas") else bad)
    with pytest.raises(ConfigError, match=rf"^Invalid config value {key}=.*: allowed (a finite number|finite numbers)$"):
        compose(FLOAT_KEY_CONTEXT.get(key, "").split() + [f"{key}={value}"])


@pytest.mark.parametrize("algorithm", [name for name, a in ALGORITHMS.items() if "eps" in a.uses])
def test_eps_zero_is_refused_by_every_method_that_divides_by_it(algorithm):
    with pytest.raises(ConfigError, match=r"^Invalid config value algorithm.eps=0.0: allowed > 0"):
        compose([f"algorithm={algorithm}", "algorithm.eps=0"])


def test_fault_injection_and_bound_are_off_by_default():
    cfg = compose()
    assert cfg.debug.fail_partitions == [] and cfg.debug.fail_rounds == []
    assert cfg.max_update_norm is None and cfg.resume is None


@pytest.mark.parametrize("overrides, needle", [
    ("partition=iid num_clients=1438", "1437 training examples"),  # more clients than examples
    ("partition=dirichlet partition.alpha=0.1 partition.min_partition_size=200 num_clients=10",
     "every client >= 200 examples"),
])
def test_more_clients_than_the_data_can_feed_fails_before_training(overrides, needle):
    cfg = compose(overrides.split())
    with pytest.raises(ConfigError) as err:
        check_partitions(cfg, train_labels(cfg))
    message = str(err.value)
    assert f"num_clients={cfg.num_clients}" in message and needle in message
    assert "dataset=digits" in message and "10 classes" in message and f"partition={cfg.partition.name}" in message


def test_a_feasible_split_passes():
    cfg = compose(["num_clients=10"])
    check_partitions(cfg, train_labels(cfg))
    assert len(train_labels(cfg)) == 1437 and np.unique(train_labels(cfg)).size == 10


# ---------------------------------------------------------------- replies

STATE = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1.0, -1.0]), "bn.n": torch.tensor(3)}
TRAINABLE = ["w", "b"]
LR_SUM = 0.5


def good_content(scale=1.0):
    return RecordDict({
        "delta": packed_record({"w": torch.full((2, 3), 0.25 * scale), "b": torch.tensor([0.5, -0.5]) * scale,
                              "bn.n": torch.tensor(1)}),
        "v": packed_record({"w": torch.full((2, 3), 0.04), "b": torch.tensor([0.01, 0.09])}),
        "metrics": MetricRecord({"num-examples": 10, "num-steps": 5, "lr-sum": LR_SUM, "train-loss": 1.0}),
    })


def with_record(key, record):
    content = good_content()
    content[key] = record
    return content


def without(key):
    content = good_content()
    del content[key]
    return content


def reply(node: int, content: RecordDict | None = None, error: Error | None = None,
          created_at: float | None = None) -> Message:
    """A reply as the SuperLink hands it to the ServerApp (real Flower Message and Metadata),
    made at ``created_at`` (Unix seconds; default: now)."""
    metadata = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0,
                        reply_to_message_id=f"q{node}", group_id="1",
                        created_at=time.time() if created_at is None else created_at, ttl=60.0,
                        message_type=MessageType.TRAIN)
    return Message(metadata=metadata, content=content, error=error)


BAD = {
    "missing delta": without("delta"),
    "missing v": without("v"),
    "missing metrics": without("metrics"),
    "missing key": with_record("delta", packed_record({"w": torch.zeros(2, 3), "bn.n": torch.tensor(0)})),
    "wrong shape": with_record("v", packed_record({"w": torch.zeros(3, 2), "b": torch.zeros(2)})),
    "wrong dtype": with_record("v", packed_record({"w": torch.zeros(2, 3, dtype=torch.float16), "b": torch.zeros(2)})),
    "nan": with_record("delta", packed_record({"w": torch.full((2, 3), float("nan")), "b": torch.zeros(2),
                                             "bn.n": torch.tensor(0)})),
    "negative v": with_record("v", packed_record({"w": torch.full((2, 3), 0.04), "b": torch.tensor([0.01, -1e-9])})),
    "zero steps": with_record("metrics", MetricRecord({"num-examples": 10, "num-steps": 0, "lr-sum": LR_SUM})),
    "negative lr-sum": with_record("metrics", MetricRecord({"num-examples": 10, "num-steps": 5, "lr-sum": -0.5})),
    "zero examples": with_record("metrics", MetricRecord({"num-examples": 0, "num-steps": 5, "lr-sum": LR_SUM})),
}


def fedact_strategy(max_update_norm=None) -> AlgorithmStrategy:
    cfg = compose(["algorithm=fedact"]).algorithm
    strategy = AlgorithmStrategy(ALGORITHMS["fedact"].server(cfg, TRAINABLE), trainable=TRAINABLE,
                                 local_steps=5, lr_schedule=lambda r: 0.1, fraction_train=1.0,
                                 min_train_nodes=1, max_update_norm=max_update_norm)
    strategy.state = {n: t.clone() for n, t in STATE.items()}
    return strategy


@pytest.mark.parametrize("name", sorted(BAD))
def test_each_bad_reply_leaves_the_model_unchanged_and_is_counted(name):
    strategy = fedact_strategy()
    strategy.messages_sent = 1
    arrays, metrics = strategy.aggregate_train(1, [reply(7, BAD[name])])
    assert arrays is None
    assert (metrics["clients"], metrics["rejected"], metrics["failed"], metrics["missing"]) == (0, 1, 0, 0)
    assert all(torch.equal(strategy.state[n], STATE[n]) for n in STATE)
    assert strategy.rule.state_dict() == {}  # v_bar, Delta_G untouched


def test_error_reply_and_missing_reply_are_counted_and_only_good_replies_aggregate():
    """One good reply, one Flower error reply (the ClientApp raised), one node that never replied:
    x, v_bar and Delta_G come from the good reply alone (S = 1), by the seed's lines 22-24."""
    strategy = fedact_strategy()
    strategy.messages_sent = 3
    failed = reply(8, error=Error(code=3, reason="ClientApp raised InjectedFault"))
    arrays, metrics = strategy.aggregate_train(1, [reply(7, good_content()), failed])
    assert (metrics["clients"], metrics["rejected"], metrics["failed"], metrics["missing"]) == (1, 1, 1, 1)
    good = good_content()
    delta = unpacked(good["delta"])
    for name in STATE:
        assert torch.equal(strategy.state[name], STATE[name] + delta[name])
    state = strategy.rule.state_dict()
    for name in TRAINABLE:
        torch.testing.assert_close(state["delta_g"][name], -delta[name] / LR_SUM, rtol=0, atol=0)
        assert torch.equal(state["v_bar"][name], unpacked(good["v"])[name])
    assert arrays is not None


def test_update_norm_bound_rejects_only_larger_updates():
    # ||delta|| over trainable w, b: sqrt(6 * 0.25^2 + 2 * 0.5^2) = sqrt(0.875); the integer buffer is not counted
    norm = (6 * 0.25 ** 2 + 2 * 0.5 ** 2) ** 0.5
    decode_update(good_content(), STATE, ("v",), TRAINABLE, ("v",), max_update_norm=norm * 1.001)
    with pytest.raises(ReplyError, match="exceeds max_update_norm"):
        decode_update(good_content(), STATE, ("v",), TRAINABLE, ("v",), max_update_norm=norm * 0.999)
    strategy = fedact_strategy(max_update_norm=1.0)
    strategy.messages_sent = 2
    _, metrics = strategy.aggregate_train(1, [reply(1, good_content()), reply(2, good_content(scale=2.0))])
    assert (metrics["clients"], metrics["rejected"]) == (1, 1)  # 2 * 0.935 > 1 rejected, 0.935 kept


def bfloat16_value(x: float) -> float:
    """The bfloat16 nearest to the float32 ``x`` (ties to even), by its bits: the upper 16 of them,
    plus one where the lower 16 are above half, or at half with the upper ones odd."""
    bits = int(np.float32(x).view(np.uint32))
    upper, lower = bits >> 16, bits & 0xFFFF
    upper += lower > 0x8000 or (lower == 0x8000 and upper & 1)
    return float(np.uint32(upper << 16).view(np.float32))


def test_a_bfloat16_reply_decodes_to_the_nearest_bfloat16_of_each_value():
    """reply_dtype=bfloat16: the client sends each floating value's nearest bfloat16 as its bits,
    the server reads back exactly those values (integers unchanged), and the update's norm is
    theirs."""
    g = torch.Generator().manual_seed(3)
    delta = {"w": torch.randn(2, 3, generator=g) * torch.tensor([1e-30, 1e-3, 1.0]), "b": torch.randn(2, generator=g),
             "bn.n": torch.tensor(1)}
    v = {"w": torch.rand(2, 3, generator=g) ** 8, "b": torch.tensor([1e-38, 3.0e38])}
    content = good_content()
    content["delta"], content["v"] = packed_record(to_wire(delta, "bfloat16")), packed_record(to_wire(v, "bfloat16"))
    update = decode_update(content, STATE, ("v",), TRAINABLE, ("v",), reply_dtype="bfloat16")
    for sent, got in ((delta, update.delta), (v, update.arrays["v"])):
        for name, tensor in sent.items():
            if tensor.is_floating_point():
                want = [bfloat16_value(x) for x in tensor.flatten().tolist()]
                assert got[name].dtype == torch.float32 and got[name].flatten().tolist() == want, name
            else:
                assert torch.equal(got[name], tensor)
    squares = sum(bfloat16_value(x) ** 2 for name in TRAINABLE for x in delta[name].flatten().tolist())
    assert update.norms["delta"] == pytest.approx(math.sqrt(squares), rel=1e-12)
    # an entry of another floating dtype than the first's is read alone, into its own dtype
    mixed = {"a": torch.tensor([0.1, -2.5]),
             "d": torch.tensor([float(np.float32(1 / 3)), 2.0 ** -70, -7.0], dtype=torch.float64)}
    got, _ = read_arrays("v", packed_record(to_wire(mixed, "bfloat16")), mixed, first=["a"], wire="bfloat16")
    assert got["d"].dtype == torch.float64
    assert got["d"].tolist() == [bfloat16_value(x) for x in mixed["d"].tolist()]  # float32 values: no double rounding
    assert got["a"].tolist() == [bfloat16_value(x) for x in mixed["a"].tolist()]


def test_a_reply_in_the_other_dtype_than_the_runs_reply_dtype_is_refused_naming_it():
    as_bits = good_content()
    as_bits["v"] = packed_record(to_wire(unpacked(as_bits["v"]), "bfloat16"))
    with pytest.raises(ReplyError, match=r"'v'\['w'\]: \(2, 3\) int16, expected \(2, 3\) torch.float32 "
                                         r"\(the run's reply_dtype is float32\)$"):
        decode_update(as_bits, STATE, ("v",), TRAINABLE)
    with pytest.raises(ReplyError, match=r"'delta'\['w'\]: \(2, 3\) float32, expected \(2, 3\) torch.float32 as "
                                         r"bfloat16's bits \(int16\) \(the run's reply_dtype is bfloat16\)$"):
        decode_update(good_content(), STATE, ("v",), TRAINABLE, reply_dtype="bfloat16")
    with pytest.raises(ValueError, match="reply dtype 'float16': allowed one of float32, bfloat16"):
        decode_update(good_content(), STATE, ("v",), TRAINABLE, reply_dtype="float16")
    broken = {"w": torch.full((2, 3), float("inf")), "b": torch.zeros(2), "bn.n": torch.tensor(0)}
    content = good_content()
    content["delta"] = packed_record(to_wire(broken, "bfloat16"))
    content["v"] = packed_record(to_wire(unpacked(content["v"]), "bfloat16"))
    with pytest.raises(ReplyError, match=r"'delta'\['w'\] has non-finite values"):
        decode_update(content, STATE, ("v",), TRAINABLE, reply_dtype="bfloat16")


def test_negative_second_moment_is_rejected_only_where_declared():
    content = BAD["negative v"]
    with pytest.raises(ReplyError, match="'v' has negative values"):
        decode_update(content, STATE, ("v",), TRAINABLE, nonnegative=("v",))
    decode_update(content, STATE, ("v",), TRAINABLE)  # a method that declares nothing accepts it
    assert ALGORITHMS["fedact"].server.nonnegative_keys == ("v",)
    assert ALGORITHMS["fedlada"].server.nonnegative_keys == ("v",)
    assert ALGORITHMS["scaffold"].server.nonnegative_keys == ()  # Delta c_i has any sign


def test_aggregation_does_not_depend_on_the_order_replies_arrive_in():
    """Float sums depend on order; replies are aggregated by partition id, so any arrival order
    gives the same bits (what makes a resumed run equal a straight one)."""
    contents = []
    for pid in range(3):
        content = good_content(scale=1.0 + pid / 7)
        content["v"] = packed_record({"w": torch.rand(2, 3), "b": torch.rand(2)})
        content["metrics"] = MetricRecord({"num-examples": 10, "num-steps": 5, "lr-sum": LR_SUM / 3 * (pid + 1),
                                           "train-loss": 1.0, "partition-id": pid})
        contents.append(content)
    results = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        strategy = fedact_strategy()
        strategy.messages_sent = 3
        strategy.aggregate_train(1, [reply(10 + i, contents[i]) for i in order])
        results.append((strategy.state, strategy.rule.state_dict()))
    for state, rule in results[1:]:
        assert all(torch.equal(state[n], results[0][0][n]) for n in STATE)
        assert all(torch.equal(rule[k][n], results[0][1][k][n]) for k in rule for n in TRAINABLE)


def test_replies_decoded_as_they_arrive_give_the_round_of_replies_decoded_at_its_end(monkeypatch, caplog):
    """The strategy decodes replies as they are pulled (Arrivals.feed); a round whose replies came
    in two pulls, and one whose second reply was never fed, equal bit for bit the round decoded
    all at once, the bad reply refused alike, and every record is decoded once."""
    import fedact_app.replies as replies_module

    decode, decoded = replies_module.decode_updates, []
    monkeypatch.setattr(replies_module, "decode_updates",
                        lambda contents, *a, **kw: (decoded.extend(map(id, contents)), decode(contents, *a, **kw))[1])
    contents = [good_content(scale=1.0 + i / 7) for i in range(3)] + [BAD["negative v"]]
    for i, content in enumerate(contents[:3]):  # each update's examples weigh its own message's loss
        content["metrics"] = MetricRecord({**dict(content["metrics"]), "num-examples": 10 + i, "train-loss": 1.0 + i})
    results = []
    for batches in ([], [[0, 2], [3]], [[2], [0, 3]]):
        strategy = fedact_strategy()
        strategy.messages_sent = 4
        replies = [reply(10 + i, contents[i]) for i in range(4)]
        arrivals = strategy.round_arrivals(1) if batches else None
        for batch in batches:
            arrivals.feed([replies[i] for i in batch])
        decoded.clear()
        with caplog.at_level(logging.WARNING, logger="flwr"):
            caplog.clear()
            _, metrics = strategy.aggregate_train(1, replies, arrivals)
        assert len(decoded) == 4 - sum(map(len, batches))  # only the records not fed yet
        assert (metrics["clients"], metrics["rejected"]) == (3, 1)
        assert "rejected reply of node 13: 'v' has negative values" in caplog.text
        assert metrics["train_loss"] == (10 * 1.0 + 11 * 2.0 + 12 * 3.0) / 33  # each update with its message
        results.append((strategy.state, strategy.rule.state_dict(), metrics))
    for state, rule, metrics in results[1:]:
        assert all(torch.equal(state[n], results[0][0][n]) for n in STATE)
        assert all(torch.equal(rule[k][n], results[0][1][k][n]) for k in rule for n in TRAINABLE)
        assert dict(metrics) == dict(results[0][2])


def test_a_refused_reply_leaves_no_decoded_update_alive_after_the_round(monkeypatch):
    """Once ``aggregate_train`` returns nothing holds the round's decoded updates, with the cycle
    collector off (on a GPU server they are device memory): a refused reply's error raised again
    would tie every update of the round to its traceback until a collection."""
    import gc
    import weakref

    import fedact_app.replies as replies_module

    decode, alive = replies_module.decode_updates, []

    def tracked(contents, *args, **kwargs):
        updates = decode(contents, *args, **kwargs)
        alive.extend(weakref.ref(u) for u in updates if not isinstance(u, ReplyError))
        return updates

    monkeypatch.setattr(replies_module, "decode_updates", tracked)
    strategy = fedact_strategy()
    strategy.messages_sent = 3
    gc.collect()
    gc.disable()
    try:
        _, metrics = strategy.aggregate_train(1, [reply(1, good_content()), reply(2, good_content(scale=2.0)),
                                                  reply(3, BAD["negative v"])])
        assert (metrics["clients"], metrics["rejected"]) == (2, 1)
        assert len(alive) == 2 and [ref() for ref in alive] == [None, None]
    finally:
        gc.enable()


def test_a_run_decodes_the_replies_while_they_arrive_and_times_what_is_left(monkeypatch):
    """In the round loop every training reply is decoded within the exchange (as its pull brings
    it), and the round's row carries ``server_seconds``: from the last reply to the new state;
    round 0's row, the initial evaluation's ``seconds``."""
    import fedact_app.replies as replies_module
    import fedact_app.strategy as strategy_module

    strategy = fedact_strategy()
    replies = [reply(1, good_content()), reply(2, good_content(scale=2.0))]
    exchanging, decoded_outside = [False], []
    decode = replies_module.decode_updates

    def counted_decode(contents, *args, **kwargs):
        decoded_outside.extend(c for c in contents if not exchanging[0])
        return decode(contents, *args, **kwargs)

    def exchange(grid, messages, timeout, on_pull=None, while_waiting=None, on_push=None):
        if while_waiting is not None:
            while_waiting()
        if not messages:  # the evaluation round (fraction_evaluate=0)
            return []
        exchanging[0] = True
        for pulled in replies:
            on_pull([pulled])
        exchanging[0] = False
        return replies

    def configure_train(*args):
        strategy.messages_sent = 2
        return ["to node 1", "to node 2"]

    monkeypatch.setattr(replies_module, "decode_updates", counted_decode)
    monkeypatch.setattr(strategy_module, "exchange", exchange)
    monkeypatch.setattr(strategy, "configure_train", configure_train)
    rows = []
    strategy.run(None, num_rounds=2, timeout=1.0, evaluate_fn=lambda r, state: None, on_round_end=rows.append,
                 initial_state=dict(STATE))
    assert [(r["round"], r.get("clients")) for r in rows] == [(0, None), (1, 2), (2, 2)]
    assert decoded_outside == [] and all(0 <= r["server_seconds"] < r["seconds"] for r in rows[1:])
    assert rows[0]["seconds"] >= 0 and "server_seconds" not in rows[0]  # round 0: the initial evaluation


def test_server_seconds_leave_out_the_wait_for_a_reply_that_never_came(monkeypatch):
    """A round whose third client never replies waits until its timeout (here 0.5 s of the
    exchange); ``server_seconds`` counts the ServerApp's work from then on, not that wait."""
    import fedact_app.strategy as strategy_module

    strategy = fedact_strategy()
    replies = [reply(1, good_content()), reply(2, good_content(scale=2.0))]

    def exchange(grid, messages, timeout, on_pull=None, while_waiting=None, on_push=None):  # as strategy.collect pulls
        if while_waiting is not None:
            while_waiting()
        if not messages:
            return []
        on_pull(replies)
        time.sleep(0.5)  # the wait for the third reply, until the timeout
        on_pull([])  # the last pull, at the timeout: nothing
        return replies

    def configure_train(*args):
        strategy.messages_sent = 3
        return ["to node 1", "to node 2", "to node 3"]

    monkeypatch.setattr(strategy_module, "exchange", exchange)
    monkeypatch.setattr(strategy, "configure_train", configure_train)
    rows = []
    strategy.run(None, num_rounds=1, timeout=0.5, evaluate_fn=lambda r, state: None, on_round_end=rows.append,
                 initial_state=dict(STATE))
    assert rows[1]["missing"] == 1 and rows[1]["seconds"] >= 0.5 and rows[1]["server_seconds"] < 0.4


def test_a_rounds_row_cuts_the_path_of_its_last_reply(monkeypatch):
    """The round's timeline columns (fedact_app.timeline) from the push's times, each reply's
    ``work-start``, ``train-seconds`` and ``created_at``, and the pull that brought it: the reply
    pulled last is the path's, the starts span every timed reply, and a reply without
    ``work-start`` (an older client) or with a NaN ``created_at`` is left out of them."""
    import fedact_app.strategy as strategy_module

    strategy = fedact_strategy()
    now = time.time()
    push = (now - 3.0, now - 2.5)

    def timed(node, work_start, train_seconds, made, scale=1.0):
        content = good_content(scale)
        metrics = dict(content["metrics"], **{"train-seconds": train_seconds})
        if work_start is not None:
            metrics["work-start"] = work_start
        content["metrics"] = MetricRecord(metrics)
        return reply(node, content, created_at=made)

    # node 1 starts first, node 4 last, node 2 between them is pulled last of the timed replies
    first, last = timed(1, now - 2.375, 0.25, now - 1.0), timed(2, now - 2.25, 0.75, now - 0.5, scale=2.0)
    late_start = timed(4, now - 1.5, 0.125, now - 1.25, scale=1.25)
    untimed = timed(3, None, 0.5, now - 0.25, scale=1.5)
    unclocked = timed(5, now - 2.0, 0.5, math.nan, scale=1.75)  # Flower lets a NaN created_at through
    pulled = {}

    def exchange(grid, messages, timeout, on_pull=None, while_waiting=None, on_push=None):
        if while_waiting is not None:
            while_waiting()
        if not messages:
            return []
        on_push(*push)
        # the untimed and the unclocked replies come last: no path of their own
        for pull in ([first, late_start], [last], [untimed], [unclocked]):
            on_pull(pull)
            pulled[pull[0].metadata.src_node_id] = time.time()
        return [first, late_start, last, untimed, unclocked]

    def configure_train(*args):
        strategy.messages_sent = 5
        return [f"to node {node}" for node in range(1, 6)]

    monkeypatch.setattr(strategy_module, "exchange", exchange)
    monkeypatch.setattr(strategy, "configure_train", configure_train)
    rows = []
    strategy.run(None, num_rounds=1, timeout=1.0, evaluate_fn=lambda r, state: None, on_round_end=rows.append,
                 initial_state=dict(STATE))
    row = rows[1]
    assert row["clients"] == 5  # the timeline leaves replies out, the round does not
    exact = {"push_seconds": 0.5, "start_seconds_min": 0.125, "start_seconds_max": 1.0,
             "last_reply_start_seconds": 0.25, "last_reply_work_seconds": 1.75, "last_reply_train_seconds": 0.75}
    assert {key: row[key] for key in exact} == pytest.approx(exact, abs=1e-6)
    # pulled no earlier than its pull began and no later than on_pull returned
    assert 0.5 <= row["last_reply_return_seconds"] <= pulled[2] - (now - 0.5) + 1e-6


def test_arrivals_keep_when_each_reply_was_pulled():
    """``Arrivals.feed`` stamps every reply of a pull, error replies included, with one Unix time
    taken within the call, by the id of the message it answers."""
    strategy = fedact_strategy()
    arrivals = strategy.round_arrivals(1)
    before = time.time()
    arrivals.feed([reply(1, good_content()), reply(2, error=Error(code=0, reason="failed"))])
    after = time.time()
    assert set(arrivals.arrived) == {"q1", "q2"} and len(set(arrivals.arrived.values())) == 1  # the pushed ids
    assert before <= arrivals.arrived["q1"] <= after


def turning_content(server_round):
    """A good reply whose delta's direction turns with the round (good_content's does not)."""
    content = good_content()
    content["delta"] = packed_record({"w": torch.tensor([[0.25, 0.1 * server_round, 0.0],
                                                         [0.0, 0.25, -0.05 * server_round]]),
                                      "b": torch.tensor([0.5, -0.5]), "bn.n": torch.tensor(1)})
    return content


def logged_run(monkeypatch, num_rounds=3, overlap_evaluation=lambda server_round: True, fail_round=None,
               failure=RuntimeError, evaluation_seconds=0.0, log=None):
    """``strategy.run`` over ``num_rounds`` rounds of two good replies (one scaled by the round,
    one turning with it, so that every round's state and direction consistency differ), with
    the Grid exchange standing in as the clients would
    answer: the replies come after ``while_waiting``. Fills and returns ``log`` (a fresh
    namespace if None): the events in order ("push r", "pull r", "eval r", "row r", "after r"),
    the states each evaluation got, the rows and the times of the pushes. Round
    ``fail_round``'s sampling raises ``failure``."""
    import fedact_app.strategy as strategy_module

    strategy = fedact_strategy()
    log = log if log is not None else SimpleNamespace()
    log.events, log.evaluated, log.rows, log.pushes = [], {}, [], []
    current = [0]

    def exchange(grid, messages, timeout, on_pull=None, while_waiting=None, on_push=None):
        if not messages:  # the evaluation round (fraction_evaluate=0)
            return []
        log.events.append(f"push {current[0]}")
        log.pushes.append(time.perf_counter())
        while_waiting()
        log.events.append(f"pull {current[0]}")
        replies = [reply(1, good_content(scale=float(current[0]))), reply(2, turning_content(current[0]))]
        on_pull(replies)
        return replies

    def configure_train(server_round, *args):
        if server_round == fail_round:
            raise failure(f"no node for round {server_round}")
        current[0] = server_round
        strategy.messages_sent = 2
        return ["to node 1", "to node 2"]

    def evaluate(server_round, state):
        log.events.append(f"eval {server_round}")
        log.evaluated[server_round] = {name: t.clone() for name, t in state.items()}
        time.sleep(evaluation_seconds)
        return {"accuracy": float(server_round)}

    def on_round_end(row):
        log.events.append(f"row {row['round']}")
        log.rows.append(row)

    monkeypatch.setattr(strategy_module, "exchange", exchange)
    monkeypatch.setattr(strategy, "configure_train", configure_train)
    strategy.run(None, num_rounds=num_rounds, timeout=1.0, evaluate_fn=evaluate, on_round_end=on_round_end,
                 initial_state=dict(STATE), after_round=lambda r: log.events.append(f"after {r}"),
                 overlap_evaluation=overlap_evaluation)
    return log


def test_a_round_s_evaluation_and_row_run_while_the_next_round_s_clients_train(monkeypatch):
    """Round r's evaluation, row and after_round run between round r + 1's push and its first
    pull (round 0's within round 1); the last round's after its own replies."""
    assert logged_run(monkeypatch).events == [
        "push 1", "eval 0", "row 0", "pull 1",
        "push 2", "eval 1", "row 1", "after 1", "pull 2",
        "push 3", "eval 2", "row 2", "after 2", "pull 3",
        "eval 3", "row 3", "after 3"]


def test_a_round_that_must_not_overlap_the_next_ends_before_the_next_round_s_push(monkeypatch):
    """Where ``overlap_evaluation(r)`` is False (a checkpoint, which reads the clients' kept
    state), round r's evaluation, row and after_round come before round r + 1's messages."""
    events = logged_run(monkeypatch, overlap_evaluation=lambda server_round: server_round != 2).events
    assert events[events.index("pull 2"):] == ["pull 2", "eval 2", "row 2", "after 2",
                                               "push 3", "pull 3", "eval 3", "row 3", "after 3"]


def test_overlapped_evaluations_see_each_round_s_own_state_and_give_the_same_rows(monkeypatch):
    """The overlapped schedule evaluates the same states (one per round, all different) and
    records the same rows as the one that evaluates each round before the next begins."""
    overlapped = logged_run(monkeypatch)
    alone = logged_run(monkeypatch, overlap_evaluation=lambda server_round: False)
    assert sorted(overlapped.evaluated) == sorted(alone.evaluated) == [0, 1, 2, 3]
    for server_round, state in overlapped.evaluated.items():
        for name, tensor in state.items():
            assert torch.equal(tensor, alone.evaluated[server_round][name]), (server_round, name)
    assert torch.equal(overlapped.evaluated[0]["w"], STATE["w"])
    assert not torch.equal(overlapped.evaluated[1]["w"], overlapped.evaluated[2]["w"])  # every round's state differs
    timed = ("seconds", "server_seconds", "eval_seconds")
    assert ([{k: v for k, v in row.items() if k not in timed} for row in overlapped.rows]
            == [{k: v for k, v in row.items() if k not in timed} for row in alone.rows])
    assert [row["accuracy"] for row in overlapped.rows] == [0.0, 1.0, 2.0, 3.0]


def test_each_round_s_diagnostics_are_of_its_own_replies_though_the_next_round_reuses_their_vectors(monkeypatch):
    """DC is made while the next round's clients train, from vectors that the next round's
    replies are decoded into: each row's DC is still that of its own round's two replies (a
    plain loop over the formula: the mean of cos(Delta_i, mean Delta))."""
    rows = logged_run(monkeypatch).rows[1:]

    def flat(content):
        arrays = unpacked(content["delta"])
        return [float(v) for name in TRAINABLE for v in arrays[name].flatten()]

    for row in rows:
        deltas = [flat(good_content(scale=float(row["round"]))), flat(turning_content(row["round"]))]
        mean = [(a + b) / 2 for a, b in zip(*deltas)]
        cosines = [sum(a * m for a, m in zip(delta, mean))
                   / math.sqrt(sum(a * a for a in delta) * sum(m * m for m in mean)) for delta in deltas]
        assert row["direction_consistency"] == pytest.approx(sum(cosines) / 2, rel=1e-12, abs=0), row["round"]
        # FedACT's Delta_G = -mean_i Delta_i / lr_sum (equal examples and lr sums)
        assert row["delta_g_norm"] == pytest.approx(math.sqrt(sum(m * m for m in mean)) / LR_SUM, rel=1e-6)
    assert len({row["direction_consistency"] for row in rows}) == len(rows)  # every round's differs


def test_a_server_on_a_device_makes_the_diagnostics_at_once_and_keeps_no_update_for_them(monkeypatch):
    """On a GPU server (``server_device``) the decoded replies are device memory of their own:
    the diagnostics are made within the round, and the call handed to the run holds their
    values only, not the round's updates, so those go as the round ends."""
    import fedact_app.strategy as strategy_module

    replies = [reply(1, good_content()), reply(2, turning_content(1))]
    made = []
    consistency = strategy_module.vectors_direction_consistency
    monkeypatch.setattr(strategy_module, "vectors_direction_consistency",
                        lambda vectors: made.append(len(vectors)) or consistency(vectors))
    on_cpu = fedact_strategy()
    on_cpu.messages_sent = 2
    _, _, later = on_cpu.aggregate_round(1, replies)
    assert made == []  # on the CPU: left to the call
    on_device = fedact_strategy()
    on_device.messages_sent = 2
    on_device.device = torch.device("cuda")  # all that aggregate_round reads of it; the tensors stay on the CPU
    _, _, at_once = on_device.aggregate_round(1, replies)
    assert made == [2]
    assert all(isinstance(cell.cell_contents, dict) for cell in at_once.__closure__)
    assert at_once() == later() and set(later()) == {"direction_consistency", "delta_g_norm"}


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_failing_round_still_records_the_round_before_it(monkeypatch, failure):
    """Round 3's sampling fails while round 2's evaluation waits for round 3's push: round 2's
    evaluation, row and after_round still run, before the error reaches the caller. Also for an
    exception that is not an ``Exception`` (Ctrl-C; Flower ends a stopped run with one)."""
    log = SimpleNamespace()
    with pytest.raises(failure, match="no node for round 3"):
        logged_run(monkeypatch, fail_round=3, failure=failure, log=log)
    assert log.events[-4:] == ["pull 2", "eval 2", "row 2", "after 2"]
    assert [row["round"] for row in log.rows] == [0, 1, 2]


def test_the_round_that_stops_a_run_without_replies_is_evaluated_before_the_error(monkeypatch):
    """A round that reaches ``max_empty_rounds`` ends the run: its evaluation, row and
    after_round run at once, its ``seconds`` holding that evaluation, and then the error."""
    import fedact_app.strategy as strategy_module

    strategy = fedact_strategy()
    strategy.max_empty_rounds = 2
    events, rows = [], []

    def exchange(grid, messages, timeout, on_pull=None, while_waiting=None, on_push=None):
        if while_waiting is not None:
            while_waiting()
        return []

    def evaluate(server_round, state):
        events.append(f"eval {server_round}")
        time.sleep(0.05 if server_round == 2 else 0.0)  # only the last round's evaluation takes time
        return {"accuracy": 0.0}

    monkeypatch.setattr(strategy_module, "exchange", exchange)
    monkeypatch.setattr(strategy, "configure_train", lambda *args: [])
    with pytest.raises(RuntimeError, match="No usable client reply in 2 consecutive rounds"):
        strategy.run(None, num_rounds=5, timeout=1.0, evaluate_fn=evaluate,
                     on_round_end=lambda row: (events.append(f"row {row['round']}"), rows.append(row)),
                     initial_state=dict(STATE), after_round=lambda r: events.append(f"after {r}"))
    assert events == ["eval 0", "row 0", "eval 1", "row 1", "after 1", "eval 2", "row 2", "after 2"]
    assert rows[-1]["seconds"] >= rows[-1]["eval_seconds"] >= 0.05


def test_the_rounds_seconds_run_from_start_to_start_and_round_0_s_are_its_evaluation_s(monkeypatch):
    """A round's ``seconds`` run from its start to the next round's (its own evaluation runs in
    the next; the stand-in's sampling takes no time, so from push to push), so that they add up
    to the run's time from round 1 on; round 0's and ``eval_seconds`` are the evaluation's own
    time."""
    started = time.perf_counter()
    log = logged_run(monkeypatch, evaluation_seconds=0.05)
    ended = time.perf_counter()
    rows = log.rows
    for row, push, next_push in zip(rows[1:], log.pushes, log.pushes[1:]):
        assert abs(row["seconds"] - (next_push - push)) < 0.1, row
    assert abs(sum(row["seconds"] for row in rows[1:]) - (ended - log.pushes[0])) < 0.1
    assert ended - started >= 4 * 0.05 and all(row["eval_seconds"] >= 0.05 for row in rows[1:])
    assert 0.05 <= rows[0]["seconds"] < rows[1]["seconds"]  # round 1 holds round 0's evaluation


def with_partition(partition_id):
    content = good_content()
    content["metrics"] = MetricRecord({**dict(content["metrics"]), "partition-id": partition_id})
    return content


def test_two_nodes_training_one_partition_are_warned_of(caplog):
    """Two SuperNodes started with the same partition-id train the same data: the round says so,
    naming the nodes and the partition; distinct ids and replies without one (own data-path) do not."""
    strategy = fedact_strategy()
    strategy.messages_sent = 4
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.aggregate_train(3, [reply(12, with_partition(1)), reply(11, with_partition(1)),
                                     reply(13, with_partition(0)), reply(14, good_content())])
    assert "round 3: nodes 11, 12 all train partition-id=1" in caplog.text
    assert "partition-id=0" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flwr"):
        strategy.aggregate_train(4, [reply(15, good_content()), reply(16, good_content()),
                                     reply(17, with_partition(0)), reply(18, with_partition(2))])
    assert "all train partition-id" not in caplog.text


def _rounds_without_replies(monkeypatch, strategy, **start_kwargs) -> list[dict]:
    """Run ``strategy.run`` where no client ever replies (the Grid exchange stands in: nothing
    comes back), returning the rows it recorded."""
    import fedact_app.strategy as strategy_module

    def exchange(grid, messages, timeout, on_pull=None, while_waiting=None, on_push=None):
        if while_waiting is not None:
            while_waiting()
        return []

    monkeypatch.setattr(strategy_module, "exchange", exchange)
    monkeypatch.setattr(strategy, "configure_train", lambda *args: [])
    rows = []
    strategy.run(None, timeout=1.0, evaluate_fn=lambda r, state: None, on_round_end=rows.append,
                 initial_state=dict(STATE), **start_kwargs)
    return rows


def test_a_run_without_any_usable_round_fails_also_below_max_empty_rounds(monkeypatch):
    """2 rounds, max_empty_rounds 3, no reply in either: not a completed run."""
    with pytest.raises(RuntimeError, match=r"No usable client reply in any round \(1..2\)"):
        _rounds_without_replies(monkeypatch, fedact_strategy(), num_rounds=2)


def test_a_resumed_run_whose_last_rounds_are_empty_completes_like_a_straight_one(monkeypatch):
    """Resumed after round 8 of 10 (rounds 1..8 updated the model, empty_rounds restored as 0):
    two empty rounds end the run as they would a straight run, not as 'never updated'."""
    strategy = fedact_strategy()
    strategy.empty_rounds = 0
    rows = _rounds_without_replies(monkeypatch, strategy, num_rounds=10, first_round=9)
    assert [r["round"] for r in rows] == [9, 10] and strategy.empty_rounds == 2
