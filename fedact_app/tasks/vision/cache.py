"""Vision data kept on disk between processes (``$FEDACT_CACHE_DIR``, default
``~/.cache/fedact``; an empty value turns it off): what a run derives deterministically and every
new process would otherwise compute again, the digits split (:mod:`.splits`), the partitions
(:mod:`.partition`) and the decoded images of local data (:mod:`.decoded`). Each entry is a
``.npz`` file, or a folder of ``.npy`` files that are mapped into memory, named by a hash of what it
depends on; an entry that cannot be read is computed again, and one that cannot be written is
skipped with a warning."""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

CACHE_ENV = "FEDACT_CACHE_DIR"


def cache_folder(kind: str) -> Path | None:
    """``$FEDACT_CACHE_DIR/<kind>`` (default ``~/.cache/fedact/<kind>``): where data that a run
    derives deterministically (a digits split, a partition, decoded images) is kept between
    processes; None when the variable is set to an empty value (the cache is off). Every entry can
    be deleted at any time: it is computed again."""
    root = os.environ.get(CACHE_ENV, os.path.join("~", ".cache", "fedact"))
    return Path(root).expanduser() / kind if root else None


def read_cache_file(path: Path | None, names: Sequence[str]) -> dict[str, np.ndarray] | None:
    """The arrays ``names`` of the ``.npz`` file at ``path``; None when there is no such file or
    it cannot be read (the caller computes them again)."""
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path) as stored:
            return {name: stored[name] for name in names}
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile):  # TypeError: a .npy file
        return None


def write_cache_file(path: Path | None, what: str, **arrays: np.ndarray) -> None:
    """Store ``arrays`` at ``path`` atomically (processes computing them at once write the same
    file); a cache that cannot be written is skipped with a warning naming ``what``."""
    if path is None:
        return
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as file:
            np.savez(file, **arrays)
        os.replace(partial, path)
    except OSError as exc:
        partial.unlink(missing_ok=True)
        warnings.warn(f"{what} cache not written ({exc}); set {CACHE_ENV} to a writable folder, or to an "
                      "empty value to turn the cache off", RuntimeWarning, stacklevel=3)


def read_cache_folder(path: Path | None, names: Sequence[str]) -> dict[str, np.ndarray] | None:
    """The arrays ``<path>/<name>.npy``, mapped into memory read-only (a process reads only the
    rows it indexes); None when the folder is missing or a file cannot be read."""
    if path is None or not path.is_dir():
        return None
    try:
        return {name: np.load(path / f"{name}.npy", mmap_mode="r") for name in names}
    except (OSError, ValueError):
        return None


def write_cache_folder(path: Path, fill: Callable[[Path], None]) -> OSError | None:
    """The folder ``path``: ``fill(folder)`` writes its ``.npy`` files into a new folder that
    then takes the place of ``path`` (replacing a damaged one); the OSError where that fails
    (nothing is left behind; any other exception of ``fill`` is raised, nothing left behind
    either). Call it holding :func:`exclusive` for ``path``."""
    for left in path.parent.glob(f"{glob.escape(path.name)}.*.partial"):  # from writers that were killed
        shutil.rmtree(left, ignore_errors=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        partial.mkdir(parents=True)
        fill(partial)
        if path.exists():
            shutil.rmtree(path)
        os.rename(partial, path)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        return exc
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return None


def write_npy_rows(path: Path, dtype: npt.DTypeLike, shape: tuple[int, ...], blocks: Iterable[np.ndarray]) -> None:
    """Write the ``.npy`` file of an array of ``shape`` and ``dtype`` from its consecutive blocks
    of rows, one at a time (the file ``np.save`` writes for their concatenation), so that the
    whole array is never in memory. Plain writes, not a writable memory map: a full disk or a
    quota then raises OSError instead of killing the process with SIGBUS. ValueError when a block
    has another dtype or row shape, or the blocks do not make up exactly ``shape``."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    rows = 0
    with open(path, "wb") as file:
        np.lib.format.write_array_header_1_0(
            file, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape})
        for block in blocks:
            if block.dtype != dtype or block.shape[1:] != shape[1:] or rows + len(block) > shape[0]:
                raise ValueError(f"a block {block.dtype} {block.shape} after {rows} rows, for an array "
                                 f"{dtype} {shape}")
            file.write(np.ascontiguousarray(block).reshape(-1).view(np.uint8))  # its bytes
            rows += len(block)
    if rows != shape[0]:
        raise ValueError(f"{rows} rows written to {path} for an array of {shape[0]}")


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[OSError | None]:
    """Hold ``<path>.lock`` (``flock``; released when the holder exits, however it exits) while
    the body runs, so that processes which all miss the same entry compute it once: the others
    wait, then read it. Yields None while the lock is held, or the error where the lock file
    cannot be made or the file system refuses locks (the caller should then not compute the
    entry)."""
    lock, error = None, None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_name(f"{path.name}.lock"), "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as exc:  # a folder that is not writable; ENOLCK or EOPNOTSUPP from the file system
        error = exc
    if error is not None:  # (the body runs outside the except: its errors are not chained to this one)
        if lock is not None:
            lock.close()
        yield error
        return
    with lock:
        yield None
