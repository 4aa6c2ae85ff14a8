"""The channel between a ClientApp process and its node's warm worker: a Unix domain socket in a
folder only the user can enter, and the frames sent over it. No torch: the ClientApp side imports
this on every message.

Safety comes from the file system, not from a secret: the folder (``$FEDACT_WORKER_DIR``, default
``<tmp>/fedact-workers-<uid>``) must be the user's own with mode 0700, each socket in it the user's
own, and each end checks the other's uid (``SO_PEERCRED``) before it reads a byte. Anything else
raises ``UnsafeChannel`` naming the path; the ClientApp then works on the message itself. The
socket never listens on a network.

A frame set is a JSON header and binary blobs (a ``Context`` as Flower's protobuf, then a
``Message`` as :mod:`fedact_app.node_worker.frames` makes it), each behind its 8-byte length.
The ClientApp sends one; the worker answers with an ack (the message's deadline), then the reply.
A batched training message is offered first, by a header alone (its round), and sent after the
worker's answer (the records it holds of that round: :mod:`fedact_app.node_worker.worker`).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path

WORKER_DIR_ENV = "FEDACT_WORKER_DIR"
PREPARE = "prepare"  # a request's kind that builds the run's trainer ahead of its first message, unanswered
SOCKET_PATH_MAX = 107  # bytes of sockaddr_un.sun_path on Linux, less its terminating zero
_LENGTH = struct.Struct("!Q")
_MAX_HEADER = 1 << 20
_SMALL = 1 << 16  # bytes: a smaller part goes out with its length in one write


class UnsafeChannel(RuntimeError):
    """A worker folder or socket that someone other than this user could reach, or replace."""


class ChannelClosed(ConnectionError):
    """The other end closed the socket before a whole frame set arrived."""


def worker_dir() -> Path:
    """The folder of this user's worker sockets (not created here)."""
    default = Path(tempfile.gettempdir()) / f"fedact-workers-{os.getuid()}"
    return Path(os.environ.get(WORKER_DIR_ENV) or default)


def private_dir() -> Path:
    """``worker_dir()``, created with mode 0700 where missing; UnsafeChannel where it is a link,
    not a folder, someone else's, or open to others."""
    path = worker_dir()
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeChannel(f"{path} is not a folder (a link or a file): warm workers need a folder of "
                            f"their own; remove it, or set {WORKER_DIR_ENV} to another path")
    _check_owner(path, info)
    if info.st_mode & 0o077:
        raise UnsafeChannel(f"{path} has mode {stat.S_IMODE(info.st_mode):o}: others could reach the warm "
                            f"workers' sockets in it; it must be 700 (chmod 700 {path})")
    return path


def check_socket(path: Path) -> None:
    """UnsafeChannel unless ``path`` is a socket of this user's (FileNotFoundError if missing)."""
    info = os.lstat(path)
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafeChannel(f"{path} is not a socket: refused (remove it)")
    _check_owner(path, info)


def _check_owner(path: Path, info: os.stat_result) -> None:
    if info.st_uid != os.getuid():
        raise UnsafeChannel(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}): "
                            "refused")


def peer(sock: socket.socket) -> int:
    """The pid of the process at the other end; UnsafeChannel if it runs as another user."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))
    if uid != os.getuid():
        raise UnsafeChannel(f"the process at the other end of the worker socket (pid {pid}) runs as uid "
                            f"{uid}, not as this user (uid {os.getuid()}): refused")
    return pid


def worker_key(identity: Mapping[str, object]) -> str:
    """A name for one worker: the hash of everything that must be equal for two messages to share
    it (run, node, run config, node config, app folder, SuperNode process)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def socket_path(directory: Path, key: str) -> Path:
    """Where the worker named ``key`` listens; ValueError where the path, or the name the worker
    binds first (``bind_name``), is too long for a socket."""
    path = directory / f"{key}.sock"
    if len(os.fsencode(bind_name(path, 4194304))) > SOCKET_PATH_MAX:  # Linux's largest pid_max
        raise ValueError(f"{path} is longer than a Unix socket path may be ({SOCKET_PATH_MAX} bytes): "
                         f"set {WORKER_DIR_ENV} to a shorter folder")
    return path


def bind_name(socket: Path, pid: int) -> Path:
    """The name a worker binds and starts listening on before it links ``socket`` to it."""
    return socket.with_name(f"{socket.stem}.{pid}.new")


def info_path(socket: Path) -> Path:
    """The JSON file describing the worker that listens at ``socket`` (``node_worker list``)."""
    return socket.with_suffix(".json")


def send_frames(sock: socket.socket, header: Mapping[str, object], *blobs: bytes) -> None:
    """Send one frame set: the JSON header, then each blob (sent as it is: no copy of a large
    array's bytes)."""
    for part in (json.dumps({**header, "blobs": len(blobs)}).encode(), *blobs):
        length = _LENGTH.pack(len(part))
        if len(part) < _SMALL:
            sock.sendall(length + part)
        else:
            sock.sendall(length)
            sock.sendall(part)


def recv_frames(sock: socket.socket) -> tuple[dict, list[bytes]]:
    """Receive one frame set: (header, blobs); ChannelClosed if the other end closes first."""
    header = json.loads(_recv_part(sock, _MAX_HEADER))
    blobs = [_recv_part(sock, None) for _ in range(int(header.pop("blobs")))]
    return header, blobs


def _recv_part(sock: socket.socket, limit: int | None) -> bytes:
    (size,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    if limit is not None and size > limit:
        raise ValueError(f"a worker frame header of {size} bytes (at most {limit}): not this protocol")
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ChannelClosed(f"the other end closed the worker socket after {got} of {size} bytes")
        got += n
    return bytes(buffer)
