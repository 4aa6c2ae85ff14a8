"""Where a run's time goes: its start-up (:func:`process_started`, and the ServerApp's ``startup``
times in summary.json), and each training round's critical path: the path of the accepted reply
that came last, from the ServerApp's push of the round's messages to its pull of that reply.

A round waits for its last reply, so that reply's path is the round's critical path up to the
ServerApp's own work after it (``server_seconds``), unless a failed or rejected reply (which is
not timed) came later. :func:`round_path` cuts it into

- ``push_seconds``: the ServerApp handing the round's messages to the SuperLink
  (``Grid.push_messages``);
- ``last_reply_start_seconds``: from the end of that push to the client beginning the message's
  work (Flower's and Ray's dispatch, the message's transport to the ClientApp, a warm worker's
  hand-over);
- ``last_reply_work_seconds``: the client's work on it (reading the message, ``train-seconds`` of
  local training, making the reply), to the reply's ``created_at``; ``last_reply_train_seconds``
  is its ``train-seconds``;
- ``last_reply_return_seconds``: from the reply's ``created_at`` to the ServerApp's pull that
  brought it (the reply's transport, the wait between two pulls, and the ServerApp's work before
  its first pull: the round before's diagnostics and evaluation, which the clients' work hides);

and gives the first and the last client's start (``start_seconds_min`` / ``_max``): how far apart
the round's clients begin. The four parts add up to the time from the push's start to the last
reply's pull. The client's times are its own clock's, the others the ServerApp's: on one machine
(a simulation, a local deployment) they are one clock; across machines their offset moves time
between the start and the return, and their sum stays exact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fedact_app.cli.procs import start_time


COLUMNS = ("push_seconds", "start_seconds_min", "start_seconds_max", "last_reply_start_seconds",
           "last_reply_work_seconds", "last_reply_train_seconds", "last_reply_return_seconds")


@dataclass(frozen=True)
class ReplyTimes:
    """When one reply's parts happened (Unix seconds, except ``train_seconds``)."""

    work_start: float  # the client began the message's work (its clock; the reply's ``work-start``)
    train_seconds: float  # its local training (the reply's ``train-seconds``)
    replied: float  # the reply was made (its ``created_at``, the client's clock)
    arrived: float  # the ServerApp's pull that brought it (the ServerApp's clock)


def round_path(push_start: float, push_end: float, replies: Sequence[ReplyTimes]) -> dict[str, float]:
    """The round's timeline columns (module docstring) from its push (Unix seconds, the ServerApp's
    clock) and its replies' times; {} without a reply. The last reply is the one the latest pull
    brought; of those, the one made last."""
    if not replies:
        return {}
    last = max(replies, key=lambda r: (r.arrived, r.replied))
    starts = [r.work_start - push_end for r in replies]
    return {"push_seconds": push_end - push_start,
            "start_seconds_min": min(starts),
            "start_seconds_max": max(starts),
            "last_reply_start_seconds": last.work_start - push_end,
            "last_reply_work_seconds": last.replied - last.work_start,
            "last_reply_train_seconds": last.train_seconds,
            "last_reply_return_seconds": last.arrived - last.replied}


def process_started() -> float | None:
    """Unix time at which this process started, to about 10 ms (Linux: its start in
    ``/proc/self/stat`` against the uptime in ``/proc/uptime``); None where ``/proc`` has neither."""
    ticks = start_time(os.getpid())
    try:
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if ticks is None else time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
