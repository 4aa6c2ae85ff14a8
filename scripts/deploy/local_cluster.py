#!/usr/bin/env python3
"""A whole Flower deployment on one machine, on loopback, for trying the multi-machine setup out.

One ``flower-superlink`` with TLS and SuperNode authentication, and N ``flower-supernode``s, each
with its own key pair (registered with ``flwr supernode register``), its own ``--node-config`` and
its own ``FLWR_HOME``: the same processes and flags as in docs/DEPLOY.md, only all on 127.0.0.1.

    python scripts/deploy/local_cluster.py up --nodes 2           # start, wait until all are online
    export FLWR_HOME=$PWD/.cluster/flwr-home                      # the printed connection config
    flwr run . fedact-local --run-config "overrides='num_clients=2 num_rounds=3'"
    flwr ls fedact-local; flwr log <run-id> fedact-local --stream
    python scripts/deploy/local_cluster.py run --overrides "num_clients=2 num_rounds=3"   # or: all
                                                                  # of the above, exit 0 iff completed
    python scripts/deploy/local_cluster.py status                 # processes, nodes, runs
    python scripts/deploy/local_cluster.py down                   # stop everything it started

Everything lives in one folder (``--dir``, default ``.cluster``)::

    certs/                 CA + SuperLink certificate (scripts/deploy/make_certs.sh), reused
    keys/node-<i>[.pub]    SuperNode key pairs (scripts/deploy/make_node_keys.sh), reused
    flwr-home/config.toml  the `flwr` CLI connection `fedact-local` (TLS, CA certificate)
    superlink/, node-<i>/  FLWR_HOME of the SuperLink and of each SuperNode (installed apps)
    logs/                  superlink.log, node-<i>.log (stdout and stderr of each process),
                           run-<id>.log (`run`); the previous `up`'s logs are kept in logs.prev/
    cluster.json           ports, node ids, and each process's pid, process group and start time

``down`` signals only the processes recorded in cluster.json (checked by start time and command
line, so a reused pid is never hit) and their descendants: SIGTERM, then SIGKILL after a grace
period. ``up`` stops what it started when anything fails.

Only 127.0.0.1 is ever used, and ``up`` checks it: Flower 1.41's SuperLink serves its Control API
(register SuperNodes, submit runs; not authenticated without Flower's enterprise account login),
Fleet API and Runtime API on one socket, so whoever reaches that socket can do all of it.
``up`` refuses a SuperLink (or SuperNode) that listens anywhere but its own 127.0.0.1 port, and
``status`` lists what each process listens on. docs/DEPLOY.md ("Security") has the multi-machine
set-up that keeps the Control API off the network.

Warm workers: each SuperNode's ClientApp hands its messages to a warm worker on the node
(``fedact_app.node_worker``; ``warm-worker=false`` in a node config turns it off), as in every
deployment. ``run`` (and ``wait_run``) stops a run's workers when the run has finished (Flower
tells a ClientApp nothing of its run's end), ``down`` waits for them to end with their SuperNodes,
``status`` lists them. Each SuperNode gets ``OMP_NUM_THREADS`` = the machine's CPUs over the
nodes (at least 1; ``threads_per_node``) unless the environment sets it, as Ray gives a simulated
client the threads of its CPUs. Every process gets ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.25``
(``fedact_app.cli.flwr.BASE_ENV``): a SuperNode's SuperExec asks for each message's ClientApp
task 4 times a second instead of once.

Node config: ``--node-config-template`` (default ``partition-id={i} num-partitions={n}``) is
formatted per node with ``{i}`` (node index) and ``{n}`` (number of nodes); ``--node-config
I=CONFIG`` replaces it for node I. ``--cuda-devices 0,1`` gives node i CUDA_VISIBLE_DEVICES =
device i mod the list's length (``device=auto`` in the app then trains on that GPU).
"""

# One module (~700 lines) on purpose: the command-line entry point that docs and tests load by
# path, whose up/status/run/down share cluster.json; the flwr-CLI parts are fedact_app.cli.flwr.
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fedact_app.cli.flwr import (LaunchError, console_script, follow_run, free_port, json_payload, run_flwr,
                                 strip_ansi, submit_run, write_connection)
from fedact_app.cli import flwr as flwr_cli
from fedact_app.cli.procs import descendants, kill_quietly, malloc_env, pid_alive, start_time
from fedact_app.node_worker.channel import WORKER_DIR_ENV, worker_dir
from fedact_app.node_worker.inventory import stop_workers, workers

HERE = Path(__file__).resolve().parent
CONNECTION = "fedact-local"
HOST = "127.0.0.1"  # loopback only, by design
STATE_FILE = "cluster.json"
DEFAULT_TEMPLATE = "partition-id={i} num-partitions={n}"
PORT_ATTEMPTS = 3  # starts of a process whose freshly picked port was taken meanwhile
STOP_GRACE = 5.0
_POPENS: dict[int, subprocess.Popen[bytes]] = {}  # processes started by this Python process


class ClusterError(RuntimeError):
    """The cluster could not be brought up, or a command on it failed."""


# --------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------
@dataclass
class Proc:
    """One process this script started (a session leader: its pgid is its pid)."""

    name: str
    pid: int
    start_time: int  # /proc/<pid>/stat field 22: tells a reused pid apart
    cmd: list[str]
    log: str
    port: int
    node_id: str = ""
    node_config: str = ""
    key: str = ""
    cwd: str = ""

    def alive(self) -> bool:
        return _same_process(self.pid, self.start_time)


@dataclass
class Cluster:
    """What ``up`` started; saved as ``<dir>/cluster.json``."""

    dir: str
    port: int
    superlink: Proc
    nodes: list[Proc] = field(default_factory=list)
    connection: str = CONNECTION
    worker_dir: str = ""  # where the SuperNodes' warm workers keep their sockets (fedact_app.node_worker)

    @property
    def root(self) -> Path:
        return Path(self.dir)

    @property
    def flwr_home(self) -> Path:
        return self.root / "flwr-home"

    @property
    def procs(self) -> list[Proc]:
        return [self.superlink, *self.nodes]

    def save(self) -> None:
        tmp = self.root / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2), encoding="utf-8")
        tmp.replace(self.root / STATE_FILE)

    @classmethod
    def load(cls, directory: str | Path) -> Cluster | None:
        path = Path(directory).expanduser().resolve() / STATE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(
            dir=data["dir"],
            port=int(data["port"]),
            superlink=Proc(**data["superlink"]),
            nodes=[Proc(**node) for node in data["nodes"]],
            connection=data.get("connection", CONNECTION),
            worker_dir=data.get("worker_dir", ""),
        )

    def cli(self, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        """Run ``flwr ARGS`` with this cluster's FLWR_HOME (bounded by ``timeout``)."""
        return run_flwr(self.flwr_home, args, timeout=timeout, env=env)


# --------------------------------------------------------------------------------------------
# up
# --------------------------------------------------------------------------------------------
def up(  # noqa: PLR0913 - flat options mirror the command line
    directory: str | Path = ".cluster",
    nodes: int = 2,
    *,
    port: int = 0,
    node_config_template: str = DEFAULT_TEMPLATE,
    node_configs: dict[int, str] | None = None,
    cuda_devices: list[str] | None = None,
    runtime_dependency_install: bool = False,
    database: str | None = None,
    cwd: str | Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    quiet: bool = False,
) -> Cluster:
    """Start a SuperLink (TLS, SuperNode auth) and ``nodes`` registered SuperNodes; wait for them.

    Each process must listen on its own 127.0.0.1 port and nowhere else (see ``check_listening``).
    ``cwd`` is the SuperLink's working directory (the app's relative paths resolve against it;
    default: the caller's). ``env`` is added to every process's environment. Raises ClusterError
    (after stopping whatever it started) when something does not come up within ``timeout``.
    """
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    deadline = time.monotonic() + timeout
    root = Path(directory).expanduser().resolve()
    old = Cluster.load(root)
    if old is not None and any(p.alive() for p in old.procs):
        raise ClusterError(f"a cluster from {root} is still running; run `down` first")
    if (root / "logs").is_dir():  # keep the previous cluster's logs, one generation back
        shutil.rmtree(root / "logs.prev", ignore_errors=True)
        (root / "logs").rename(root / "logs.prev")
    for sub in ("logs", "flwr-home", "superlink"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / STATE_FILE).unlink(missing_ok=True)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))

    certs, keys = root / "certs", root / "keys"
    if not (certs / "server.pem").is_file():
        _script("make_certs.sh", "-o", str(certs))
    names = [f"node-{i}" for i in range(nodes)]
    missing = [name for name in names if not (keys / name).is_file()]
    if missing:
        _script("make_node_keys.sh", "-o", str(keys), *missing)

    base_env = {**malloc_env(os.environ), **os.environ, **flwr_cli.BASE_ENV, **(env or {})}
    link_env = {**base_env, "FLWR_HOME": str(root / "superlink")}
    link_cwd = Path(cwd) if cwd else Path.cwd()
    extra = [] if runtime_dependency_install else ["--disable-runtime-dependency-installation"]
    extra += ["--database", database] if database else []
    cluster = None
    for attempt in range(1, PORT_ATTEMPTS + 1):  # a free port can be taken before we bind it
        link_port = port or free_port(HOST)
        link_cmd = [
            console_script("flower-superlink"),
            "--ssl-ca-certfile", str(certs / "ca.crt"),
            "--ssl-certfile", str(certs / "server.pem"),
            "--ssl-keyfile", str(certs / "server.key"),
            "--enable-supernode-auth",
            "--host", HOST,
            "--port", str(link_port),
            *extra,
        ]  # fmt: skip
        link = _spawn("superlink", link_cmd, root / "logs" / "superlink.log", link_port, link_env, link_cwd)
        cluster = Cluster(dir=str(root), port=link_port, superlink=link,
                          worker_dir=base_env.get(WORKER_DIR_ENV) or str(worker_dir()))
        cluster.save()
        try:
            _write_connection(cluster.flwr_home, link_port, certs / "ca.crt")
            _wait_superlink(cluster, certs / "ca.crt", deadline)
            check_listening(link)
            break
        except ClusterError:
            down(cluster, quiet=True)
            if port or attempt == PORT_ATTEMPTS or not _port_taken(link.log):
                raise
        except BaseException:
            down(cluster, quiet=True)
            raise
    assert cluster is not None
    try:
        say(f"SuperLink up on {HOST}:{cluster.port} (TLS, SuperNode authentication), pid {link.pid}")

        templates = dict(node_configs or {})
        envs: dict[str, dict[str, str]] = {}
        for i, name in enumerate(names):
            node_id = register(cluster, keys / f"{name}.pub")
            node_config = templates.get(i, node_config_template).format(i=i, n=nodes)
            node_env = {"OMP_NUM_THREADS": str(threads_per_node(nodes)), **base_env, "FLWR_HOME": str(root / name)}
            if cuda_devices:
                node_env["CUDA_VISIBLE_DEVICES"] = cuda_devices[i % len(cuda_devices)]
            (root / name).mkdir(exist_ok=True)
            envs[name] = node_env
            node = start_supernode(cluster, name, keys / name, node_config, node_env, root / name)
            node.node_id = node_id
            cluster.nodes.append(node)
            cluster.save()
        _wait_nodes_online(cluster, deadline, envs)
        for node in cluster.nodes:
            check_listening(node)
    except BaseException:
        down(cluster, quiet=True)
        raise
    say(f"{nodes} SuperNode(s) online: " + ", ".join(f"{n.name} [{n.node_config}]" for n in cluster.nodes))
    say(f"Logs and pids in {root}. Use the cluster with:\n"
        f"  export FLWR_HOME={cluster.flwr_home}\n"
        f"  flwr run . {CONNECTION} --run-config \"overrides='num_clients={nodes}'\"\n"
        f"  flwr ls {CONNECTION}; flwr log <run-id> {CONNECTION} --stream\n"
        f"  python3 {_display(Path(__file__))} down --dir {_display(root)}")
    return cluster


def threads_per_node(nodes: int) -> int:
    """torch threads for each of ``nodes`` SuperNodes sharing this machine's CPUs (their
    ``OMP_NUM_THREADS``, unless the environment sets it): the machine's CPUs over the nodes, at
    least 1. Each node's worker would otherwise take every CPU, and their threads, spinning
    against each other, made a 4-node digits round 2 s slower on 2 cores."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // nodes)


def register(cluster: Cluster, public_key: Path) -> str:
    """``flwr supernode register <public_key> <connection>``; returns the node id."""
    proc = cluster.cli("supernode", "register", str(public_key), cluster.connection, "--format", "json")
    payload = json_payload(proc.stdout)
    if proc.returncode != 0 or not payload.get("success"):
        raise ClusterError(f"registering {public_key} failed (rc={proc.returncode}): "
                           f"{_clean(payload.get('error-message') or proc.stdout + proc.stderr)}")
    return str(payload["node-id"])


def start_supernode(cluster: Cluster, name: str, private_key: Path | None, node_config: str,
                    env: dict[str, str], cwd: Path, port: int = 0) -> Proc:
    """Start one ``flower-supernode`` against the cluster's SuperLink (TLS; authenticated when
    ``private_key`` is given). It is not added to ``cluster.nodes``: the caller decides."""
    port = port or free_port(HOST)
    cmd = [
        console_script("flower-supernode"),
        "--superlink", f"{HOST}:{cluster.port}",
        "--root-certificates", str(cluster.root / "certs" / "ca.crt"),
        "--host", HOST,
        "--port", str(port),
        "--max-wait-time", "60",
    ]  # fmt: skip
    if private_key is not None:
        cmd += ["--auth-supernode-private-key", str(private_key)]
    if node_config:
        cmd += ["--node-config", node_config]
    proc = _spawn(name, cmd, cluster.root / "logs" / f"{name}.log", port, env, cwd)
    proc.node_config, proc.key, proc.cwd = node_config, str(private_key or ""), str(cwd)
    return proc


def listening(pids: Iterable[int]) -> list[str]:
    """The TCP addresses (``host:port``, sorted) on which the processes ``pids`` accept connections.

    Linux: each process's socket inodes (``/proc/<pid>/fd``) matched against the LISTEN entries
    of ``/proc/net/tcp`` and ``tcp6``. Processes that are gone or not ours count as listening
    nowhere; [] without /proc.
    """
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in _read(f"/proc/net/{table}").splitlines()[1:]:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                words = [int(address[i:i + 8], 16) for i in range(0, len(address), 8)]
                host = socket.inet_ntop(family, struct.pack(f"={len(words)}I", *words))
                host = f"[{host}]" if family == socket.AF_INET6 else host
                found.add(f"{host}:{int(port, 16)}")
    return sorted(found)


def check_listening(proc: Proc) -> None:
    """Raise ClusterError unless ``proc`` and its descendants listen on ``HOST:proc.port`` only.

    For the SuperLink that socket carries the Control, Fleet and Runtime APIs; any other listener
    (a Flower version with separate gRPC Control/Fleet ports, which listened on 0.0.0.0 by
    default, or ``FLWR_INTERNAL_GRPC_*`` in the environment) may be reachable from other machines.
    Not checked without /proc.
    """
    if not Path("/proc/net/tcp").is_file():
        return
    found = listening({proc.pid, *descendants(proc.pid)})
    if found != [f"{HOST}:{proc.port}"]:
        raise ClusterError(f"{proc.name} (pid {proc.pid}) listens on {found or 'nothing'}; "
                           f"expected {HOST}:{proc.port} only:\n{tail(proc.log)}")


def _wait_superlink(cluster: Cluster, ca_file: Path, deadline: float) -> None:
    context = ssl.create_default_context(cafile=str(ca_file))
    url = f"https://{HOST}:{cluster.port}/health"
    while time.monotonic() < deadline:
        if not cluster.superlink.alive():
            raise ClusterError(f"flower-superlink exited:\n{tail(cluster.superlink.log)}")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as resp:  # noqa: S310
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise ClusterError(f"flower-superlink did not answer {url} in time:\n{tail(cluster.superlink.log)}")


def _wait_nodes_online(cluster: Cluster, deadline: float, envs: dict[str, dict[str, str]]) -> None:
    """Each SuperNode logs its id once the SuperLink activated it; then `flwr supernode ls`."""
    pending = {node.name: node for node in cluster.nodes}
    restarts = 0
    while pending and time.monotonic() < deadline:
        for name, node in list(pending.items()):
            text = _read(node.log)
            if "SuperNode ID:" in text:
                del pending[name]
            elif not node.alive():
                if not _port_taken(node.log) or restarts >= PORT_ATTEMPTS:
                    raise ClusterError(f"{name} exited before joining:\n{tail(node.log)}")
                restarts += 1  # its Runtime API port was taken meanwhile: same node, new port
                index = cluster.nodes.index(node)
                fresh = start_supernode(cluster, name, Path(node.key), node.node_config,
                                        envs[name], Path(node.cwd))
                fresh.node_id = node.node_id
                cluster.nodes[index] = pending[name] = fresh
                cluster.save()
        time.sleep(0.3)
    if pending:
        raise ClusterError(f"SuperNode(s) {sorted(pending)} did not join in time:\n"
                           + "\n".join(tail(n.log) for n in pending.values()))
    while time.monotonic() < deadline:
        statuses = {n["node-id"]: n["status"] for n in list_nodes(cluster)}
        if all(statuses.get(node.node_id) == "online" for node in cluster.nodes):
            return
        time.sleep(1.0)
    raise ClusterError(f"not all SuperNodes are online: {list_nodes(cluster)}")


# --------------------------------------------------------------------------------------------
# status / run
# --------------------------------------------------------------------------------------------
def list_nodes(cluster: Cluster) -> list[dict[str, Any]]:
    """``flwr supernode ls --format json``: [{node-id, status, ...}] ([] on failure)."""
    try:
        proc = cluster.cli("supernode", "ls", cluster.connection, "--format", "json", timeout=30)
    except subprocess.TimeoutExpired:
        return []
    return list(json_payload(proc.stdout).get("nodes") or [])


def list_runs(cluster: Cluster, run_id: int | str | None = None) -> list[dict[str, Any]]:
    """``flwr ls [--run-id] --format json``: [{run-id, status, status-details, ...}]."""
    args = ["ls", cluster.connection, "--format", "json"]
    if run_id is not None:
        args += ["--run-id", str(run_id)]
    try:
        proc = cluster.cli(*args, timeout=30)
    except subprocess.TimeoutExpired:
        return []
    return list(json_payload(proc.stdout).get("runs") or [])


def status(cluster: Cluster) -> dict[str, Any]:
    """Processes (alive or not, and the addresses each one's process tree listens on),
    SuperNodes as the SuperLink sees them, runs, and the SuperNodes' warm workers."""
    procs = [{"name": p.name, "pid": p.pid, "alive": p.alive(), "port": p.port,
              "listening": listening({p.pid, *descendants(p.pid)}) if p.alive() else [],
              "node-id": p.node_id, "node-config": p.node_config} for p in cluster.procs]
    link_alive = cluster.superlink.alive()
    node_pids = {node.pid for node in cluster.nodes}
    return {
        "dir": cluster.dir,
        "superlink": f"{HOST}:{cluster.port}",
        "connection": cluster.connection,
        "flwr-home": str(cluster.flwr_home),
        "processes": procs,
        "nodes": list_nodes(cluster) if link_alive else [],
        "runs": list_runs(cluster) if link_alive else [],
        "workers": [w for w in workers(Path(cluster.worker_dir)) if w["supernode-pid"] in node_pids]
                   if cluster.worker_dir else [],
        "healthy": all(p["alive"] for p in procs),
    }


def submit(cluster: Cluster, app: str | Path = ".", overrides: str = "",
           run_config: dict[str, Any] | None = None) -> str:
    """``flwr run <app> <connection> --run-config <file>``; returns the run id."""
    config = dict(run_config or {})
    if overrides:
        config["overrides"] = overrides
    try:
        return str(submit_run(cluster.flwr_home, Path(app).resolve(), cluster.connection, config))
    except LaunchError as err:
        raise ClusterError(str(err)) from None


def wait_run(cluster: Cluster, run_id: str, timeout: float = 600.0, poll: float = 15.0
             ) -> tuple[str, str, str]:
    """Follow a run until it finishes: (status, status-details, log). ``status`` is what
    ``flwr ls`` says, e.g. ``finished:completed``; ``timeout`` is reported as status ``timeout``.

    The loop is the launcher's (``fedact_app.cli.flwr.follow_run``): ``flwr log --stream`` collects
    the log (stderr included) and ends when the SuperLink closes the stream at the end of the run,
    which is when ``flwr ls`` is asked; it is also asked every ``poll`` seconds.
    """

    def gone() -> str | None:
        return None if cluster.superlink.alive() else "the SuperLink exited:\n" + tail(cluster.superlink.log)

    run = follow_run(cluster.flwr_home, cluster.connection, run_id, cluster.root / "logs" / f"run-{run_id}.log",
                     deadline=time.monotonic() + timeout, poll_interval=poll, superlink_gone=gone,
                     stream_stderr=subprocess.STDOUT)
    if run.finished and cluster.worker_dir:  # Flower tells no ClientApp that its run ended
        stop_workers(Path(cluster.worker_dir), run_id=int(run_id))
        return run.status, run.details, run.log.strip()
    if run.timed_out:
        return "timeout", f"the run did not finish within {timeout:.0f} s", run.log.strip()
    return "unknown", run.details, run.log.strip()


# --------------------------------------------------------------------------------------------
# down
# --------------------------------------------------------------------------------------------
def down(cluster: Cluster | str | Path, *, quiet: bool = False, grace: float = STOP_GRACE) -> list[int]:
    """Stop every recorded process and its descendants; returns the pids seen.

    Snapshot the process trees first (children are re-parented once their parent is gone).
    SIGTERM each SuperNode's process group (the SuperNode, its SuperExec and ClientApps: each
    SuperNode was started as a session leader) so that it leaves the SuperLink cleanly, and wait
    for them and for their warm workers (which end with their SuperNode);
    SIGTERM the SuperLink, wait; then SIGTERM, and finally SIGKILL, whatever of the trees is left.
    """
    if not isinstance(cluster, Cluster):
        loaded = Cluster.load(cluster)
        if loaded is None:
            if not quiet:
                print(f"no cluster recorded in {Path(cluster).expanduser().resolve()}")
            return []
        cluster = loaded
    roots = [p for p in cluster.procs if p.alive()]
    tree: dict[int, int | None] = {}  # pid -> start time (None: unknown)
    node_tree: dict[int, int | None] = {}
    node_pids = {proc.pid for proc in roots if proc is not cluster.superlink}
    for worker in workers(Path(cluster.worker_dir)) if cluster.worker_dir else []:
        if worker["supernode-pid"] in node_pids:  # a session of its own; it ends with its SuperNode
            node_tree[worker["pid"]] = tree[worker["pid"]] = worker["start-time"]
    for proc in roots:
        sub = {proc.pid: proc.start_time, **{pid: start_time(pid) for pid in descendants(proc.pid)}}
        tree.update(sub)
        if proc is not cluster.superlink:
            node_tree.update(sub)
            _killpg(proc.pid, signal.SIGTERM)
    _wait_gone(node_tree, time.monotonic() + grace)
    if cluster.superlink in roots:
        kill_quietly(cluster.superlink.pid, signal.SIGTERM)
    _wait_gone(tree, time.monotonic() + grace)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = [pid for pid, start in tree.items() if _same_process(pid, start)]
        if not left:
            break
        for pid in left:  # newly spawned children of what is left
            tree.update({c: start_time(c) for c in descendants(pid) if c not in tree})
        for pid, start in tree.items():
            if _same_process(pid, start):
                kill_quietly(pid, sig)
        _wait_gone(tree, time.monotonic() + grace)
    for pid in tree:  # reap our own children (no zombies left in a long-lived caller)
        if pid in _POPENS and _POPENS[pid].poll() is not None:
            del _POPENS[pid]
    if not quiet:
        gone = [p.name for p in roots]
        print(f"stopped {', '.join(gone) if gone else 'nothing (no process was running)'}; "
              f"logs in {cluster.root / 'logs'}")
    (cluster.root / STATE_FILE).unlink(missing_ok=True)
    return sorted(tree)


def _wait_gone(tree: dict[int, int | None], until: float) -> None:
    while time.monotonic() < until and any(_same_process(p, s) for p, s in tree.items()):
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def _spawn(name: str, cmd: list[str], log: Path, port: int, env: dict[str, str], cwd: Path) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        popen = subprocess.Popen(  # noqa: S603
            cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)  # own process group; Ctrl-C in our terminal does not reach it
    _POPENS[popen.pid] = popen  # reaped in down(); when this process exits first, init reaps
    start = start_time(popen.pid)
    return Proc(name=name, pid=popen.pid, start_time=start if start is not None else -1, cmd=cmd,
                log=str(log), port=port)


def _write_connection(home: Path, port: int, ca_file: Path) -> None:
    """The `flwr` CLI's connection to the cluster: TLS, trusting ``ca_file``."""
    write_connection(home, CONNECTION, f"{HOST}:{port}", root_certificates=ca_file,
                     header="# Written by scripts/deploy/local_cluster.py; see deploy/config.toml.example.\n")


def _script(name: str, *args: str) -> None:
    proc = subprocess.run(["bash", str(HERE / name), *args], capture_output=True, text=True,  # noqa: S603
                          timeout=120, check=False)
    if proc.returncode != 0:
        raise ClusterError(f"{name} failed (rc={proc.returncode}): {proc.stderr or proc.stdout}")


def _clean(text: Any) -> str:
    return strip_ansi(text).strip()


def _port_taken(log: str) -> bool:
    return "address already in use" in _read(log).lower()


def _display(path: Path) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path.resolve())


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def tail(path: str, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, colours stripped."""
    return "\n".join(_clean(_read(path)).splitlines()[-lines:])


def _same_process(pid: int, started: int | None) -> bool:
    """``pid`` is alive (not a zombie) and, where known, started at ``started``."""
    if not Path("/proc").is_dir():  # no /proc: fall back to "some process has this pid"
        return pid_alive(pid)
    now = start_time(pid)
    return now is not None and (started is None or started < 0 or now == started)


def _killpg(leader: int, sig: int) -> None:
    """Signal the process group of ``leader``, a session leader this script started."""
    try:
        if os.getpgid(leader) == leader:
            os.killpg(leader, sig)
            return
    except (ProcessLookupError, PermissionError):
        return
    kill_quietly(leader, sig)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------
def _node_config_arg(text: str) -> tuple[int, str]:
    index, sep, config = text.partition("=")
    if not sep or not index.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected I=CONFIG, e.g. 0='data-path=\"/data/a\"', got {text!r}")
    return int(index), config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="local_cluster.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_dir(p: argparse.ArgumentParser) -> None:
        p.add_argument("--dir", default=".cluster", help="cluster folder (default: .cluster)")

    p_up = sub.add_parser("up", help="start a SuperLink and N SuperNodes (TLS, authenticated)")
    add_dir(p_up)
    p_up.add_argument("--nodes", "-n", type=int, default=2, help="number of SuperNodes (default 2)")
    p_up.add_argument("--port", type=int, default=0, help="SuperLink port (default: a free one)")
    p_up.add_argument("--node-config-template", default=DEFAULT_TEMPLATE,
                      help=f"per-node --node-config, with {{i}} and {{n}} (default: {DEFAULT_TEMPLATE!r})")
    p_up.add_argument("--node-config", action="append", type=_node_config_arg, default=[],
                      metavar="I=CONFIG", help="node I's --node-config instead of the template")
    p_up.add_argument("--cuda-devices", default="",
                      help="comma-separated CUDA devices, given round-robin to the SuperNodes")
    p_up.add_argument("--database", default=None,
                      help="SuperLink state database file (default: in memory)")
    p_up.add_argument("--allow-runtime-dependency-installation", action="store_true",
                      help="let the SuperLink install each app's dependencies (default: off)")
    p_up.add_argument("--timeout", type=float, default=120.0, help="seconds to come up (default 120)")

    p_status = sub.add_parser("status", help="processes, SuperNodes and runs")
    add_dir(p_status)
    p_status.add_argument("--json", action="store_true", help="machine-readable output")

    p_run = sub.add_parser("run", help="flwr run an app on the cluster and wait for it")
    add_dir(p_run)
    p_run.add_argument("--app", default=".", help="Flower app directory (default: .)")
    p_run.add_argument("--overrides", default="", help="value of the app's `overrides` key")
    p_run.add_argument("--timeout", type=float, default=3600.0, help="seconds (default 3600)")

    p_down = sub.add_parser("down", help="stop every process `up` started")
    add_dir(p_down)

    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            up(args.dir, args.nodes, port=args.port, node_config_template=args.node_config_template,
               node_configs=dict(args.node_config),
               cuda_devices=[d for d in args.cuda_devices.split(",") if d.strip()],
               runtime_dependency_install=args.allow_runtime_dependency_installation,
               database=args.database, timeout=args.timeout)
            return 0
        if args.command == "down":
            down(args.dir)
            return 0
        cluster = Cluster.load(args.dir)
        if cluster is None:
            print(f"no cluster recorded in {Path(args.dir).expanduser().resolve()} (run `up`)",
                  file=sys.stderr)
            return 3
        if args.command == "status":
            info = status(cluster)
            if args.json:
                print(json.dumps(info, indent=2))
            else:
                _print_status(info)
            return 0 if info["healthy"] else 1
        run_id = submit(cluster, args.app, args.overrides)
        print(f"run {run_id} submitted; following its log", flush=True)
        state, details, log = wait_run(cluster, run_id, timeout=args.timeout)
        print(log)
        print(f"run {run_id}: {state}" + (f" ({details})" if details not in ("", "N/A") else ""))
        return 0 if state == "finished:completed" else 1
    except (ClusterError, LaunchError) as err:
        print(f"local_cluster: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _print_status(info: dict[str, Any]) -> None:
    print(f"cluster {info['dir']}: SuperLink {info['superlink']}, connection "
          f"{info['connection']} (FLWR_HOME={info['flwr-home']})")
    for p in info["processes"]:
        extra = f" node-id {p['node-id']} [{p['node-config']}]" if p["node-id"] else ""
        print(f"  {p['name']:<10} pid {p['pid']:<8} {'running' if p['alive'] else 'NOT RUNNING':<12}"
              f" listening on {', '.join(p['listening']) or '-'}{extra}")
    for node in info["nodes"]:
        print(f"  node {node.get('node-id')}: {node.get('status')}")
    for run in info["runs"]:
        print(f"  run {run.get('run-id')}: {run.get('status')} {run.get('status-details', '')}")
    for worker in info["workers"]:
        print(f"  warm worker pid {worker['pid']}: run {worker['run-id']} node {worker['node-id']}")


if __name__ == "__main__":
    sys.exit(main())
