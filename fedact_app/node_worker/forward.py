"""The ClientApp side: hand a message to the node's warm worker (or a training message of a
``client_batch=true`` run to the machine's batching worker), starting the worker where there is
none, and return its reply. Imports no torch: in a deployment this runs in a fresh
``flwr-clientapp`` process for every message.

``forward`` returns None, after a warning, wherever no worker takes the message (the folder or
a socket is unsafe, the worker cannot be started or does not answer): the caller then works on
the message itself, cold, so no message is lost to the mechanism. Once a worker has taken a
message, that message is the worker's: if the worker dies, or is still working after the
message's deadline (then it is killed, but for a batching worker, which holds other nodes'
messages), the message fails with ``WorkerLost``, and the node's next message starts a new
worker where the last one is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from logging import WARNING
from pathlib import Path

from flwr.app import Context, Message
from flwr.common import log

import fedact_app
from fedact_app.cli.procs import malloc_env, start_time
from fedact_app.cli.resources import machine_cpus
from fedact_app.node_config import WARM_WORKER_KEY, switch, worker_idle_timeout
from fedact_app.node_worker.channel import (PREPARE, ChannelClosed, UnsafeChannel, check_socket, peer,
                                            private_dir, recv_frames, send_frames, socket_path, worker_key)
from fedact_app.node_worker.frames import broadcast_group, message_blobs, message_from_blobs

WARM_WORKER_ENV = "FEDACT_WARM_WORKER"  # 0/false/off: every message cold, whatever the node config says
CLIENTAPP_PROGRAM = "flwr-clientapp"  # the process Flower starts for each message in a deployment
SUPERNODE_PROGRAM = "flower-supernode"
START_TIMEOUT = 30.0  # seconds for a started worker's socket to accept
ACK_TIMEOUT = 600.0  # seconds for a worker to take a message (the first: imports, task, data, model)
REPLY_GRACE = 10.0  # seconds past the message's deadline before a worker counts as hung
_STARTED: list[subprocess.Popen] = []  # workers started here (kept referenced: they outlive this process)


class WorkerRaised(RuntimeError):
    """The message's work raised in the worker; the text is that exception's type and message."""


class WorkerLost(RuntimeError):
    """The worker took the message and then died, or hung past the message's deadline."""


def wanted(context: Context) -> bool:
    """A warm worker serves this message: in a deployment's ``flwr-clientapp`` process (a
    simulation's clients live in warm processes already), unless :func:`allowed` says no."""
    return Path(sys.argv[0]).name == CLIENTAPP_PROGRAM and allowed(context)


def allowed(context: Context) -> bool:
    """Warm workers (the node's, or the machine's batching worker) may take this node's
    messages: unless ``$FEDACT_WARM_WORKER`` or the node config's ``warm-worker`` turns them off."""
    return (switch(os.environ.get(WARM_WORKER_ENV, "1"), WARM_WORKER_ENV)
            and switch(context.node_config.get(WARM_WORKER_KEY, True), WARM_WORKER_KEY))


def forward(kind: str, msg: Message, context: Context, batched: bool = False) -> Message | None:
    """The worker's reply to ``msg`` (a ``kind`` message: "train" or "evaluate"), with
    ``context.state`` replaced by the state the worker's work left; None where no worker took it.
    ``batched``: the machine's worker that trains the run's clients in batches
    (:mod:`fedact_app.node_worker.gather`) takes the training message, whatever node sent it,
    without the array records it already holds of the message's round (its model and broadcast,
    :mod:`fedact_app.node_worker.worker`)."""
    from flwr.common.serde import context_from_proto, context_to_proto
    from flwr.proto.message_pb2 import Context as ProtoContext

    try:
        sock, pid, key = connect(context, batched)
    except (OSError, UnsafeChannel, ValueError, TimeoutError) as err:
        log(WARNING, "node %d: no warm worker (%s); the ClientApp works on this message itself",
            context.node_id, err)
        return None
    with sock:
        try:
            sock.settimeout(ACK_TIMEOUT)
            if batched and kind == "train" and (group := broadcast_group(msg)) is not None:
                send_frames(sock, {"key": key, "kind": kind, "round": list(group)})
                header, _ = recv_frames(sock)  # the round's records the worker holds, or a refusal
                if isinstance(header.get("have"), list):
                    held = [name for name in header["have"] if isinstance(name, str)
                            and name in msg.content.array_records]
                    send_frames(sock, {"omitted": held}, context_to_proto(context).SerializeToString(),
                                *message_blobs(msg, held))
                    header, _ = recv_frames(sock)
                elif "refused" not in header:
                    header = {"refused": f"the batching worker answered the offer with {str(header)[:200]}"}
            else:
                send_frames(sock, {"key": key, "kind": kind}, context_to_proto(context).SerializeToString(),
                            *message_blobs(msg))
                header, _ = recv_frames(sock)
        except (OSError, ChannelClosed) as err:  # socket.timeout is an OSError
            if isinstance(err, TimeoutError) and not batched:  # a batching worker holds other nodes' messages
                _kill(pid)
            log(WARNING, "node %d: the warm worker (pid %d) did not take the message (%s); the ClientApp "
                "works on it itself", context.node_id, pid, err)
            return None
        if "refused" in header:
            log(WARNING, "node %d: %s; the ClientApp works on this message itself", context.node_id, header["refused"])
            return None
        if "raised" in header:
            raise WorkerRaised(header["raised"])
        sock.settimeout(max(float(header["deadline"]) + REPLY_GRACE - time.time(), 1.0))
        try:
            header, blobs = recv_frames(sock)
        except TimeoutError:
            if batched:  # the worker holds other nodes' messages too: this one alone fails
                raise WorkerLost(f"the machine's batching worker (pid {pid}) had not trained the message "
                                 f"{REPLY_GRACE:g} s after its deadline") from None
            _kill(pid)
            raise WorkerLost(f"the node's warm worker (pid {pid}) was still working on the message "
                             f"{REPLY_GRACE:g} s after its deadline: stopped; the node's next message "
                             "starts a new worker") from None
        except (OSError, ChannelClosed) as err:
            worker = "the machine's batching worker" if batched else "the node's warm worker"
            raise WorkerLost(f"{worker} (pid {pid}) ended while working on the message ({err}); the node's "
                             "next message starts a new one") from None
    if "raised" in header:
        raise WorkerRaised(header["raised"])
    reply = message_from_blobs(blobs[1:])
    context.state = context_from_proto(ProtoContext.FromString(blobs[0])).state
    if reply.has_error():
        return Message(reply.error, reply_to=msg)
    return Message(content=reply.content, reply_to=msg)


def prepare(context: Context) -> None:
    """Have the node's worker (started here where none runs) build the run's trainer and read the
    node's data now, without waiting for it: the node's identity query comes before round 1's
    training message, so the worker's start overlaps Flower's message round trip."""
    from flwr.common.serde import context_to_proto

    try:
        sock, _, key = connect(context)
        with sock:
            send_frames(sock, {"key": key, "kind": PREPARE}, context_to_proto(context).SerializeToString())
    except (OSError, UnsafeChannel, ValueError) as err:
        log(WARNING, "node %d: no warm worker to prepare (%s)", context.node_id, err)


def connect(context: Context, batched: bool = False) -> tuple[socket.socket, int, str]:
    """A socket connected to this node's and run configuration's worker (``batched``: the run
    configuration's batching worker, shared by the machine's nodes), the worker's pid and its key;
    the worker is started where none listens."""
    directory = private_dir()
    node_process = supernode_process()
    run = {"run": context.run_id, "run-config": context.run_config, "app": app_dir(), "python": sys.executable}
    key = worker_key({**run, "batched": True} if batched else
                     {**run, "node": context.node_id, "node-config": context.node_config, "supernode": node_process})
    path = socket_path(directory, key)
    with _locked(directory / f"{key}.lock"):
        sock = _try_connect(path)
        if sock is None:
            _start(path, key, context, node_process, batched)
            deadline = time.monotonic() + START_TIMEOUT
            while (sock := _try_connect(path)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the warm worker started for {path} did not listen within "
                                       f"{START_TIMEOUT:g} s (see the SuperNode's log)")
                time.sleep(0.02)
    try:
        return sock, peer(sock), key
    except BaseException:
        sock.close()
        raise


def _try_connect(path: Path) -> socket.socket | None:
    """A socket connected to ``path``; None where nothing listens there (a stale socket file of
    this user's is removed)."""
    try:
        check_socket(path)
    except FileNotFoundError:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        return sock
    except ConnectionRefusedError:  # its worker is gone
        sock.close()
        path.unlink(missing_ok=True)
        return None
    except BaseException:
        sock.close()
        raise


def _start(path: Path, key: str, context: Context, node_process: tuple[int, int], batched: bool = False) -> None:
    """Start a worker for ``path``; it inherits this process's environment (with the malloc
    settings that keep freed memory for the next message, ``procs.malloc_env``), working
    directory and output (the SuperNode's log), and outlives this process (a session of its own).
    A batching worker inherits it from the first of the machine's ClientApps to need it (in a
    simulation, a Ray actor: its ``CUDA_VISIBLE_DEVICES`` and ``OMP_NUM_THREADS``) and watches
    that ClientApp's SuperNode, or its parent (Ray's raylet)."""
    env = {**malloc_env(os.environ), **os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [app_dir(), os.environ.get("PYTHONPATH")]))}
    if batched:  # the machine's one training process: its CPUs, not one ClientApp's share (Ray's OMP_NUM_THREADS)
        env["OMP_NUM_THREADS"] = str(machine_cpus())
    command = [sys.executable, "-m", "fedact_app.node_worker.serve", "--socket", str(path), "--key", key,
               "--run-id", str(context.run_id), "--node-id", str(context.node_id),
               "--watch-pid", str(node_process[0]), "--watch-start", str(node_process[1]),
               "--idle", str(worker_idle_timeout(context.node_config)), *(["--batched"] if batched else [])]
    _STARTED.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True))


def app_dir() -> str:
    """The folder this app's package was imported from (the run's installed FAB in a deployment):
    the worker imports the same code."""
    return str(Path(fedact_app.__file__).resolve().parents[1])


def supernode_process() -> tuple[int, int]:
    """(pid, start time) of the SuperNode this ClientApp serves: the nearest ancestor running
    ``flower-supernode``, else the parent (whose end then ends the worker)."""
    pid = os.getppid()
    while pid > 1:
        if any(Path(arg).name == SUPERNODE_PROGRAM for arg in _cmdline(pid)[:2]):
            break
        pid = _parent(pid)
    else:
        pid = os.getppid()
    started = start_time(pid)
    if started is None:
        raise OSError(f"the ClientApp's SuperNode process (pid {pid}) is gone")
    return pid, started


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``: one ClientApp at a time finds or starts a worker."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
