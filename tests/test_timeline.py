"""fedact_app.timeline: a round's last-reply path, against times worked out by hand."""

import subprocess
import sys
import time

import pytest

from fedact_app.timeline import COLUMNS, ReplyTimes, process_started, round_path


def test_the_path_is_the_last_pulled_replys_and_the_starts_span_every_reply():
    push_start, push_end = 10.0, 10.5
    replies = [ReplyTimes(work_start=11.0, train_seconds=2.0, replied=13.5, arrived=14.0),
               ReplyTimes(work_start=10.75, train_seconds=3.0, replied=14.25, arrived=14.5),  # pulled last
               ReplyTimes(work_start=12.0, train_seconds=1.0, replied=13.0, arrived=13.25)]
    path = round_path(push_start, push_end, replies)
    assert path == pytest.approx({"push_seconds": 0.5, "start_seconds_min": 0.25, "start_seconds_max": 1.5,
                                  "last_reply_start_seconds": 0.25, "last_reply_work_seconds": 3.5,
                                  "last_reply_train_seconds": 3.0, "last_reply_return_seconds": 0.25})
    assert tuple(path) == COLUMNS
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
                                               check=True).stdout.split())
    assert spawned - 0.05 <= started <= first
    assert process_started() <= spawned  # this process began before it spawned the child
