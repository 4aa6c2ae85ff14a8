"""The engine's shared Ray cluster (fedact_app.cli.ray_cluster) beside another one on the machine.

``ray start`` hands its workers, a run's driver included, ports counted up from 10002 (it checks
that a port is free before handing it out); ``ray.init()``'s own clusters bind ports the OS picks.
Two engines started together (two sweeps, two test workers) thus handed their first drivers the
same port: one driver's gRPC server could not bind it, Ray aborted that ``flwr-simulation`` process
with no word on any log Flower keeps, and a minute later the SuperLink failed the run for a missing
heartbeat.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fedact_app.cli.ray_cluster import RayCluster

RAY_START_WORKER_PORTS = range(10002, 20000)  # `ray start --min/--max-worker-port` defaults (Ray 2.x)

LISTENING = 'sorted(c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN")'
DRIVER = textwrap.dedent(f"""
    import json, sys, psutil, ray
    ray.init(address=sys.argv[1], log_to_driver=False)
    driver = {LISTENING}
    worker = ray.get(ray.remote(lambda: {LISTENING}).options(num_cpus=1).remote())
    print("ports", json.dumps({{"driver": driver, "worker": worker}}))
""")


def os_port_range() -> range | None:
    """The ports the OS picks from for a bind to port 0 (Linux), None where unknown."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return None
    return range(low, high + 1)


@pytest.mark.timeout(240)
def test_the_clusters_driver_and_workers_listen_on_ports_the_os_picks():
    picked = os_port_range()
    if picked is None or (picked.start < RAY_START_WORKER_PORTS.stop and RAY_START_WORKER_PORTS.start < picked.stop):
        pytest.skip(f"the OS picks ports from {picked}, which may overlap ray start's {RAY_START_WORKER_PORTS}")
    cluster = RayCluster.start(num_cpus=1, num_gpus=None, env=dict(os.environ))
    try:
        proc = subprocess.run([sys.executable, "-c", DRIVER, cluster.address], capture_output=True, text=True,
                              timeout=90, check=False)
    finally:
        cluster.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (ports,) = [json.loads(line[len("ports "):]) for line in proc.stdout.splitlines() if line.startswith("ports ")]
    assert ports["driver"] and ports["worker"], ports  # each listens on its gRPC port
    assert not [p for listening in ports.values() for p in listening if p in RAY_START_WORKER_PORTS], ports


def test_the_heads_ports_are_distinct_even_when_the_os_hands_one_out_again(monkeypatch):
    """A Ray head refuses to start when two of its ports are equal, and the OS may hand a port it
    got back out again at once: with a fake OS that hands out the lowest port not bound, as Linux
    may, the head is still given three distinct ports (each socket stays bound until all are
    chosen)."""
    import socket as socket_module

    from fedact_app.cli import flwr, ray_cluster

    bound: set[int] = set()

    class LowestFreePort:
        def __init__(self, *args):
            self.port = None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

        def bind(self, address):
            self.port = min(p for p in range(40000, 40010) if p not in bound)
            bound.add(self.port)

        def getsockname(self):
            return ("127.0.0.1", self.port)

        def close(self):
            bound.discard(self.port)

    commands = []

    def no_start(cmd, **kwargs):
        commands.append(cmd)
        raise RuntimeError("not started")

    monkeypatch.setattr(socket_module, "socket", LowestFreePort)
    monkeypatch.setattr(ray_cluster.subprocess, "Popen", no_start)
    with pytest.raises(RuntimeError, match="not started"):
        RayCluster.start(1, None, {})
    (cmd,) = commands
    flags = ("--port", "--ray-client-server-port", "--dashboard-agent-listen-port")
    ports = [cmd[cmd.index(flag) + 1] for flag in flags]
    assert sorted(ports) == ["40000", "40001", "40002"]
    assert bound == set() and flwr.free_port() == 40000  # every socket closed again
