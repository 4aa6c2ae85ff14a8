"""fedact_app.timeline: a round's last-reply path, against times worked out by hand."""

import subprocess
import sys
import time

import pytest

from fedact_app.timeline import COLUMNS, ReplyTimes, process_started, round_path


def test_the_path_is_the_last_pulled_replys_and_the_starts_span_every_reply():
    """Every column differs, and the reply pulled last is neither the first nor the last to start."""
    push_start, push_end = 10.0, 10.25
    replies = [ReplyTimes(work_start=10.75, train_seconds=2.0, replied=13.5, arrived=14.0),  # first to start
               ReplyTimes(work_start=11.0, train_seconds=3.0, replied=14.125, arrived=14.5),  # pulled last
               ReplyTimes(work_start=12.0, train_seconds=1.0, replied=13.0, arrived=13.25)]  # last to start
    path = round_path(push_start, push_end, replies)
    assert tuple(path) == COLUMNS
    assert path == pytest.approx({"push_seconds": 0.25, "start_seconds_min": 0.5, "start_seconds_max": 1.75,
                                  "last_reply_start_seconds": 0.75, "last_reply_work_seconds": 3.125,
                                  "last_reply_train_seconds": 3.0, "last_reply_return_seconds": 0.375})
    # the four parts add up to the push's start to the last pull
    parts = ("push_seconds", "last_reply_start_seconds", "last_reply_work_seconds", "last_reply_return_seconds")
    assert sum(path[key] for key in parts) == pytest.approx(14.5 - push_start)


def test_of_replies_one_pull_brought_the_one_made_last_is_the_paths():
    replies = [ReplyTimes(work_start=1.0, train_seconds=0.5, replied=2.0, arrived=3.0),
               ReplyTimes(work_start=1.5, train_seconds=0.5, replied=2.5, arrived=3.0)]
    path = round_path(0.0, 0.5, replies)
    assert (path["last_reply_start_seconds"], path["last_reply_return_seconds"]) == (1.0, 0.5)


def test_a_round_without_timed_replies_has_no_path():
    assert round_path(0.0, 0.5, []) == {}


def test_process_started_is_when_the_process_began():
    """A child's start lies between its spawn and its first statement (to /proc's 10 ms ticks)."""
    spawned = time.time()
    code = ("import time; first = time.time(); time.sleep(0.3); "
            "from fedact_app.timeline import process_started; print(first, process_started())")
    first, started = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                               check=True, timeout=60).stdout.split())
    assert spawned - 0.05 <= started <= first + 0.01
    assert process_started() <= spawned  # this process began before it spawned the child
