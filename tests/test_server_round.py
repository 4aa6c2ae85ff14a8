"""The ServerApp's round over whole vectors (fedact_app.packing, fedact_app.replies.read_arrays,
the vector paths of fedact_app.aggregation and fedact_app.diagnostics) and on ``server_device``:
every value against a computation written here, over Python lists."""

import math
import time

import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.app import Metadata, MessageType

from fedact_app.aggregation import Aggregation
from fedact_app.algorithms import ALGORITHMS
from fedact_app.config import ConfigError, compose
from fedact_app.diagnostics import vector_norms, vectors_direction_consistency
from fedact_app.packing import as_vector, consecutive, views
from fedact_app.replies import ReplyError, decode_update
from fedact_app.strategy import AlgorithmStrategy
from fedact_app.train import resolve_device
from fedact_app.wire import packed_record, unpacked

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                  reason="no CUDA device"))]
# state order: a float buffer between the parameters, an integer buffer last
STATE = {"w": torch.zeros(2, 3), "bn.mean": torch.zeros(2), "b": torch.zeros(2), "bn.n": torch.tensor(0)}
TRAINABLE = ["w", "b"]
LR_SUM = 0.5


def flat_list(tensors, names):
    return [float(x) for name in names for x in tensors[name].reshape(-1).tolist()]


# ---------------------------------------------------------------- packing


def test_views_cut_one_vector_and_as_vector_views_them_back():
    tensors = {"a": torch.tensor([[1.0, 2.0], [3.0, 4.0]]), "b": torch.tensor([5.0]), "c": torch.tensor([6.0, 7.0])}
    order = ["c", "a", "b"]
    packed = views(torch.cat([tensors[n].reshape(-1) for n in order]), order, [tensors[n].shape for n in order])
    assert list(packed) == ["c", "a", "b"] and packed["a"].shape == (2, 2)
    assert consecutive(packed, ["c", "a", "b"]) == 3 and consecutive(packed, ["a", "b"]) == 2
    assert consecutive(packed, ["a", "c"]) == 1  # c lies before a
    vector = as_vector(packed, ["c", "a", "b"])
    assert vector.tolist() == [6.0, 7.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert vector.data_ptr() == packed["c"].data_ptr()  # a view, no copy
    vector[2] = -1.0
    assert packed["a"][0, 0] == -1.0
    apart = as_vector(tensors, ["a", "b"])  # separate tensors: a copy
    assert apart.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] and apart.data_ptr() != tensors["a"].data_ptr()


def reply_content(delta, v, lr_sum=LR_SUM, examples=10):
    return RecordDict({"delta": packed_record(delta), "v": packed_record(v),
                       "metrics": MetricRecord({"num-examples": examples, "num-steps": 5, "lr-sum": lr_sum,
                                                "train-loss": 1.0})})


def client_arrays(seed):
    gen = torch.Generator().manual_seed(seed)
    delta = {"w": torch.randn(2, 3, generator=gen), "bn.mean": torch.randn(2, generator=gen),
             "b": torch.randn(2, generator=gen), "bn.n": torch.tensor(seed % 3)}
    v = {"w": torch.rand(2, 3, generator=gen) * 0.1 + 0.01, "b": torch.rand(2, generator=gen) * 0.1 + 0.01}
    return delta, v


def test_a_decoded_reply_is_one_vector_per_key_with_the_trainable_entries_first():
    delta, v = client_arrays(1)
    update = decode_update(reply_content(delta, v), STATE, ("v",), TRAINABLE, ("v",))
    assert list(update.delta) == ["w", "b", "bn.mean", "bn.n"]  # the vector's order: trainable first
    assert consecutive(update.delta, list(update.delta)) == 3
    assert as_vector(update.delta, TRAINABLE).tolist() == pytest.approx(flat_list(delta, TRAINABLE))
    assert as_vector(update.delta, ["w", "b", "bn.mean"]).data_ptr() == update.delta["w"].data_ptr()
    assert update.delta["bn.n"].dtype == torch.int64 and int(update.delta["bn.n"]) == 1
    assert consecutive(update.arrays["v"], TRAINABLE) == 2
    for name in STATE:
        assert update.delta[name].tolist() == delta[name].tolist()
    # the norms over the trainable entries, measured in the same pass as the finiteness check
    assert update.norms["delta"] == pytest.approx(math.sqrt(sum(x * x for x in flat_list(delta, TRAINABLE))),
                                                  rel=1e-12)
    assert update.norms["v"] == pytest.approx(math.sqrt(sum(x * x for x in flat_list(v, TRAINABLE))), rel=1e-12)


def test_unreadable_array_bytes_are_a_rejected_reply_not_a_crash():
    delta, v = client_arrays(2)
    content = reply_content(delta, v)
    content["v"]["float32"] = Array(dtype="float32", shape=(8,), stype="numpy.ndarray", data=b"\x93NUMPY garbage")
    with pytest.raises(ReplyError, match=r"'v': not a readable packed record .*no \.npy array"):
        decode_update(content, STATE, ("v",), TRAINABLE, ("v",))
    content = reply_content(delta, v)
    whole = content["v"]["float32"].data
    content["v"]["float32"] = Array(dtype="float32", shape=(8,), stype="numpy.ndarray", data=whole[:len(whole) - 4])
    with pytest.raises(ReplyError, match="no .npy array"):
        decode_update(content, STATE, ("v",), TRAINABLE, ("v",))
    content = reply_content(delta, v)  # an Array whose shape is not the one its .npy header says
    content["v"]["float32"] = Array(dtype="float32", shape=(2, 4), stype="numpy.ndarray", data=whole)
    with pytest.raises(ReplyError, match=r"does not say 'shape': \(2, 4\)"):
        decode_update(content, STATE, ("v",), TRAINABLE, ("v",))
    content = reply_content(delta, v)  # bn.n's int64 in the other byte order (torch.from_numpy refuses it)
    content["delta"]["int64"] = Array(delta["bn.n"].reshape(1).numpy().astype(">i8"))
    with pytest.raises(ReplyError, match=r"'delta': not a readable packed record .*'int64' is \(1,\) >i8"):
        decode_update(content, STATE, ("v",), TRAINABLE, ("v",))
    content = reply_content(delta, v)  # each entry's own arrays, as Flower's ArrayRecord(dict) sends them
    content["v"] = ArrayRecord(v)
    with pytest.raises(ReplyError, match=r"'v': not a readable packed record \(no 'layout' entry"):
        decode_update(content, STATE, ("v",), TRAINABLE, ("v",))


def test_a_reply_packed_in_another_order_reads_as_the_same_update():
    delta, v = client_arrays(4)
    ours = decode_update(reply_content(delta, v), STATE, ("v",), TRAINABLE, ("v",))
    shuffled = {name: delta[name] for name in ["bn.n", "b", "bn.mean", "w"]}
    theirs = decode_update(reply_content(shuffled, dict(reversed(v.items()))), STATE, ("v",), TRAINABLE, ("v",))
    assert list(theirs.delta) == list(ours.delta) and list(theirs.arrays["v"]) == list(ours.arrays["v"])
    for name in STATE:
        assert torch.equal(theirs.delta[name], delta[name])
    assert consecutive(theirs.delta, ["w", "b", "bn.mean"]) == 3  # still one vector, trainable first
    assert theirs.norms == ours.norms


@pytest.mark.parametrize("position", [0, 5, 7])
def test_a_non_finite_or_negative_value_anywhere_in_the_vector_names_its_entry(position):
    names = ["w"] * 6 + ["b"] * 2  # the packed order of v: w (6 entries), then b
    delta, v = client_arrays(3)
    flat_v = flat_list(v, TRAINABLE)
    flat_v[position] = -1e-9
    bad_v = {"w": torch.tensor(flat_v[:6]).reshape(2, 3), "b": torch.tensor(flat_v[6:])}
    with pytest.raises(ReplyError, match=rf"'v' has negative values \(in \['{names[position]}'\]\)"):
        decode_update(reply_content(delta, bad_v), STATE, ("v",), TRAINABLE, ("v",))
    flat_v[position] = float("nan")
    bad_v = {"w": torch.tensor(flat_v[:6]).reshape(2, 3), "b": torch.tensor(flat_v[6:])}
    with pytest.raises(ReplyError, match=rf"'v'\['{names[position]}'\] has non-finite values"):
        decode_update(reply_content(delta, bad_v), STATE, ("v",), TRAINABLE, ("v",))


# ---------------------------------------------------------------- the rules over whole vectors


def loop_median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def loop_trimmed(values, k):
    values = sorted(values)[k:len(values) - k]
    return sum(values) / len(values)


@pytest.mark.parametrize("rule", ["mean", "trimmed_mean", "median"])
def test_the_rules_over_decoded_replies_match_plain_loops_per_coordinate(rule):
    count = 5
    sent = [client_arrays(10 + i) for i in range(count)]
    updates = [decode_update(reply_content(d, v), STATE, ("v",), TRAINABLE, ("v",)) for d, v in sent]
    weights = [1.0 / count] * count
    combined = Aggregation(rule, 0.2).combine_dicts([u.delta for u in updates], weights,
                                                    [-LR_SUM] * count, TRAINABLE)
    assert consecutive(combined, TRAINABLE) == 2  # the result is one vector too
    whole = Aggregation(rule, 0.2).combine_dicts([u.delta for u in updates], weights)
    assert consecutive(whole, list(whole)) == 3  # every float entry, buffer included, in one operation
    columns = list(zip(*[[x / -LR_SUM for x in flat_list(d, TRAINABLE)] for d, _ in sent]))
    if rule == "mean":
        expected = [sum(c) / count for c in columns]
    elif rule == "median":
        expected = [loop_median(c) for c in columns]
    else:
        expected = [loop_trimmed(c, 1) for c in columns]  # ceil(0.2 x 5) = 1 at each end
    assert flat_list(combined, TRAINABLE) == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_vector_norms_and_dc_over_vectors_match_the_formulas():
    gen = torch.Generator().manual_seed(4)
    vectors = [torch.randn(1000, generator=gen) + 0.3 for _ in range(4)] + [torch.zeros(1000)]
    rows = [v.double().tolist() for v in vectors]
    norms = [math.sqrt(sum(x * x for x in row)) for row in rows]
    assert vector_norms(vectors) == pytest.approx(norms, rel=1e-12)
    mean = [sum(col) / len(rows) for col in zip(*rows)]
    mean_norm = math.sqrt(sum(x * x for x in mean))
    cosines = [sum(a * b for a, b in zip(row, mean)) / (n * mean_norm) if n > 0 else 0.0
               for row, n in zip(rows, norms)]
    assert vectors_direction_consistency(vectors) == pytest.approx(sum(cosines) / len(rows), rel=1e-12)


# ---------------------------------------------------------------- a round on server_device


def message(node, content):
    metadata = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0,
                        reply_to_message_id=f"q{node}", group_id="1", created_at=time.time(), ttl=60.0,
                        message_type=MessageType.TRAIN)
    return Message(metadata=metadata, content=content)


def run_round(device, sent, rule="mean"):
    cfg = compose(["algorithm=fedact", f"aggregation={rule}", "fraction_train=1.0"]).algorithm
    strategy = AlgorithmStrategy(ALGORITHMS["fedact"].server(cfg, TRAINABLE, aggregation=Aggregation(rule)),
                                 trainable=TRAINABLE, local_steps=5, lr_schedule=lambda r: 0.1,
                                 fraction_train=1.0, min_train_nodes=1, device=device)
    strategy.load_state_dict({"model": STATE, "rule": {}, "empty_rounds": 0})
    strategy.messages_sent = len(sent)
    replies = [message(i + 1, reply_content(d, v)) for i, (d, v) in enumerate(sent)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    return strategy, arrays, metrics


@pytest.mark.parametrize("device", DEVICES)
def test_a_round_on_the_server_device_gives_the_formulas_and_the_cpu_values(device):
    """x^1 = x^0 + mean(Delta_i) (server_lr 1), Delta_G = -mean(Delta_i / (K eta)), v_bar =
    mean(v_i), DC and ||Delta_G|| from Python lists; the state stays on ``device``, what leaves it
    (the record, the checkpoint state) is on the CPU, and the device's values are the CPU's to
    float32 rounding (rtol 1e-6)."""
    count = 4
    sent = [client_arrays(20 + i) for i in range(count)]
    strategy, arrays, metrics = run_round(device, sent)
    assert metrics["clients"] == count
    assert all(t.device.type == device for t in strategy.state.values())
    assert all(t.device.type == device for t in strategy.rule.v_bar.values())
    deltas = [flat_list(d, ["w", "bn.mean", "b"]) for d, _ in sent]
    x = [sum(col) / count for col in zip(*deltas)]  # x^0 = 0
    assert flat_list(unpacked(arrays), ["w", "bn.mean", "b"]) == pytest.approx(x, rel=1e-6, abs=1e-7)
    trainable = [flat_list(d, TRAINABLE) for d, _ in sent]
    delta_g = [-sum(col) / count / LR_SUM for col in zip(*trainable)]
    v_bar = [sum(col) / count for col in zip(*[flat_list(v, TRAINABLE) for _, v in sent])]
    state = strategy.state_dict()
    assert flat_list(state["rule"]["delta_g"], TRAINABLE) == pytest.approx(delta_g, rel=1e-6, abs=1e-7)
    assert flat_list(state["rule"]["v_bar"], TRAINABLE) == pytest.approx(v_bar, rel=1e-6)
    assert metrics["delta_g_norm"] == pytest.approx(math.sqrt(sum(g * g for g in delta_g)), rel=1e-6)
    mean = [sum(col) / count for col in zip(*trainable)]
    norm = math.sqrt(sum(m * m for m in mean))
    dc = sum(sum(a * b for a, b in zip(row, mean)) / (math.sqrt(sum(a * a for a in row)) * norm)
             for row in trainable) / count
    assert metrics["direction_consistency"] == pytest.approx(dc, rel=1e-6)
    for tensors in (state["model"], *state["rule"].values()):  # CPU tensors, each with storage of its own
        assert all(t.device.type == "cpu" for t in tensors.values())
        assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == len(tensors)
    if device == "cpu":
        return
    _, cpu_arrays, cpu_metrics = run_round("cpu", sent)
    torch.testing.assert_close(unpacked(arrays), unpacked(cpu_arrays), rtol=1e-6, atol=1e-7)
    for key in ("direction_consistency", "delta_g_norm", "update_norm_ratio"):
        assert metrics[key] == pytest.approx(cpu_metrics[key], rel=1e-6)


def test_server_device_is_checked_and_cuda_without_one_fails_naming_the_key():
    assert compose([]).server_device == "auto"
    with pytest.raises(ConfigError, match="server_device.*'gpu'"):
        compose(["server_device=gpu"])
    assert resolve_device(compose(["server_device=cpu"]).server_device, "server_device") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="server_device=cuda but no CUDA device"):
            resolve_device("cuda", "server_device")


def test_the_next_rounds_replies_reuse_the_vectors_without_touching_what_the_last_round_made():
    """The strategy decodes each round's replies into the vectors of the last round's
    (fedact_app.packing.VectorPool); the median of a single reply is that reply, so v_bar and x
    must still be vectors of their own when the next round overwrites the reply's."""
    first, second = client_arrays(30), client_arrays(31)
    strategy, _, _ = run_round("cpu", [first], rule="median")
    v_bar, x = strategy.rule.v_bar, strategy.state
    assert flat_list(v_bar, TRAINABLE) == pytest.approx(flat_list(first[1], TRAINABLE))
    taken = [v.data_ptr() for v in strategy.vectors._taken]
    strategy.messages_sent = 1
    strategy.aggregate_train(2, [message(1, reply_content(*second))])
    assert sorted(v.data_ptr() for v in strategy.vectors._taken) == sorted(taken)  # the same vectors again
    assert flat_list(v_bar, TRAINABLE) == pytest.approx(flat_list(first[1], TRAINABLE))
    assert flat_list(x, ["w", "bn.mean", "b"]) == pytest.approx(flat_list(first[0], ["w", "bn.mean", "b"]))
    assert flat_list(strategy.rule.v_bar, TRAINABLE) == pytest.approx(flat_list(second[1], TRAINABLE))


@pytest.mark.any_device
def test_server_device_auto_follows_a_cpu_run_and_takes_a_visible_gpu_otherwise(monkeypatch):
    from fedact_app.server_app import server_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as resolve_device sees it
    assert server_device(compose("device=cpu")).type == "cpu"
    assert server_device(compose("device=auto")).type == "cuda"
    assert server_device(compose("device=cpu server_device=cuda")).type == "cuda"
    assert server_device(compose("device=auto server_device=cpu")).type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert server_device(compose("device=auto")).type == "cpu"
