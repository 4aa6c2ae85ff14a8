"""A reply's records decoded and checked, on real Flower record types (fedact_app.replies)."""

import io
import json
import math
import random
import threading
import tokenize
from collections import Counter

import numpy as np
import pytest
import torch
from flwr.app import Array, MetricRecord, RecordDict

import fedact_app.optim.topk as topk
from fedact_app.packing import VectorPool
from fedact_app.replies import ReplyError, decode_update, decode_updates, record_bytes
from fedact_app.wire import packed_record, to_wire

STATE = {"w": torch.zeros(2, 3), "bn.running_mean": torch.zeros(3), "bn.n": torch.tensor(0)}
TRAINABLE = ["w"]


def reply(delta=None, v=None, metrics=None, drop=()):
    content = RecordDict({
        "delta": packed_record(delta if delta is not None else {k: torch.ones_like(t) for k, t in STATE.items()}),
        "v": packed_record(v if v is not None else {"w": torch.full((2, 3), 0.5)}),
        "metrics": MetricRecord(metrics or {"num-examples": 64, "num-steps": 2, "lr-sum": 0.002,
                                            "train-loss": 1.5}),
    })
    for key in drop:
        del content[key]
    return content


def test_valid_reply_decodes():
    update = decode_update(reply(), STATE, ("v",), TRAINABLE)
    assert update.num_steps == 2 and update.num_examples == 64 and update.lr_sum == pytest.approx(0.002)
    torch.testing.assert_close(update.delta["w"], torch.ones(2, 3))
    torch.testing.assert_close(update.arrays["v"]["w"], torch.full((2, 3), 0.5))
    raw = 4 * (6 + 3) + 8 + 4 * 6  # float32 delta w, running_mean; int64 n; float32 v
    assert raw <= record_bytes(reply()) < raw + 1024  # serialized size: arrays plus headers


@pytest.mark.parametrize("content, needle", [
    (reply(drop=("v",)), "missing record 'v'"),
    (reply(drop=("delta",)), "missing record 'delta'"),
    (reply(delta={"w": torch.ones(2, 3)}), "wrong entries"),
    (reply(delta={"w": torch.ones(3, 2), "bn.running_mean": torch.ones(3), "bn.n": torch.tensor(1)}), "(3, 2)"),
    (reply(delta={"w": torch.ones(2, 3, dtype=torch.float64), "bn.running_mean": torch.ones(3),
                  "bn.n": torch.tensor(1)}), "float64"),
    (reply(delta={"w": torch.full((2, 3), float("nan")), "bn.running_mean": torch.ones(3),
                  "bn.n": torch.tensor(1)}), "non-finite"),
    (reply(v={"w": torch.full((2, 3), float("inf"))}), "non-finite"),
    (reply(metrics={"num-examples": 64, "num-steps": 0, "lr-sum": 0.1}), "num-steps"),
    (reply(metrics={"num-examples": 64, "num-steps": 2}), "lr-sum"),
])
def test_bad_replies_are_rejected_with_the_reason(content, needle):
    with pytest.raises(ReplyError) as err:
        decode_update(content, STATE, ("v",), TRAINABLE)
    assert needle in str(err.value)


def test_replies_decoded_on_threads_come_back_in_order_each_as_decoded_alone(monkeypatch):
    """decode_updates on 4 threads: every reply's update equal to its own decode_update, in the
    replies' order, a refused reply's ReplyError in its place, each update in vectors of its own
    (a later round's threads take the vectors the first left, none twice), and the work really on
    several threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(topk, "_POOL", {})
    gen = torch.Generator().manual_seed(3)
    contents = [reply(delta={k: torch.randn(t.shape, generator=gen) if t.is_floating_point() else t + i
                             for k, t in STATE.items()}) for i in range(8)]
    contents[5] = reply(v={"w": torch.full((2, 3), -1.0)})
    threads = set()
    real_decode = decode_update

    def noting_thread(*args, **kwargs):
        threads.add(threading.get_ident())
        return real_decode(*args, **kwargs)

    monkeypatch.setattr("fedact_app.replies.decode_update", noting_thread)
    pool = VectorPool()
    try:
        decode_updates(contents, STATE, ("v",), TRAINABLE, ("v",), pool=pool)
        pool.recycle()  # a later round: the threads take the vectors the first one left
        updates = decode_updates(contents, STATE, ("v",), TRAINABLE, ("v",), pool=pool)
    finally:
        for executor in topk._POOL.values():
            executor.shutdown()
    assert len(threads) > 1  # the calling thread and at least one of the pool (which ones: the pool decides)
    assert isinstance(updates[5], ReplyError) and "negative values" in str(updates[5])
    assert updates[5].__traceback__ is None and updates[5].__context__ is None  # nothing holds its frames
    for i, (content, update) in enumerate(zip(contents, updates)):
        if i == 5:
            continue
        alone = real_decode(content, STATE, ("v",), TRAINABLE, ("v",))
        for name in STATE:
            assert torch.equal(update.delta[name], alone.delta[name]), (i, name)
        assert torch.equal(update.arrays["v"]["w"], alone.arrays["v"]["w"]) and update.norms == alone.norms
    vectors = [u.delta["w"].data_ptr() for u in updates if not isinstance(u, ReplyError)]
    vectors += [u.arrays["v"]["w"].data_ptr() for u in updates if not isinstance(u, ReplyError)]
    assert len(set(vectors)) == len(vectors) and not pool._free.get((6, torch.float32))  # each reused once


ARRAY_CHANGES = ("bit", "truncated", "extended", "dtype", "shape", "stype", "value", "bare header")
LAYOUT_CHANGES = ("name", "shape", "dtype", "order", "repeated", "dropped", "form")


def mutated_array(rng, array: Array) -> tuple[Array, str]:
    """``array`` with one thing changed (which one: ``ARRAY_CHANGES``): a bit, its length, its
    dtype, shape or serialization type, a value made NaN, infinite or negative, or its bytes
    replaced by a bare .npy header."""
    data, dtype, shape, stype = bytearray(array.data), array.dtype, list(array.shape), array.stype
    change = rng.choice(ARRAY_CHANGES if len(data) >= 16 else ARRAY_CHANGES[1:6] + ARRAY_CHANGES[7:])
    if change == "bit":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif change == "truncated":
        data = data[:rng.randrange(len(data) + 1)]
    elif change == "extended":
        data += bytes(rng.randrange(1, 9))
    elif change == "dtype":
        dtype = rng.choice(["float64", "float16", "int16", "int64", "uint8", "object", ">f4", "bogus", "V8", "bool"])
    elif change == "shape":
        shape = [rng.choice([-1, 0, 1, 3, 10**12])] * rng.randint(0, 2)
    elif change == "stype":
        stype = rng.choice(["torch", ""])
    elif change == "value":
        end = len(data) - 4 * rng.randint(0, 2)
        data[end - 4:end] = np.float32(rng.choice([np.nan, np.inf, -1.0, 1e38])).tobytes()
    else:
        data = bytearray(b"\x93NUMPY\x01\x00" + bytes(rng.randrange(40)))
    return Array(dtype=dtype, shape=tuple(shape), stype=stype, data=bytes(data)), change


def mutated_layout(rng, record) -> str | None:
    """The record's layout with one thing changed (which one: ``LAYOUT_CHANGES``; None where an
    earlier change left no layout of ``[name, dtype, shape]`` entries to change): an entry
    renamed, reshaped or given another dtype, the entries reordered, one repeated or dropped, or
    the layout replaced by JSON of another form."""
    try:
        layout = json.loads(np.load(io.BytesIO(record["layout"].data)).tobytes())
    except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError):  # unreadable after an earlier change
        return None
    if not (isinstance(layout, list) and layout and all(isinstance(e, list) and len(e) == 3 for e in layout)):
        return None
    entry = rng.choice(layout)
    change = rng.choice(LAYOUT_CHANGES)
    if change == "name":
        entry[0] = rng.choice(["w", "bn.n", "x", ""])
    elif change == "shape":
        entry[2] = rng.choice([[3, 2], [6], [], [2, 3, 1], [-1], [1e3], ["2"], None])
    elif change == "dtype":
        entry[1] = rng.choice(["float64", "int64", "layout", "int16"])
    elif change == "order":
        rng.shuffle(layout)
    elif change == "repeated":
        layout.append(list(entry))
    elif change == "dropped":
        layout.remove(entry)
    else:
        layout = rng.choice([{}, None, 3, [[1, 2, 3]], [["w", "float32"]]])
    record["layout"] = Array(np.frombuffer(json.dumps(layout).encode(), np.uint8))  # Flower's own .npy bytes
    return change


def mutated_reply(rng, reply_dtype: str, changes: Counter) -> RecordDict | None:
    """A valid reply (its floating arrays in ``reply_dtype``) with one to three things changed: an
    array of a record, a record's layout, an array dropped or added, a metric (None where Flower's
    ``MetricRecord`` itself refuses the value). ``changes`` counts each change made."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    records = {"delta": packed_record(to_wire({k: torch.randn(t.shape, generator=gen) if t.is_floating_point()
                                               else t + 1 for k, t in STATE.items()}, reply_dtype)),
               "v": packed_record(to_wire({"w": torch.rand(2, 3, generator=gen)}, reply_dtype))}
    metrics = {"num-examples": 64, "num-steps": 2, "lr-sum": 0.002, "train-loss": 1.5}
    for _ in range(rng.randint(1, 3)):
        record = records[rng.choice(["delta", "v"])]
        target = rng.choice(["array", "layout", "entries", "metric"])
        if target == "metric":
            metrics[rng.choice([*metrics, "train-seconds", "work-start", "positive-ratio"])] = rng.choice(
                [0, -1, 2**62, math.nan, math.inf, -0.0, 0.5, 3])
            changes["metric"] += 1
        elif not list(record):
            continue
        elif target == "array":
            key = rng.choice(list(record))
            record[key], change = mutated_array(rng, record[key])
            changes[f"array {change}"] += 1
        elif target == "layout" and "layout" in record:
            if change := mutated_layout(rng, record):
                changes[f"layout {change}"] += 1
        elif target == "entries":
            key = rng.choice(list(record))
            if rng.random() < 0.5:
                del record[key]
                changes["entry dropped"] += 1
            else:
                record[rng.choice(["float64", "int64", "extra"])] = record[key]
                changes["entry added"] += 1
    try:
        return RecordDict({**records, "metrics": MetricRecord(metrics)})
    except (TypeError, ValueError):
        return None


@pytest.mark.parametrize("reply_dtype", ["float32", "bfloat16"])
def test_a_mutated_reply_is_refused_or_decodes_to_a_sound_update(reply_dtype):
    """2,000 replies with random changes to their bytes, dtypes, shapes, layouts, entries and
    metrics: each one is refused with a ReplyError, or decodes to what the round can aggregate
    (the state's names, shapes and dtypes, finite values, v >= 0, the delta's norm that of its
    values, counts >= 1, a finite lr-sum > 0, its metrics finite and in their ranges). No other
    exception, both outcomes occur, and so does every kind of change."""
    rng = random.Random(reply_dtype)
    outcomes, changes = Counter(), Counter()
    for _ in range(2000):
        content = mutated_reply(rng, reply_dtype, changes)
        if content is None:
            continue
        try:
            update = decode_update(content, STATE, ("v",), TRAINABLE, ("v",), reply_dtype=reply_dtype)
        except ReplyError:
            outcomes["refused"] += 1
            continue
        outcomes["accepted"] += 1
        for name, want in STATE.items():
            got = update.delta[name]
            assert (got.shape, got.dtype) == (want.shape, want.dtype) and torch.isfinite(got.float()).all()
        assert math.isclose(update.norms["delta"], float(update.delta["w"].double().norm()), rel_tol=1e-12)
        v = update.arrays["v"]["w"]
        assert v.shape == (2, 3) and torch.isfinite(v).all() and (v >= 0).all()
        assert update.num_steps >= 1 and update.num_examples >= 1 and 0 < update.lr_sum < math.inf
        metrics = content["metrics"]
        assert all(math.isfinite(value) for value in metrics.values())
        assert all(metrics[key] >= 0 for key in ("train-seconds", "work-start") if key in metrics)
        assert 0 <= metrics.get("positive-ratio", 0) <= 1
    assert outcomes["refused"] > 1000 and outcomes["accepted"] > 100, outcomes
    kinds = ["metric", "entry dropped", "entry added", *(f"array {c}" for c in ARRAY_CHANGES),
             *(f"layout {c}" for c in LAYOUT_CHANGES)]
    assert all(changes[kind] >= 10 for kind in kinds), changes
