"""Process trees on Linux (``/proc``), for stopping what a Flower process spawned: what is alive,
what descends from a pid, and signals that ignore processes already gone; and the malloc
settings the processes the app starts get (:func:`malloc_env`)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

# glibc's malloc serves an allocation above its mmap threshold (at most 32 MiB unless set) with
# fresh pages that fault in one by one, and gives freed memory at the heap's top back to the
# kernel: every message's arrays (ViT-Tiny's training message 32 MB, ResNet-18's 135 MB), pickled
# into Ray and out, packed and read, are copied into new memory each time, about 5 times slower
# than into memory kept from the last message (ViT-Tiny's message pickled in 17 against 3 ms on
# the 2-vCPU AMD EPYC VM). These settings keep it (docs/PERFORMANCE.md, "Fixed settings of the
# engine"); the two work only together.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}
# glibc 2.34 and before refuse an mmap threshold above 32 MiB without a word, and would keep only
# the trim threshold, which fixes the mmap threshold at 128 KiB: worse than their default. 2.36
# is the oldest measured to take it; older ones get nothing.
MALLOC_GLIBC = (2, 36)


def glibc_version() -> tuple[int, ...] | None:
    """This process's glibc version, e.g. ``(2, 36)``; None for another C library."""
    library = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None
    name, _, version = (library or "").partition(" ")
    try:
        return tuple(int(part) for part in version.split(".")[:2]) if name == "glibc" else None
    except ValueError:
        return None


def malloc_env(environ: Mapping[str, str]) -> dict[str, str]:
    """:data:`MALLOC_ENV` for the processes started with ``environ``, or {} where it would not
    work as measured: not glibc >= :data:`MALLOC_GLIBC` (this process's C library), or
    ``environ`` already says how malloc should behave (either variable, or a ``glibc.malloc.``
    entry of ``GLIBC_TUNABLES``: the user's choice is kept whole, not half overridden)."""
    version = glibc_version()
    if version is None or version < MALLOC_GLIBC:
        return {}
    if any(key in environ for key in MALLOC_ENV) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return {}
    return dict(MALLOC_ENV)


KILLED_WAIT = 5.0  # seconds to wait for processes to go after SIGKILL (stop_tree without grace, the MPS daemon)


def pid_alive(pid: int) -> bool:
    """True if ``pid`` names a live process (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return proc_state(pid) not in ("Z", "X", None) if Path("/proc").is_dir() else True


def proc_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (``R``, ``S``, ``Z``, ...), None if unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def kill_quietly(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``, ignoring processes that are gone or not ours."""
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# Start time of every process descendants() found, by pid: a pid noted earlier (a Ray worker,
# a run's flwr-simulation) may belong to another process by the time a tree is stopped. Linux
# reuses pids once pid_max (often 32768, threads included) is used up, which a test session or a
# sweep does within minutes; signalling a reused pid killed another engine's run.
_START_TIMES: dict[int, int] = {}


def start_time(pid: int) -> int | None:
    """When ``pid``'s process started (``/proc/<pid>/stat`` field 22, clock ticks after boot),
    None if it is gone, a zombie or unreadable: with the pid, it names one process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(root: int) -> set[int]:
    """All current descendants of ``root`` (Linux /proc; empty elsewhere); their start times are
    noted so that :func:`stop_tree` never signals another process given one of their pids."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*") if Path("/proc").is_dir() else ():
        try:
            fields = Path(entry, "stat").read_text().rsplit(")", 1)[1].split()
            ppid, started[int(entry.name)] = int(fields[1]), int(fields[19])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    _START_TIMES.update({pid: started[pid] for pid in found})
    return found


def same_process(pid: int) -> bool:
    """True if ``pid`` is alive and is the process :func:`descendants` found under that pid (any
    live process when that pid was never found, or without /proc)."""
    return pid_alive(pid) and (pid not in _START_TIMES or start_time(pid) in (_START_TIMES[pid], None))


def stop_tree(proc: subprocess.Popen, seen: set[int], grace: float) -> tuple[int, ...]:
    """Stop ``proc`` and every process it spawned; return all pids seen (``seen`` is updated).

    Daemons started under ``proc`` may live in their own process groups and outlive it. So:
    snapshot the tree (``seen`` may already hold processes noted earlier), SIGTERM ``proc``
    (SIGKILL after ``grace`` seconds), then SIGTERM and finally SIGKILL whatever of the tree, and
    of the tree's process groups, is left. With ``grace`` 0 every process gets SIGKILL only
    (nothing of theirs is worth waiting for), and the call returns once they are gone (at most
    :data:`KILLED_WAIT` seconds).
    """
    if proc.poll() is None:  # (the pid of a process that has exited may be reused)
        seen |= descendants(proc.pid)
        if grace > 0:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            seen |= descendants(proc.pid)
            proc.kill()
            proc.wait()
    if grace > 0:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not _signal_leftovers(seen, sig):
                break
            until = time.monotonic() + grace
            while time.monotonic() < until and any(same_process(p) for p in seen):
                time.sleep(0.1)
    else:  # again until none is left: one may fork between a snapshot and its parent's kill
        until = time.monotonic() + KILLED_WAIT
        while _signal_leftovers(seen, signal.SIGKILL) and time.monotonic() < until:
            time.sleep(0.02)
    return tuple(sorted(seen | {proc.pid}))


def _signal_leftovers(seen: set[int], sig: int) -> bool:
    own_group = os.getpgrp()
    alive = [p for p in seen if same_process(p)]
    groups = {g for p in alive if (g := _pgid(p)) is not None and g != own_group}
    for pid in alive:  # their children too, before they are re-parented away
        seen |= descendants(pid)
    for target in sorted(seen):
        if same_process(target):
            kill_quietly(target, sig)
    for group in groups:
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return bool(alive)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None
