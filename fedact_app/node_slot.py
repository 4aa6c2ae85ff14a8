"""One message at a time per simulated node: an OS file lock per (run, node), removed with its run.

A SuperNode in a deployment works on one message at a time, but Flower's simulation engine hands a
node's next message to any free actor while its earlier one still runs, so a hung node would take
one more actor every round until the others' messages queue behind it. The actors are processes,
so the slot is a file lock (``flock``, released when its holder exits or closes it).

A run's lock files live in their own folder under a root that belongs to the user (mode 0700, so
users of one machine do not share it). The ServerApp removes its run's folder when the run ends,
which reaches the lock files only where the ServerApp and the nodes share the machine (simulation);
it also removes run folders older than ``STALE_AFTER`` (runs that were killed, or a deployment's
SuperNodes on the ServerApp's machine).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from logging import WARNING
from pathlib import Path

from flwr.common import log

STALE_AFTER = 86400.0  # seconds without a message after which a run's lock folder is a dead run's


def locks_root() -> Path:
    """The user's folder of every run's lock folder, in the machine's temporary directory."""
    return Path(tempfile.gettempdir()) / f"fedact-node-locks-{os.getuid()}"


def run_locks(run_id: int) -> Path:
    """The folder of one run's lock files."""
    return locks_root() / str(run_id)


@contextlib.contextmanager
def node_slot(run_id: int, node_id: int) -> Iterator[bool]:
    """Hold the node's slot in this run; yields False, at once, when another message of this node
    and run holds it. Where no lock file can be made (a full or read-only temporary directory) it
    yields True with a warning: the guard is lost, not the message's work."""
    try:
        locks_root().mkdir(mode=0o700, exist_ok=True)
        run_locks(run_id).mkdir(exist_ok=True)
        os.utime(run_locks(run_id))  # a live run's folder is never stale, however long the run
        fd = os.open(run_locks(run_id) / f"{node_id}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    except OSError as err:
        log(WARNING, "node %d: no lock file for its one-message-at-a-time slot (%s); handling the "
            "message without it", node_id, err)
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # also releases the lock


def remove_run_locks(run_id: int) -> None:
    """Delete the run's lock files (the run is over: no message of it is handled any more)."""
    shutil.rmtree(run_locks(run_id), ignore_errors=True)


def remove_stale_locks() -> None:
    """Delete the lock folders of runs that handled no message for ``STALE_AFTER`` seconds."""
    now = time.time()
    with contextlib.suppress(OSError):
        for folder in locks_root().iterdir():
            with contextlib.suppress(OSError):
                if now - folder.stat().st_mtime > STALE_AFTER:
                    shutil.rmtree(folder, ignore_errors=True)
