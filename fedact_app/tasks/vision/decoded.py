"""Vision data, step 1 for local image files: the splits of a ``dataset.path`` (parquet files or an
image folder) decoded once per machine and kept on disk (:func:`decoded_splits`).

Every process that reads encoded images (PNG, JPEG) pays for Hugging Face ``datasets``' import and
the files' read (about 1 s of CPU) and for decoding the rows it needs (Fashion-MNIST on this
project's 2-core machines: 0.17 s a 3,000-image partition, 0.65 s the test split). In a simulation
each Ray actor decodes again every partition it serves, in a deployment each message's ClientApp
its own. Instead, the first process to read a dataset decodes both splits whole, to uint8 pixels
at ``dataset.channels`` and ``dataset.image_size``, and keeps them in ``$FEDACT_CACHE_DIR/decoded``
(:mod:`.cache`); later processes map the files into memory, read only the rows they select and
never import ``datasets``. Processes that miss the entry at once wait for the first one's decode
(a file lock). The pixels, and so every tensor made from them, are those of a process that decodes
its rows itself.

An entry's name hashes each data file's path, size, inode, modification and change times, the
image and label columns, the channels and image size, and the versions of Pillow and ``datasets``:
files replaced or touched are decoded again (old entries stay until deleted; ``decoded/`` can be
deleted at any time). An entry holds the decoded size (Fashion-MNIST 55 MB, CIFAR-10 184 MB,
Tiny-ImageNet 1.35 GB); where the disk lacks that space, or the cache folder cannot be written or
locked, each process reads the files as before, with a warning. Hub datasets (``dataset.path``
null), ``digits`` and ``synthetic`` (arrays already), image columns that hold arrays, and a cache
turned off are read by :func:`~.splits.load_splits` as they are.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import PIL

from fedact_app.config import DatasetConfig
from fedact_app.tasks.vision.cache import (
    CACHE_ENV, cache_folder, exclusive, read_cache_folder, write_cache_folder,
)
from fedact_app.tasks.vision.splits import (
    ArraySplit, Split, check_labels, labels_of, load_splits, local_columns, local_data_files, resolve_path,
    split_files,
)
from fedact_app.tasks.vision.tensors import image_pixels

DECODED_FORMAT = 1  # raise it whenever the stored arrays are made differently
STORED = ("train", "test")  # the prefixes of an entry's files: train_images.npy, train_labels.npy, ...
WHAT = "Decoded image"


def decoded_splits(cfg: DatasetConfig, data_dir: str | None, seed: int) -> tuple[Split, Split]:
    """:func:`~.splits.load_splits`, with the splits of local image files read from their decoded
    copy on disk (made here by the first process that misses it) as :class:`~.splits.ArraySplit`
    of uint8 pixels; labels checked against ``dataset.num_classes`` either way."""
    entry = _entry(cfg)
    if entry is None or _holds_arrays(entry[0]):
        return load_splits(cfg, data_dir, seed)
    path, label_column = entry
    stored = _read(path, cfg)
    if stored is None:
        with exclusive(path, WHAT) as locked:
            if not locked:
                return load_splits(cfg, data_dir, seed)
            stored = _read(path, cfg)  # another process may have stored it while this one waited
            if stored is None:
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
    settings = (DECODED_FORMAT, files, columns, cfg.channels, cfg.image_size, versions)
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:32]
    return folder / f"{cfg.name}-{digest}", columns[1]


def _holds_arrays(path: Path) -> bool:
    """Whether an earlier process found the image column to hold arrays, not images."""
    return path.with_name(f"{path.name}.arrays").exists()


def _read(path: Path, cfg: DatasetConfig) -> tuple[ArraySplit, ArraySplit] | None:
    """The stored splits (memory-mapped); None when there are none or they do not fit ``cfg``."""
    stored = read_cache_folder(path, [f"{split}_{array}" for split in STORED for array in ("images", "labels")])
    if stored is None:
        return None
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    splits = tuple(ArraySplit(stored[f"{split}_images"], stored[f"{split}_labels"]) for split in STORED)
    for split in splits:
        if (split.all_images.dtype != np.uint8 or split.all_images.shape[1:] != shape
                or split.labels.dtype != np.int64 or split.labels.shape != split.all_images.shape[:1]):
            return None
    return splits


def _decode_and_store(path: Path, cfg: DatasetConfig, data_dir: str | None, seed: int) -> tuple[Split, Split]:
    """Both splits read by :func:`~.splits.load_splits`, decoded whole and stored at ``path``,
    then read back from there (mapped, not held in this process's memory). The splits as loaded
    where their image column holds arrays rather than images (remembered next to ``path``) or the
    disk lacks the room."""
    loaded = load_splits(cfg, data_dir, seed)
    needed = sum(len(split) for split in loaded) * (cfg.channels * cfg.image_size ** 2 + 8)
    free = shutil.disk_usage(path.parent).free
    if needed > free:
        warnings.warn(f"{WHAT} cache not written: it needs {needed / 2**20:.0f} MiB and {path.parent} has "
                      f"{free / 2**20:.0f} MiB free; free some, or set {CACHE_ENV} to another folder",
                      RuntimeWarning, stacklevel=3)
        return loaded
    decoded = {}
    for name, split in zip(STORED, loaded):
        pixels = image_pixels(split, cfg)
        if pixels is None:
            path.with_name(f"{path.name}.arrays").touch()
            return loaded
        decoded.update({f"{name}_images": pixels, f"{name}_labels": labels_of(split).astype(np.int64)})
    write_cache_folder(path, WHAT, **decoded)
    stored = _read(path, cfg)
    if stored is None:  # not written (warned): this process keeps the pixels it decoded
        return tuple(ArraySplit(decoded[f"{name}_images"], decoded[f"{name}_labels"]) for name in STORED)
    return stored
