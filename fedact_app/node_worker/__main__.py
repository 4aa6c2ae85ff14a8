"""``python -m fedact_app.node_worker list|stop [--run RUN_ID]``: this user's warm workers on this
machine (in ``$FEDACT_WORKER_DIR``, default ``<tmp>/fedact-workers-<uid>``), and stopping them."""

from __future__ import annotations

import argparse
import sys
import time

from fedact_app.node_worker.channel import worker_dir
from fedact_app.node_worker.inventory import stop_workers, workers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedact_app.node_worker", description=__doc__)
    parser.add_argument("command", choices=("list", "stop"))
    parser.add_argument("--run", type=int, default=None, help="only the workers of this run id")
    args = parser.parse_args(argv)
    if args.command == "stop":
        pids = stop_workers(run_id=args.run)
        print(f"stopped {len(pids)} warm worker(s)" + (f": pids {', '.join(map(str, pids))}" if pids else ""))
        return 0
    found = [w for w in workers() if args.run is None or w["run-id"] == args.run]
    print(f"{len(found)} warm worker(s) in {worker_dir()}")
    for w in found:
        serves = "clients in batches" if w.get("batched") else f"node {w['node-id']}"
        print(f"  pid {w['pid']}: run {w['run-id']} {serves}, SuperNode pid {w['supernode-pid']}, "
              f"up {time.time() - w['started']:.0f} s, ends after {w['idle-timeout']:g} s idle")
    return 0


if __name__ == "__main__":
    sys.exit(main())
