"""The warm workers running on this machine for this user, and stopping them: from the JSON file
each worker writes beside its socket (``fedact_app.node_worker.serve``). Plain Python."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from fedact_app.cli.procs import start_time
from fedact_app.node_worker.channel import worker_dir


def workers(directory: Path | None = None) -> list[dict]:
    """The live workers described in ``directory`` (default: ``worker_dir()``), oldest first: pid,
    run-id, node-id, socket, supernode-pid, idle-timeout, started (Unix time). A description
    whose process is gone (or is another process now) is left out."""
    found = []
    for path in sorted(Path(directory or worker_dir()).glob("*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(path.read_text())
            if start_time(int(info["pid"])) == info["start-time"]:
                found.append(info)
    return sorted(found, key=lambda info: info["started"])


def stop_workers(directory: Path | None = None, run_id: int | None = None, wait: float = 10.0) -> list[int]:
    """SIGTERM the live workers in ``directory`` (those of ``run_id`` only, where given) and wait up
    to ``wait`` seconds for them to end; their pids."""
    chosen = [info for info in workers(directory) if run_id is None or info["run-id"] == run_id]
    for info in chosen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(info["pid"], signal.SIGTERM)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(start_time(i["pid"]) == i["start-time"] for i in chosen):
        time.sleep(0.05)
    return [info["pid"] for info in chosen]
