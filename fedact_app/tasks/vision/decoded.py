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

An entry's name hashes each data file's path, size and modification time, the image and label
columns, the channels and image size, and the versions of Pillow and ``datasets``: files replaced
in place are decoded again. An entry holds the decoded size (Fashion-MNIST 55 MB, CIFAR-10 184 MB,
Tiny-ImageNet 1.35 GB). Hub datasets (``dataset.path`` null), ``digits`` and ``synthetic`` (arrays
already), image columns that hold arrays, and a cache turned off are read by
:func:`~.splits.load_splits` as they are.
"""

from __future__ import annotations

import glob
import hashlib
import os
from importlib.metadata import version
from pathlib import Path

import numpy as np

from fedact_app.config import DatasetConfig
from fedact_app.tasks.vision.cache import cache_folder, exclusive, read_cache_folder, write_cache_folder
from fedact_app.tasks.vision.splits import (
    ARRAY_DATASETS, LABEL, ArraySplit, Split, check_labels, labels_of, load_splits, local_data_files, resolve_path,
)
from fedact_app.tasks.vision.tensors import image_pixels

DECODED_FORMAT = 1  # raise it whenever the stored arrays are made differently
SPLITS = ("train", "test")


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
        with exclusive(path):
            stored = _read(path, cfg)
            if stored is None:
                return _decode_and_store(path, cfg, data_dir, seed)  # load_splits checked the labels
    for split_name, split in zip((cfg.train_split, cfg.test_split), stored):
        check_labels(split, cfg, split_name, label_column)
    return stored


def _entry(cfg: DatasetConfig) -> tuple[Path, str] | None:
    """Where the decoded splits of ``cfg``'s local files are kept and the name of their label
    column; None when they are not kept (see the module docstring) or the files cannot be listed
    (:func:`~.splits.load_splits` then names what is wrong)."""
    folder = cache_folder("decoded")
    if folder is None or cfg.path is None or cfg.name in ARRAY_DATASETS:
        return None
    try:
        builder, data_files = local_data_files(resolve_path(cfg.path), (cfg.train_split, cfg.test_split))
        files = []
        for split, names in data_files.items():
            if builder == "imagefolder":  # names: one recursive pattern, <path>/<split>/**
                names = sorted(f for f in glob.iglob(names[0], recursive=True) if os.path.isfile(f))
            for name in names:
                stat = os.stat(name)
                files.append((split, os.path.abspath(name), stat.st_size, stat.st_mtime_ns))
    except (OSError, ValueError):
        return None
    label_column = LABEL if builder == "imagefolder" else cfg.label_column
    settings = (DECODED_FORMAT, files, cfg.image_column, label_column, cfg.channels, cfg.image_size,
                version("pillow"), version("datasets"))
    digest = hashlib.sha256(repr(settings).encode()).hexdigest()[:32]
    return folder / f"{cfg.name}-{digest}", label_column


def _read(path: Path, cfg: DatasetConfig) -> tuple[ArraySplit, ArraySplit] | None:
    """The stored splits (memory-mapped); None when there are none or they do not fit ``cfg``."""
    names = [f"{split}_{array}" for split in SPLITS for array in ("images", "labels")]
    stored = read_cache_folder(path, names)
    if stored is None:
        return None
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    splits = tuple(ArraySplit(stored[f"{split}_images"], stored[f"{split}_labels"]) for split in SPLITS)
    for split in splits:
        if (split.images.dtype != np.uint8 or split.images.shape[1:] != shape
                or split.labels.dtype != np.int64 or split.labels.shape != split.images.shape[:1]):
            return None
    return splits


def _decode_and_store(path: Path, cfg: DatasetConfig, data_dir: str | None, seed: int) -> tuple[Split, Split]:
    """Both splits read by :func:`~.splits.load_splits` and decoded whole, stored at ``path``;
    the splits as loaded when their image column holds arrays rather than images."""
    loaded = load_splits(cfg, data_dir, seed)
    decoded = []
    for split in loaded:
        pixels = image_pixels(split, cfg)
        if pixels is None:
            return loaded
        decoded.append(ArraySplit(pixels, labels_of(split).astype(np.int64)))
    write_cache_folder(path, "Decoded image", **{f"{name}_{array}": getattr(split, array)
                                                 for name, split in zip(SPLITS, decoded)
                                                 for array in ("images", "labels")})
    return decoded[0], decoded[1]
