"""Vision data, step 1 for local image files: the splits of a ``dataset.path`` (parquet files or an
image folder) decoded once per machine and kept on disk (:func:`decoded_splits`).

Every process that reads encoded images (PNG, JPEG) pays for Hugging Face ``datasets``' import and
the files' read (about 1 s of CPU) and for decoding the rows it needs (Fashion-MNIST on this
project's 2-core machines: 0.17 s a 3,000-image partition, 0.65 s the test split). In a simulation
each Ray actor decodes again every partition it serves, in a deployment each message's ClientApp
its own. Instead, the first process to read a dataset decodes both splits whole, to uint8 pixels
at ``dataset.channels`` and ``dataset.image_size``, and keeps them in ``$FEDACT_CACHE_DIR/decoded``
(:mod:`.cache`; written a block of rows at a time, so that its memory does not grow with the data
set); later processes map the files into memory, read only the rows they select and do
not import ``datasets`` for them. Processes that miss the entry at once wait for the first one's
decode (a file lock). The pixels, and so every tensor made from them, are those of a process that
decodes its rows itself.

An entry's name is ``<dataset>-<source>-<state>``: ``source`` hashes the data's path, its split
names and columns, the channels and image size, the versions of Pillow and ``datasets`` and
:data:`DECODED_FORMAT`; ``state`` hashes each data file's path, size, inode, modification and
change times. Files replaced or touched are decoded again, and the new entry takes the place of
the old one (entries of another source, e.g. of an older Pillow, stay until deleted). An entry holds the
decoded size, N x (C x S x S + 8) bytes (Fashion-MNIST 55 MB, CIFAR-10 185 MB, Tiny-ImageNet
1.35 GB); ``decoded/`` can be deleted at any time. Where the cache folder cannot be locked, or an
entry cannot be written (the disk lacks its size and 1 GiB to spare, a quota, an I/O error), the
process warns and reads the files as before; after a failed write a note ``<entry>.unwritable``
says why, and later processes read the files as before without trying again (delete the note to
try again). Hub datasets (``dataset.path`` null), ``digits`` and ``synthetic`` (arrays already),
image columns that hold arrays (noted as ``<entry>.arrays``) and a cache turned off are read by
:func:`~.splits.load_splits` as they are.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import warnings
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import PIL

from fedact_app.config import DatasetConfig
from fedact_app.tasks.vision.cache import (
    CACHE_ENV, cache_folder, exclusive, read_cache_folder, write_cache_folder, write_npy_rows,
)
from fedact_app.tasks.vision.splits import (
    ArraySplit, Split, check_labels, labels_of, load_splits, local_columns, local_data_files, resolve_path,
    split_files,
)
from fedact_app.tasks.vision.tensors import image_chunks

DECODED_FORMAT = 1  # raise it whenever the stored arrays are made differently
STORED = ("train", "test")  # the prefixes of an entry's files: train_images.npy, train_labels.npy, ...
SPARE_BYTES = 2**30  # left free on the disk after an entry is written (checkpoints, logs)
NOTES = (".arrays", ".unwritable")  # next to an entry: read the files with load_splits, do not decode


def decoded_splits(cfg: DatasetConfig, data_dir: str | None, seed: int) -> tuple[Split, Split]:
    """:func:`~.splits.load_splits`, with the splits of local image files read from their decoded
    copy on disk (made here by the first process that misses it) as :class:`~.splits.ArraySplit`
    of uint8 pixels; labels checked against ``dataset.num_classes`` either way."""
    entry = _entry(cfg)
    if entry is None:
        return load_splits(cfg, data_dir, seed)
    path, label_column = entry
    stored = _read(path, cfg)
    if stored is None:
        if _noted(path):
            return load_splits(cfg, data_dir, seed)
        with exclusive(path) as lock_error:
            if lock_error is not None:
                _warn(cfg, f"the lock {path}.lock cannot be taken: {lock_error}; set {CACHE_ENV} to a local "
                      "folder that supports file locks, or to an empty value", stacklevel=3)
                return load_splits(cfg, data_dir, seed)
            stored = _read(path, cfg)  # another process may have stored it, or noted why not, meanwhile
            if stored is None:
                if _noted(path):
                    return load_splits(cfg, data_dir, seed)
                return _decode_and_store(path, cfg, data_dir, seed)  # (load_splits checks the labels)
    for split_name, split in zip((cfg.train_split, cfg.test_split), stored):
        check_labels(split, cfg, split_name, label_column)
    return stored


def _entry(cfg: DatasetConfig) -> tuple[Path, str] | None:
    """Where the decoded splits of ``cfg``'s local files are kept and the name of their label
    column; None when they are not kept (see the module docstring) or the files cannot be listed
    (:func:`~.splits.load_splits` then names what is wrong)."""
    folder = cache_folder("decoded")
    if folder is None or cfg.path is None:
        return None
    try:
        builder, data_files = local_data_files(resolve_path(cfg.path), (cfg.train_split, cfg.test_split))
        files = []
        for split, names in data_files.items():
            for name in split_files(builder, names):
                stat = os.stat(name)
                files.append((split, os.path.abspath(name), stat.st_size, stat.st_ino, stat.st_mtime_ns,
                              stat.st_ctime_ns))
        versions = (PIL.__version__, version("datasets"))
    except (OSError, ValueError, PackageNotFoundError):
        return None
    columns = local_columns(builder, cfg)
    source = (DECODED_FORMAT, resolve_path(cfg.path), cfg.train_split, cfg.test_split, columns, cfg.channels,
              cfg.image_size, versions)
    return folder / f"{cfg.name}-{_digest(source)}-{_digest(files)}", columns[1]


def _digest(value: object) -> str:
    """A short hash of ``repr(value)``."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:24]


def _noted(path: Path) -> bool:
    """Whether a note next to the entry at ``path`` says to read the files with load_splits."""
    try:
        return any(_note(path, kind).exists() for kind in NOTES)
    except OSError:  # a cache folder this process may not read
        return True


def _note(path: Path, kind: str) -> Path:
    """The note of ``kind`` (one of :data:`NOTES`) next to the entry at ``path``."""
    return path.with_name(path.name + kind)


def _read(path: Path, cfg: DatasetConfig) -> tuple[ArraySplit, ArraySplit] | None:
    """The stored splits (memory-mapped); None when there are none or they do not fit ``cfg``."""
    stored = read_cache_folder(path, [f"{split}_{array}" for split in STORED for array in ("images", "labels")])
    if stored is None:
        return None
    splits = tuple(ArraySplit(stored[f"{split}_images"], stored[f"{split}_labels"]) for split in STORED)
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    for split in splits:
        if (split.all_images.dtype != np.uint8 or split.all_images.shape[1:] != shape
                or split.labels.dtype != np.int64 or split.labels.shape != split.all_images.shape[:1]):
            return None
    return splits


def _decode_and_store(path: Path, cfg: DatasetConfig, data_dir: str | None, seed: int) -> tuple[Split, Split]:
    """Both splits read by :func:`~.splits.load_splits`, decoded whole into files at ``path`` a
    block of rows at a time (this process never holds a whole split's pixels), then read back from
    there (mapped); first the entries of the same source's other states are removed. With a note
    next to ``path``, the splits as loaded: where their image column holds arrays rather than
    images, the disk lacks the room or the write fails."""
    loaded = load_splits(cfg, data_dir, seed)
    _remove_other_states(path, cfg)
    needed = sum(len(split) for split in loaded) * (cfg.channels * cfg.image_size ** 2 + 8)  # + the int64 label
    free = shutil.disk_usage(path.parent).free
    if needed + SPARE_BYTES > free:
        _not_written(path, cfg, f"it needs {needed / 2**20:.0f} MiB and {path.parent} has {free / 2**20:.0f} "
                     f"MiB free, of which {SPARE_BYTES // 2**20} MiB are kept spare")
        return loaded
    pixels = [image_chunks(split, cfg) for split in loaded]
    if any(chunks is None for chunks in pixels):
        _write_note(path, ".arrays", "the image column holds arrays, not images")
        return loaded

    def fill(folder: Path) -> None:
        for name, split, chunks in zip(STORED, loaded, pixels):
            write_npy_rows(folder / f"{name}_images.npy", np.uint8,
                           (len(split), cfg.channels, cfg.image_size, cfg.image_size), _decoding(chunks))
            np.save(folder / f"{name}_labels.npy", labels_of(split).astype(np.int64))

    try:
        error = write_cache_folder(path, fill)
    except _DecodeError as exc:
        raise exc.__cause__ from None  # an image that cannot be decoded, as without the cache (PIL's OSError)
    stored = None if error else _read(path, cfg)
    if stored is None:
        _not_written(path, cfg, str(error or "it cannot be read back"))
        return loaded
    return stored


class _DecodeError(Exception):
    """An error decoding the images, carried out of the cache's write, which takes every OSError
    for a failed write (PIL's errors for a damaged file are OSErrors)."""


def _decoding(chunks: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
    """``chunks``, their decoding errors raised as :class:`_DecodeError`."""
    try:
        yield from chunks
    except OSError as exc:
        raise _DecodeError from exc


def _remove_other_states(path: Path, cfg: DatasetConfig) -> None:
    """Remove the entries of the files' other states, their notes and their writers' unfinished
    folders, as long as the files are still in the state ``path`` names: a process that saw them
    before they changed must not remove the entry of their new state. A process still reading a
    removed entry keeps its mapping."""
    current = _entry(cfg)
    if current is None or current[0] != path:
        return
    source = path.name.rsplit("-", 1)[0]
    for other in path.parent.glob(f"{glob.escape(source)}-*"):
        if other.name.startswith(path.name) or other.name.endswith(".lock"):
            continue  # this state's; a lock another process may hold (an empty file)
        if other.is_dir():
            shutil.rmtree(other, ignore_errors=True)
        else:
            other.unlink(missing_ok=True)


def _not_written(path: Path, cfg: DatasetConfig, reason: str) -> None:
    """Warn that the entry at ``path`` is not written, and note it so that later processes do not
    decode the whole data set again only to fail the same way."""
    _warn(cfg, f"{path} cannot be written ({reason}); later processes read the files as before "
          f"(delete {_note(path, '.unwritable')} to try again, or set {CACHE_ENV} to another folder)",
          stacklevel=5)
    _write_note(path, ".unwritable", reason)


def _write_note(path: Path, kind: str, reason: str) -> None:
    """Leave the note of ``kind`` next to the entry at ``path``, saying ``reason``."""
    try:
        _note(path, kind).write_text(reason + "\n")
    except OSError:  # then every process tries again
        pass


def _warn(cfg: DatasetConfig, message: str, stacklevel: int) -> None:
    """A warning; ``stacklevel`` points it at the caller of :func:`decoded_splits`."""
    warnings.warn(f"Decoded images of dataset.path={cfg.path!r} not kept on disk: {message}", RuntimeWarning,
                  stacklevel=stacklevel)
