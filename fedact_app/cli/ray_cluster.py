"""A private Ray cluster that many simulation runs attach to, for :mod:`.engine`.

Flower 1.41's Ray backend calls ``ray.init()`` without an address in every ``flwr-simulation``
process: with ``RAY_ADDRESS`` in its environment it attaches to that cluster (about 0.3 s), without
it it starts and stops a cluster of its own (about 5 s on a 2-core machine). This module starts one
head with ``ray start --head --block`` on loopback and free ports, in a fresh temporary directory,
so that only the runs given its :attr:`RayCluster.address` use it: a cluster left by another
program, or ``RAY_ADDRESS`` in the user's environment, is never picked up (the engine sets that
variable itself). Its workers and the runs' drivers bind ports the OS picks, so that clusters of
several engines on one machine never hand out one port twice (tests/test_ray_cluster.py). Stopping
the ``--block`` process stops the cluster; its process tree is stopped too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from fedact_app.cli.flwr import LaunchError, console_script, free_ports
from fedact_app.cli.procs import descendants, stop_tree

STARTUP_TIMEOUT = 60.0  # seconds for the head to accept connections
STOP_GRACE = 10.0  # seconds between SIGTERM and SIGKILL


@dataclass
class RayCluster:
    """A running one-node Ray cluster: its ``ray start --block`` process and address."""

    proc: subprocess.Popen[bytes]
    address: str  # host:port of its GCS, the value of RAY_ADDRESS for the runs
    temp_dir: Path
    seen: set[int] = field(default_factory=set)

    @classmethod
    def start(cls, num_cpus: int, num_gpus: float | None, env: dict[str, str]) -> RayCluster:
        """Start the head with ``num_cpus`` CPUs (and ``num_gpus``; None: Ray's own detection)."""
        # Ray puts unix sockets under the temp dir; their paths must stay under 108 bytes
        temp_dir = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp" if os.path.isdir("/tmp") else None))
        port, client_port, agent_port = free_ports(3)
        cmd = [
            console_script("ray"), "start", "--head", "--block",
            "--node-ip-address", "127.0.0.1",
            "--port", str(port),
            "--ray-client-server-port", str(client_port),
            "--dashboard-agent-listen-port", str(agent_port),
            # workers and drivers bind ports the OS picks: by default `ray start` counts them up from
            # 10002 in every cluster, and two clusters started together gave two drivers one port
            "--min-worker-port", "0", "--max-worker-port", "0",
            "--include-dashboard", "false",
            "--disable-usage-stats",
            "--temp-dir", str(temp_dir),
            "--num-cpus", str(int(num_cpus)),
        ] + ([] if num_gpus is None else ["--num-gpus", str(num_gpus)])  # fmt: skip
        run_env = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}
        try:
            with (temp_dir / "head.out").open("wb") as out:
                proc = subprocess.Popen(cmd, env=run_env, stdin=subprocess.DEVNULL, stdout=out,  # noqa: S603
                                        stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
            shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        cluster = cls(proc, f"127.0.0.1:{port}", temp_dir)
        try:
            cluster._wait_ready(time.monotonic() + STARTUP_TIMEOUT)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _wait_ready(self, until: float) -> None:
        """Ready once ``ray start`` has printed that the head is up (it then blocks)."""
        out = self.temp_dir / "head.out"
        while time.monotonic() < until:
            text = out.read_text(errors="replace") if out.exists() else ""
            if self.proc.poll() is not None:
                raise LaunchError(f"`ray start --head` exited (rc={self.proc.returncode}):\n{text[-3000:]}")
            if "Ray runtime started" in text:
                return
            time.sleep(0.2)
        raise LaunchError(f"`ray start --head` was not ready after {STARTUP_TIMEOUT:.0f} s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def remember_children(self) -> None:
        """Note its processes so far (GCS, raylet, workers), to stop them even after the head died."""
        if self.alive():
            self.seen |= descendants(self.proc.pid)

    def stop(self, kill_at_once: bool = False) -> tuple[int, ...]:
        """Stop the cluster and its processes (``kill_at_once``: SIGKILL only); remove its
        temporary directory."""
        pids = stop_tree(self.proc, self.seen, 0.0 if kill_at_once else STOP_GRACE)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return pids
