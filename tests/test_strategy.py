"""The strategy's reply decoding and checks, on real Flower record types."""

import time
from types import SimpleNamespace

import pytest
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from fedact_app.strategy import REPLY_POLL, ReplyError, all_finite, decode_update, exchange, record_bytes

STATE = {"w": torch.zeros(2, 3), "bn.running_mean": torch.zeros(3), "bn.n": torch.tensor(0)}
TRAINABLE = ["w"]


def reply(delta=None, v=None, metrics=None, drop=()):
    content = RecordDict({
        "delta": ArrayRecord(delta if delta is not None else {k: torch.ones_like(t) for k, t in STATE.items()}),
        "v": ArrayRecord(v if v is not None else {"w": torch.full((2, 3), 0.5)}),
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


@pytest.mark.parametrize("values, dtype, finite", [
    ([1.0, -2.0, 0.0], torch.float32, True),
    ([1.0, float("inf")], torch.float32, False),
    ([float("-inf"), 1.0], torch.float32, False),
    ([float("inf"), float("-inf")], torch.float32, False),  # the sum is NaN
    ([1.0, float("nan")], torch.float32, False),
    ([3e38, 3e38, -1.0], torch.float32, True),  # finite entries whose float32 sum overflows
    ([1.7e308, 1.7e308], torch.float64, True),
    ([60000.0, 60000.0], torch.float16, True),  # beyond float16's largest value, 65504, when summed
    ([60000.0, float("nan")], torch.bfloat16, False),
    ([], torch.float32, True),
])
def test_all_finite_checks_every_entry(values, dtype, finite):
    assert all_finite(torch.tensor(values, dtype=dtype)) is finite


class TimedGrid:
    """The two Grid calls :func:`exchange` uses: message i's reply can be pulled ``delays[i]``
    seconds after the push (None: never), once."""

    def __init__(self, delays):
        self.delays, self.pulls, self.pushed_at = delays, 0, None

    def push_messages(self, messages):
        self.pushed_at = time.monotonic()
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        self.pulls += 1
        elapsed = time.monotonic() - self.pushed_at
        ready = [i for i in sorted(message_ids) if self.delays[int(i[1:])] is not None
                 and self.delays[int(i[1:])] <= elapsed]
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in ready]


def test_exchange_returns_every_reply_soon_after_the_last_one_arrives():
    grid = TimedGrid([0.0, 0.2, 0.6])
    started = time.monotonic()
    replies = exchange(grid, ["a", "b", "c"], timeout=30.0)
    waited = time.monotonic() - started
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    assert 0.6 <= waited < 0.6 + REPLY_POLL[1] + 0.5  # not Flower's 3 s between pulls
    assert grid.pulls <= 0.6 / REPLY_POLL[1] + 10  # the wait grows to its cap: no busy loop


def test_exchange_stops_at_the_timeout_with_the_replies_it_has():
    grid = TimedGrid([0.0, None])
    started = time.monotonic()
    replies = exchange(grid, ["a", "b"], timeout=0.5)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert 0.5 <= time.monotonic() - started < 1.5


def test_exchange_without_messages_returns_at_once():
    grid = TimedGrid([])
    assert exchange(grid, [], timeout=30.0) == [] and grid.pulls == 0
