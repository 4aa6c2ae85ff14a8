"""The strategy's message exchange with the Grid (fedact_app.strategy.exchange), and its count of
messages left without a reply (AlgorithmStrategy.exchange, clients_idle)."""

import time
from types import SimpleNamespace

import pytest

from fedact_app.strategy import AlgorithmStrategy, exchange, poll_cap


class TimedGrid:
    """The two Grid calls :func:`exchange` uses: message i's reply can be pulled ``delays[i]``
    seconds after the push (None: never), once."""

    def __init__(self, delays):
        self.delays, self.pulls, self.pushed_at = delays, 0, None
        self.returned = []  # (pull number, the ids it returned) of every pull that returned some

    def push_messages(self, messages):
        self.pushed_at = time.monotonic()
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        self.pulls += 1
        elapsed = time.monotonic() - self.pushed_at
        ready = [i for i in sorted(message_ids) if self.delays[int(i[1:])] is not None
                 and self.delays[int(i[1:])] <= elapsed]
        if ready:
            self.returned.append((self.pulls, ready))
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in ready]


def test_exchange_returns_every_reply_soon_after_the_last_one_arrives():
    grid = TimedGrid([0.0, 0.2, 0.6])
    started = time.monotonic()
    replies = exchange(grid, ["a", "b", "c"], timeout=30.0)
    waited = time.monotonic() - started
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]
    assert 0.6 <= waited < 0.6 + 1.5  # not Flower's 3 s between pulls (room for a loaded machine)
    assert grid.pulls <= 70  # the wait grows to its cap, 10 ms here: no busy loop


def test_collect_waits_between_pulls_growing_by_half_up_to_the_cap_of_its_wait_so_far(monkeypatch):
    """On a fake clock (every sleep advances it, a pull takes no time): the waits start at 5 ms,
    grow by half to 10 ms, then follow 1 % of the time waited up to 0.25 s, and the last one
    stops at the deadline."""
    import fedact_app.strategy as strategy_module

    clock, sleeps = [100.0], []

    def sleep(seconds):
        sleeps.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(strategy_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(strategy_module.time, "sleep", sleep)
    grid = SimpleNamespace(pull_messages=lambda ids: [])  # no reply ever comes
    assert strategy_module.collect(grid, {"m0"}, timeout=60.0) == []
    assert sleeps[:3] == pytest.approx([0.005, 0.0075, 0.01])
    waited = [sum(sleeps[:i]) for i in range(len(sleeps))]
    assert sleeps[1:-1] == pytest.approx([min(1.5 * earlier, poll_cap(at))
                                          for earlier, at in zip(sleeps[:-2], waited[1:-1])])
    assert sleeps[-1] <= 0.25 and sum(sleeps) == pytest.approx(60.0)  # the last one ends at the deadline
    assert max(sleeps) == pytest.approx(0.25)


def test_the_longest_wait_between_pulls_is_a_share_of_the_wait_so_far_within_bounds():
    """10 ms in a round's first second (its last reply known within 10 ms), 1 % of the wait from
    then on (a long round's extra wait stays within 1 %), at most 0.25 s (four pulls a second)."""
    assert [poll_cap(t) for t in (0.0, 0.5, 1.0, 3.0, 20.0, 600.0)] == pytest.approx(
        [0.01, 0.01, 0.01, 0.03, 0.2, 0.25])


def test_exchange_hands_each_pull_s_replies_over_before_the_next_pull():
    """``on_pull`` gets the replies of every pull (none, for a pull that brought none), once
    each, before the next pull: what lets the strategy decode early replies while the last
    clients train."""
    grid = TimedGrid([0.0, 0.3, 0.3])
    handed = []
    replies = exchange(grid, ["a", "b", "c"], timeout=30.0,
                       on_pull=lambda pulled: handed.append((grid.pulls, [r.metadata.reply_to_message_id
                                                                           for r in pulled])))
    assert [pull for pull, _ in handed] == list(range(1, grid.pulls + 1))  # every pull, before the next
    assert [(pull, ids) for pull, ids in handed if ids] == grid.returned  # with the replies it brought
    assert [ids for _, ids in handed if ids] == [["m0"], ["m1", "m2"]]  # m1 and m2 come in one pull
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1", "m2"]


def test_replies_that_come_while_the_hand_over_outlasts_the_timeout_are_collected():
    """A hand-over (the strategy's decode) that takes the rest of the timeout is followed by one
    more pull: a reply that came meanwhile, before the timeout, is not counted as missing."""
    grid = TimedGrid([0.0, 0.3, None])
    replies = exchange(grid, ["a", "b", "c"], timeout=0.5, on_pull=lambda pulled: pulled and time.sleep(0.6))
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1"]


def test_work_while_waiting_runs_once_between_the_push_and_the_first_pull_within_the_timeout():
    """``while_waiting`` (the previous round's evaluation) runs after the push, before any pull, and its
    time counts toward the round's timeout: here it takes all of it, so one pull follows, which
    still brings the reply that came meanwhile."""
    grid = TimedGrid([0.0, None])
    seen = []
    replies = exchange(grid, ["a", "b"], timeout=0.4,
                       while_waiting=lambda: seen.append((grid.pushed_at is not None, grid.pulls)) or time.sleep(0.5))
    assert seen == [(True, 0)] and grid.pulls == 1
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]


def test_exchange_stops_at_the_timeout_with_the_replies_it_has():
    grid = TimedGrid([0.0, None])
    started = time.monotonic()
    replies = exchange(grid, ["a", "b"], timeout=0.5)
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0"]
    assert 0.5 <= time.monotonic() - started < 2.5  # not a further 3 s pull


def test_exchange_without_messages_returns_at_once():
    grid, waited = TimedGrid([]), []
    assert exchange(grid, [], timeout=30.0, while_waiting=lambda: waited.append(1)) == [] and grid.pulls == 0
    assert waited == [1]  # the work meant to overlap the clients still runs


def test_the_strategy_counts_messages_left_without_a_reply_and_is_idle_only_without_any():
    strategy = SimpleNamespace(unanswered=0, open_queries={})  # the two attributes the methods use
    replies = AlgorithmStrategy.exchange(strategy, TimedGrid([0.0, 0.0]), ["a", "b"], timeout=5.0)
    assert len(replies) == 2 and strategy.unanswered == 0
    assert AlgorithmStrategy.clients_idle.fget(strategy)
    AlgorithmStrategy.exchange(strategy, TimedGrid([0.0, None, None]), iter(["a", "b", "c"]), timeout=0.3)
    assert strategy.unanswered == 2 and not AlgorithmStrategy.clients_idle.fget(strategy)
    assert not AlgorithmStrategy.clients_idle.fget(SimpleNamespace(unanswered=0, open_queries={"m": 3}))


def test_the_serverapp_tells_the_engine_it_ended_only_when_no_client_can_still_be_working(tmp_path, monkeypatch):
    from fedact_app import server_app
    import flwr.common

    from fedact_app.serverapp_done import DONE_DIR_ENV, done_line

    logged = []  # (the message, whether the run's file existed when it was logged)
    monkeypatch.setattr(flwr.common, "log", lambda level, fmt, *args: logged.append(
        (fmt % args, sorted(path.name for path in tmp_path.iterdir()))))
    monkeypatch.setenv(DONE_DIR_ENV, str(tmp_path))
    for run_id, idle in ((7, True), (8, False)):
        monkeypatch.setattr(server_app, "run_app", lambda grid, context, idle=idle: SimpleNamespace(clients_idle=idle))
        server_app.main(None, SimpleNamespace(run_id=run_id))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["7"]
    token = (tmp_path / "7").read_text()
    assert len(token) == 16 and logged == [(done_line(7, token), [])]  # the line first, then the file
    assert done_line(7, token) == f"ServerApp of run 7 ended: results written, no client working ({token})"
    monkeypatch.delenv(DONE_DIR_ENV)  # outside an engine's runs: nothing is written or logged
    monkeypatch.setattr(server_app, "run_app", lambda grid, context: SimpleNamespace(clients_idle=True))
    server_app.main(None, SimpleNamespace(run_id=9))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["7"] and len(logged) == 1
