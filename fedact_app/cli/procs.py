"""Process trees on Linux (``/proc``), for stopping what a Flower process spawned: what is alive,
what descends from a pid, and signals that ignore processes already gone."""

from __future__ import annotations

import os
from pathlib import Path


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


def descendants(root: int) -> set[int]:
    """All current descendants of ``root`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*") if Path("/proc").is_dir() else ():
        try:
            ppid = int(Path(entry, "stat").read_text().rsplit(")", 1)[1].split()[1])
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
    return found
