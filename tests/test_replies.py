"""A reply's records decoded and checked, on real Flower record types (fedact_app.replies)."""

import threading

import pytest
import torch
from flwr.app import MetricRecord, RecordDict

import fedact_app.optim.topk as topk
from fedact_app.packing import VectorPool
from fedact_app.replies import ReplyError, decode_update, decode_updates, record_bytes
from fedact_app.wire import packed_record

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
