"""One message at a time per simulated node: an OS file lock per (run, node), removed with its run.

A SuperNode in a deployment works on one message at a time, but Flower's simulation engine hands a
node's next message to any free actor while its earlier one still runs, so a hung node would take
one more actor every round until the others' messages queue behind it. The actors are processes,
so the slot is a file lock (``flock``, released when its holder exits or closes it). The lock files
of a run live in their own folder, which the ServerApp removes when the run ends (in simulation the
ServerApp and the actors share the machine); before, a sweep left one file per node and run in the
temporary directory for good.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def locks_root() -> Path:
    """The folder of every run's lock folder, in the machine's temporary directory."""
    return Path(tempfile.gettempdir()) / "fedact-node-locks"


def run_locks(run_id: int) -> Path:
    """The folder of one run's lock files."""
    return locks_root() / str(run_id)


@contextlib.contextmanager
def node_slot(run_id: int, node_id: int) -> Iterator[bool]:
    """Hold the node's slot in this run; yields False, at once, when another message of this node
    and run holds it."""
    folder = run_locks(run_id)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"{node_id}.lock", os.O_CREAT | os.O_RDWR, 0o600)
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
