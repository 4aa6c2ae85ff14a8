"""Vision data kept on disk between processes (``$FEDACT_CACHE_DIR``, default
``~/.cache/fedact``; an empty value turns it off): what a run derives deterministically and every
new process would otherwise compute again, the digits split (:mod:`.splits`) and the partitions
(:mod:`.partition`). Each file is a ``.npz`` whose name hashes what it depends on; a file that
cannot be read is computed again, and one that cannot be written is skipped with a warning."""

from __future__ import annotations

import os
import threading
import warnings
import zipfile
from pathlib import Path
from typing import Sequence

import numpy as np

CACHE_ENV = "FEDACT_CACHE_DIR"


def cache_folder(kind: str) -> Path | None:
    """``$FEDACT_CACHE_DIR/<kind>`` (default ``~/.cache/fedact/<kind>``): where data that a run
    derives deterministically (a digits split, a partition) is kept between processes; None when
    the variable is set to an empty value (the cache is off)."""
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
