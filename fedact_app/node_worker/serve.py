"""The warm worker's process: ``python -m fedact_app.node_worker.serve`` (started by
``fedact_app.node_worker.forward``, not by hand).

It binds its socket before it imports anything beyond the standard library, so that the ClientApp
that started it connects at once and its request waits in the socket's queue while the worker
imports Flower, torch and the app (``fedact_app.node_worker.worker``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from fedact_app.node_worker.channel import bind_name, info_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--key", required=True)
    parser.add_argument("--run-id", required=True, type=int)
    parser.add_argument("--node-id", required=True, type=int)
    parser.add_argument("--watch-pid", required=True, type=int, help="end when this process (the SuperNode) ends")
    parser.add_argument("--watch-start", required=True, type=int, help="its start time (/proc/<pid>/stat field 22)")
    parser.add_argument("--idle", required=True, type=float, help="end after this many seconds without a message")
    parser.add_argument("--batched", action="store_true",
                        help="train the run's training messages of every node in batches (node_worker.gather)")
    args = parser.parse_args(argv)
    # bound and listening under a name of its own, then linked to the socket's name: a client never
    # meets the name bound but not yet listening (it would take it for a dead worker's)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    own_name = bind_name(args.socket, os.getpid())
    listener.bind(str(own_name))
    os.chmod(own_name, 0o600)
    listener.listen(16)
    try:
        os.link(own_name, args.socket)
    except FileExistsError:  # another worker took the name first: it serves the messages
        print(f"warm worker of run {args.run_id} node {args.node_id} not started: {args.socket} is taken",
              file=sys.stderr)
        return 0
    finally:
        own_name.unlink()

    from fedact_app.cli.procs import start_time
    from fedact_app.node_worker.worker import Worker

    label = f"of run {args.run_id} " + ("(clients in batches)" if args.batched else f"node {args.node_id}")
    worker = Worker(listener, args.socket, args.key, label, (args.watch_pid, args.watch_start), args.idle,
                    args.batched)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop("SIGTERM"))
    info_path(args.socket).write_text(json.dumps({
        "pid": os.getpid(), "start-time": start_time(os.getpid()), "run-id": args.run_id,
        "node-id": args.node_id, "socket": str(args.socket), "supernode-pid": args.watch_pid,
        "idle-timeout": args.idle, "batched": args.batched, "started": time.time()}))
    worker.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
