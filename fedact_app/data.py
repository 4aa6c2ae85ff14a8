"""Vision data: load the splits, partition the training set over clients, serve batches.

Everything a client trains on passes through four steps, each a function here:

1. :func:`load_splits` - the train and test splits as Hugging Face ``datasets.Dataset`` objects
   with two columns, ``image`` and ``label`` (renamed from ``dataset.image_column`` /
   ``dataset.label_column``), labels checked to lie in ``[0, num_classes)``.
2. :func:`holdout_rows` (only when ``dataset.holdout_fraction`` > 0) - a seed-fixed slice of the
   training split held out as the server's validation set, removed before partitioning.
   :func:`partition_indices` - which training rows each client holds (flwr-datasets'
   ``IidPartitioner`` or ``DirichletPartitioner``), deterministic for the run's seed, so every
   process computes the same partition without talking to the others.
3. :func:`load_client_train` / :func:`load_test` (/ :func:`load_validation`) - decode only the rows needed into an
   :class:`ImageTensors` (float32, resized to ``dataset.image_size``, normalized with the
   dataset's mean/std), cached per process: in simulation one process serves many clients.
4. :class:`BatchStream` / :func:`test_batches` - batches from tensors already on the training
   device; augmentation (random crop + horizontal flip) runs there as tensor ops.

Sources (``dataset.name`` / ``dataset.path`` / ``dataset.hub_path``):

- ``digits``: scikit-learn's ``load_digits()`` (1,797 real 8x8 digits shipped in the wheel),
  pixel values / 16 in [0, 1], split 80/20 stratified with a fixed ``random_state``
  (:data:`DIGITS_SPLIT_SEED`, independent of the run's seed so every run tests on the same 360).
- ``synthetic``: class-conditional images, one random mean pattern per class plus Gaussian noise,
  clipped to [0, 1]; deterministic for the seed; learnable (for tests and smoke runs).
- hub datasets (``dataset.path`` null): ``datasets.load_dataset(dataset.hub_path)`` with
  ``cache_dir=data_dir``. Offline without a cached copy this raises
  :class:`DatasetUnavailableError`.
- ``dataset.path`` set: local data in one of the layouts below, read with the same column names as
  the hub dataset (``dataset.image_column`` / ``dataset.label_column``):

  - a folder of parquet files named by split: ``<path>/<split>*.parquet``, e.g. ``train.parquet``,
    ``test-00000-of-00001.parquet`` (or one level down, as in a clone of a hub repository:
    ``<path>/data/<split>-*.parquet``);
  - a folder with one sub-folder of parquet files per split: ``<path>/<split>/*.parquet``;
  - one parquet file per split given by a pattern with ``{split}``: ``/data/c10-{split}.parquet``;
  - the training split's parquet file, e.g. ``/data/train.parquet``: the test file is the sibling
    whose name has the test split's name in place of the train split's (``/data/test.parquet``);
  - an image folder: ``<path>/<split>/<class name>/<image files>`` for the train and test split
    (``datasets``' ``imagefolder``). Class ids follow the sorted class-folder names, and the
    columns are always ``image``/``label`` (``image_column``/``label_column`` are not used).

Images are decoded to ``dataset.channels`` (grayscale images of an RGB dataset such as
Tiny-ImageNet are converted to RGB) and resized (bilinear) when their size differs from
``dataset.image_size``. Non-image columns (``digits``, ``synthetic``) hold float arrays in [0, 1]
shaped (C, H, W).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import os
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedact_app.compat import ensure_torchvision_ops

ensure_torchvision_ops()  # datasets may import torchvision; keep it importable on the CPU torch

import datasets  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from PIL import Image  # noqa: E402

from fedact_app.config import Config, ConfigError, DatasetConfig, PartitionConfig  # noqa: E402

DIGITS_SPLIT_SEED = 0  # fixed: the digits train/test split never depends on the run's seed
DIGITS_TEST_FRACTION = 0.2
SYNTHETIC_NOISE_STD = 0.3
IMAGE = "image"
LABEL = "label"


class DatasetUnavailableError(RuntimeError):
    """A hub dataset could not be loaded (offline, or not in the cache)."""


# ----------------------------------------------------------------------------------------------
# In-memory splits


@dataclass
class ImageTensors:
    """A split held in memory: normalized float32 images (N, C, H, W) and int64 labels (N,).

    Cached instances are shared between callers: treat the tensors as read-only.
    """

    images: Tensor
    labels: Tensor

    def to(self, device: torch.device | str) -> "ImageTensors":
        """The same data on ``device`` (no copy where it is already there)."""
        return ImageTensors(self.images.to(device), self.labels.to(device))

    def __len__(self) -> int:
        return int(self.labels.shape[0])


# ----------------------------------------------------------------------------------------------
# Loading the splits


def load_splits(
    cfg: DatasetConfig, data_dir: str | None = None, seed: int = 42
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """The train and test splits with columns ``image`` and ``label``, labels validated.

    ``data_dir`` is the Hugging Face datasets cache (None: its default). ``seed`` only affects
    ``synthetic``. See the module docstring for the accepted sources and local layouts.
    """
    columns = (IMAGE, LABEL)
    if cfg.name == "digits":
        train, test = _digits_splits()
    elif cfg.name == "synthetic":
        train, test = _synthetic_splits(cfg, seed)
    else:
        train, test, columns = _load_external(cfg, _resolve(data_dir))
        train = _normalize_columns(train, columns, cfg, cfg.train_split)
        test = _normalize_columns(test, columns, cfg, cfg.test_split)
    for split_name, split in ((cfg.train_split, train), (cfg.test_split, test)):
        _check_labels(split, cfg, split_name, columns[1])
    return train, test


def _resolve(path: str | None) -> str | None:
    """An absolute path (``~`` expanded), or None."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def _digits_splits() -> tuple[datasets.Dataset, datasets.Dataset]:
    """scikit-learn's digits as (1, 8, 8) float images in [0, 1], stratified 80/20 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    labels = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=DIGITS_TEST_FRACTION, stratify=labels, random_state=DIGITS_SPLIT_SEED
    )
    return _array_dataset(x_tr, y_tr), _array_dataset(x_te, y_te)


def _synthetic_splits(cfg: DatasetConfig, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Class-conditional images: a random mean pattern per class plus noise, clipped to [0, 1]."""
    means_seq, train_seq, test_seq = np.random.SeedSequence(seed % 2**63).spawn(3)
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    means = np.random.default_rng(means_seq).uniform(0.0, 1.0, (cfg.num_classes, *shape))

    def sample(seq: np.random.SeedSequence, n: int) -> datasets.Dataset:
        rng = np.random.default_rng(seq)
        labels = rng.permutation(np.arange(n) % cfg.num_classes).astype(np.int64)
        noise = rng.normal(0.0, SYNTHETIC_NOISE_STD, (n, *shape))
        images = np.clip(means[labels] + noise, 0.0, 1.0).astype(np.float32)
        return _array_dataset(images, labels)

    return sample(train_seq, cfg.num_train), sample(test_seq, cfg.num_test)


def _array_dataset(images: np.ndarray, labels: np.ndarray) -> datasets.Dataset:
    """A Dataset of float (C, H, W) image arrays and int64 labels."""
    features = datasets.Features(
        {IMAGE: datasets.Array3D(shape=images.shape[1:], dtype="float32"), LABEL: datasets.Value("int64")}
    )
    return datasets.Dataset.from_dict({IMAGE: images, LABEL: labels}, features=features)


def _load_external(
    cfg: DatasetConfig, data_dir: str | None
) -> tuple[datasets.Dataset, datasets.Dataset, tuple[str, str]]:
    """The raw train/test splits from ``cfg.path`` if set, else from the hub, and their
    (image, label) column names: the configured ones, or ``image``/``label`` for an image folder."""
    splits = (cfg.train_split, cfg.test_split)
    columns = (cfg.image_column, cfg.label_column)
    if cfg.path is None:
        loaded = _load_hub(cfg, data_dir)
        source = f"hub dataset '{cfg.hub_path}'"
    else:
        builder, data_files = _local_data_files(_resolve(cfg.path), splits)
        loaded = datasets.load_dataset(builder, data_files=data_files, cache_dir=data_dir)
        source = f"dataset.path={cfg.path!r}"
        if builder == "imagefolder":
            columns = (IMAGE, LABEL)
    missing = [s for s in splits if s not in loaded]
    if missing:
        raise ValueError(
            f"The {source} has no split(s) {missing}; it has {sorted(loaded)}. "
            "Set dataset.train_split / dataset.test_split to existing splits."
        )
    return loaded[cfg.train_split], loaded[cfg.test_split], columns


def _load_hub(cfg: DatasetConfig, data_dir: str | None) -> datasets.DatasetDict:
    """``load_dataset(cfg.hub_path)``; any I/O failure becomes a DatasetUnavailableError."""
    if not cfg.hub_path:
        raise ValueError(f"dataset {cfg.name!r} has neither dataset.path nor dataset.hub_path set.")
    try:
        return datasets.load_dataset(cfg.hub_path, cache_dir=data_dir)
    except OSError as exc:  # ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        raise DatasetUnavailableError(_unavailable_message(cfg, data_dir, exc)) from exc


def _unavailable_message(cfg: DatasetConfig, data_dir: str | None, exc: Exception) -> str:
    """One paragraph: what failed, why it probably did, and how to use local data instead."""
    cache = data_dir or "the default Hugging Face cache"
    return (
        f"Could not load the Hugging Face dataset '{cfg.hub_path}' (dataset={cfg.name}) from the hub "
        f"or from {cache}: {type(exc).__name__}: {exc}. This machine may be offline (or "
        "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE are set) and the dataset is not cached. Download it once "
        "where there is internet into the cache given by data_dir, or use local data with "
        "`dataset.path=<local parquet folder or image folder>`: parquet files for the splits "
        f"'{cfg.train_split}' and '{cfg.test_split}' with an image column '{cfg.image_column}' and "
        f"an integer label column '{cfg.label_column}' (values in [0, {cfg.num_classes})), or an "
        f"image folder <path>/{cfg.train_split}/<class>/* and <path>/{cfg.test_split}/<class>/*."
    )


def _local_data_files(path: str, splits: Sequence[str]) -> tuple[str, dict[str, list[str]]]:
    """The ``load_dataset`` builder ("parquet" or "imagefolder") and data files per split."""
    if "{split}" in path:
        return "parquet", {s: _existing_files(path.format(split=s), path) for s in splits}
    root = Path(path)
    if root.is_file():
        return "parquet", _sibling_split_files(root, splits)
    if not root.is_dir():
        raise FileNotFoundError(f"dataset.path={path!r} does not exist (expected a parquet file or folder, "
                                "or an image folder; see fedact_app/data.py)")
    if all((root / s).is_dir() for s in splits):
        if all(glob.glob(str(root / s / "*.parquet")) for s in splits):
            return "parquet", {s: sorted(glob.glob(str(root / s / "*.parquet"))) for s in splits}
        return "imagefolder", {s: [str(root / s / "**")] for s in splits}
    return "parquet", {s: _split_parquet_files(root, s) for s in splits}


def check_local_path(cfg: DatasetConfig) -> None:
    """Refuse a ``dataset.path`` the run could not read, without loading any data (milliseconds):
    ConfigError naming it when it fits none of the layouts above, when a split of an image folder
    holds no file, or when a parquet file's footer cannot be read (a truncated or non-parquet
    file). The launcher calls it before starting a SuperLink: in simulation every ClientApp reads
    this path on the same machine. ``compose()`` does not, since on a SuperNode the path names
    that node's files."""
    try:
        builder, data_files = _local_data_files(_resolve(cfg.path), (cfg.train_split, cfg.test_split))
        for split, files in data_files.items():
            if builder == "imagefolder":  # files: one recursive pattern, <path>/<split>/**
                if not any(os.path.isfile(f) for f in glob.iglob(files[0], recursive=True)):
                    raise FileNotFoundError(f"the image folder's {split!r} split holds no files")
                continue
            for file in files:
                _read_parquet_footer(file)
    except (OSError, ValueError) as err:  # the layout's FileNotFoundError / ValueError, the footer's
        raise ConfigError(f"Invalid config value dataset.path={cfg.path!r}: allowed a parquet file, a folder "
                          f"of parquet files or an image folder that can be read (fedact_app/data.py); {err}"
                          ) from None


def _read_parquet_footer(file: str) -> None:
    """Read only ``file``'s parquet footer (schema, row groups); ValueError naming it if that fails."""
    try:
        pq.read_metadata(file)
    except (OSError, ValueError) as err:  # pyarrow: ArrowInvalid is a ValueError, ArrowIOError an OSError
        raise ValueError(f"{file} is not a readable parquet file: {err}") from None


def _existing_files(pattern: str, path: str) -> list[str]:
    """The files matching ``pattern``; a clear error naming ``dataset.path`` if none do."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"dataset.path={path!r}: no file matches {pattern!r}")
    return files


def _sibling_split_files(train_file: Path, splits: Sequence[str]) -> dict[str, list[str]]:
    """Files per split from the train split's parquet file (its name holds the split's name)."""
    train_split = splits[0]
    if train_file.suffix != ".parquet" or train_split not in train_file.name:
        raise ValueError(
            f"dataset.path={str(train_file)!r} is a file: it must be the '{train_split}' split's "
            f".parquet file with '{train_split}' in its name (or use a folder, or a pattern with "
            "'{split}')."
        )
    head, _, tail = train_file.name.rpartition(train_split)
    files = {s: train_file.with_name(f"{head}{s}{tail}") for s in splits}
    for split, file in files.items():
        if not file.is_file():
            raise FileNotFoundError(f"dataset.path={str(train_file)!r}: the {split!r} split's file "
                                    f"{str(file)!r} does not exist")
    return {s: [str(f)] for s, f in files.items()}


def _split_parquet_files(root: Path, split: str) -> list[str]:
    """``<root>/<split>*.parquet``, else ``<root>/*/<split>*.parquet``; clear error if neither."""
    for pattern in (root / f"{split}*.parquet", root / "*" / f"{split}*.parquet"):
        files = sorted(glob.glob(str(pattern)))
        if files:
            return files
    raise FileNotFoundError(
        f"dataset.path={str(root)!r}: no parquet files for split {split!r} (looked for "
        f"{split}*.parquet, */{split}*.parquet, {split}/*.parquet) and it is not an image folder "
        f"with {split}/<class>/ sub-folders"
    )


def _normalize_columns(
    ds: datasets.Dataset, columns: tuple[str, str], cfg: DatasetConfig, split: str
) -> datasets.Dataset:
    """Keep only the (image, label) ``columns``, renamed to ``image`` and ``label``."""
    for column, role in zip(columns, ("image_column", "label_column")):
        if column not in ds.column_names:
            raise ValueError(
                f"dataset.{role}={column!r} is not a column of the {split!r} split of dataset "
                f"{cfg.name!r}; its columns are {ds.column_names}"
            )
    ds = ds.select_columns(list(columns))
    renames = {old: new for old, new in zip(columns, (IMAGE, LABEL)) if old != new}
    return ds.rename_columns(renames) if renames else ds


def _check_labels(ds: datasets.Dataset, cfg: DatasetConfig, split: str, column: str) -> None:
    """Labels must be integers in [0, num_classes): clear error naming the column and value."""
    labels = _labels_of(ds)
    where = f"Label column '{column}' of the {split!r} split of dataset {cfg.name!r}"
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{where} holds {labels.dtype} values; integer class ids are required")
    bad = labels[(labels < 0) | (labels >= cfg.num_classes)]
    if bad.size:
        raise ValueError(
            f"{where} holds the label {bad[0]}, outside [0, {cfg.num_classes}) "
            f"(dataset.num_classes={cfg.num_classes}); {bad.size} of {labels.size} labels are out of range"
        )


def _labels_of(ds: datasets.Dataset) -> np.ndarray:
    """The label column as a numpy array (respecting any row selection)."""
    return np.asarray(ds.with_format("numpy", columns=[LABEL])[:][LABEL])


# ----------------------------------------------------------------------------------------------
# Decoding to tensors


def to_image_tensors(ds: datasets.Dataset, cfg: DatasetConfig) -> ImageTensors:
    """Decode a split (columns ``image``/``label``) into normalized float32 tensors."""
    images = _decode_images(ds, cfg)
    images = _resize(images, cfg.image_size)
    mean = torch.tensor(cfg.mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(cfg.std, dtype=torch.float32).view(-1, 1, 1)
    labels = torch.from_numpy(_labels_of(ds).astype(np.int64))
    return ImageTensors(((images - mean) / std).contiguous(), labels)


def _decode_images(ds: datasets.Dataset, cfg: DatasetConfig) -> Tensor:
    """(N, C, H, W) float32 in [0, 1], from PIL images or from float (C, H, W) arrays."""
    feature = ds.features[IMAGE]
    if isinstance(feature, dict) and "bytes" in feature:  # parquet written without HF metadata
        ds = ds.cast_column(IMAGE, datasets.Image())
        feature = ds.features[IMAGE]
    if not isinstance(feature, datasets.Image):
        return _array_images(ds, cfg)
    chunks = [_pil_batch(batch[IMAGE], cfg) for batch in ds.select_columns([IMAGE]).iter(batch_size=1024)]
    return torch.cat(chunks) if chunks else torch.empty(0, cfg.channels, cfg.image_size, cfg.image_size)


def _array_images(ds: datasets.Dataset, cfg: DatasetConfig) -> Tensor:
    """Float image arrays (N, C, H, W) or (N, H, W), checked against ``cfg.channels``."""
    images = torch.as_tensor(np.asarray(ds.with_format("numpy", columns=[IMAGE])[:][IMAGE], dtype=np.float32))
    if images.dim() == 3:
        images = images.unsqueeze(1)
    if images.dim() != 4 or images.shape[1] != cfg.channels:
        raise ValueError(f"Image arrays of dataset {cfg.name!r} have shape {tuple(images.shape[1:])}; "
                         f"expected ({cfg.channels}, H, W)")
    return images


def _pil_batch(images: list[Any], cfg: DatasetConfig) -> Tensor:
    """PIL images -> (B, C, S, S) float32 in [0, 1]: mode converted, resized to S if needed."""
    mode = "RGB" if cfg.channels == 3 else "L"
    size = (cfg.image_size, cfg.image_size)
    arrays = []
    for image in images:
        image = image.convert(mode)
        if image.size != size:
            image = image.resize(size, Image.BILINEAR)
        arrays.append(np.asarray(image, dtype=np.uint8).reshape(cfg.image_size, cfg.image_size, cfg.channels))
    batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2)
    return batch.float().div_(255.0)


def _resize(images: Tensor, size: int) -> Tensor:
    """Bilinear resize of an (N, C, H, W) batch to (size, size) when it is not that size."""
    if images.shape[-2:] == (size, size) or images.shape[0] == 0:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


# ----------------------------------------------------------------------------------------------
# Partitioning


def partition_indices(
    labels: Sequence[int] | np.ndarray, num_partitions: int, cfg: PartitionConfig, seed: int
) -> list[np.ndarray]:
    """Row indices of every partition of a training set with these labels (fresh int64 arrays).

    ``iid``: flwr-datasets' ``IidPartitioner`` (contiguous equal shards) applied to the rows in
    an order shuffled with ``seed``, so the shards are IID even when the data is stored sorted by
    class (as an image folder is). ``dirichlet``: ``DirichletPartitioner(num_partitions,
    partition_by="label", alpha, min_partition_size, self_balancing=False, shuffle=True, seed)``;
    its ``min_partition_size`` is raised to 1 so that no client is left without data (the draw is
    then repeated, as flwr-datasets does for ``min_partition_size``). Deterministic for the seed and
    identical in every process; cached, since every client asks.
    """
    labels = np.asarray(labels, dtype=np.int64)
    if num_partitions < 1 or num_partitions > labels.size:
        raise ValueError(
            f"Cannot split a training set of {labels.size} examples into num_partitions={num_partitions} "
            "non-empty partitions: use at most as many clients as training examples"
        )
    key = (labels.tobytes(), num_partitions, cfg.name, float(cfg.alpha), int(cfg.min_partition_size), int(seed))
    return [part.copy() for part in _partition_cached(*key)]


@functools.lru_cache(maxsize=8)
def _partition_cached(
    labels_bytes: bytes, num_partitions: int, name: str, alpha: float, min_size: int, seed: int
) -> tuple[np.ndarray, ...]:
    """The partition for hashable arguments (see :func:`partition_indices`), per process and in
    the partition cache on disk (:func:`partition_cache_file`)."""
    labels = np.frombuffer(labels_bytes, dtype=np.int64)
    path = partition_cache_file(labels_bytes, num_partitions, name, alpha, min_size, seed)
    parts = _read_partition(path, num_partitions, labels.size)
    if parts is None:
        if name == "iid":
            parts = _iid_partition(labels, num_partitions, seed)
        else:
            parts = _dirichlet_partition(labels, num_partitions, alpha, min_size, seed)
        _write_partition(path, parts)
    for part in parts:
        part.setflags(write=False)
    return tuple(parts)


PARTITION_CACHE_ENV = "FEDACT_CACHE_DIR"


def partition_cache_file(labels_bytes: bytes, num_partitions: int, name: str, alpha: float,
                         min_size: int, seed: int) -> Path | None:
    """Where a partition is kept between processes, or None when ``$FEDACT_CACHE_DIR`` is empty.

    A Flower 1.41 deployment runs every message in a new ClientApp process, which would import
    flwr-datasets and draw the whole partition again each round (1-2.5 s for CIFAR-100 on
    100 clients); this file makes that a read of a few hundred kB. Its name hashes everything
    the draw depends on: the labels, the partition settings, the seed and the versions of
    flwr-datasets and numpy. Folder: ``$FEDACT_CACHE_DIR/partitions`` (default
    ``~/.cache/fedact``).
    """
    root = os.environ.get(PARTITION_CACHE_ENV, os.path.join("~", ".cache", "fedact"))
    if not root:
        return None
    from importlib.metadata import version

    settings = (num_partitions, name, alpha, min_size, seed, version("flwr-datasets"), np.__version__)
    digest = hashlib.sha256(labels_bytes + repr(settings).encode()).hexdigest()[:32]
    return Path(root).expanduser() / "partitions" / f"{name}-{num_partitions}-{digest}.npz"


def _read_partition(path: Path | None, num_partitions: int, num_rows: int) -> list[np.ndarray] | None:
    """The partition stored at ``path``; None when there is none or it does not fit the data."""
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path) as stored:
            rows, sizes = stored["rows"].astype(np.int64), stored["sizes"].astype(np.int64)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    if (sizes.shape != (num_partitions,) or (sizes < 0).any() or sizes.sum() != rows.size
            or (rows.size and not 0 <= rows.min() <= rows.max() < num_rows)):
        return None
    return np.split(rows, np.cumsum(sizes)[:-1])


def _write_partition(path: Path | None, parts: Sequence[np.ndarray]) -> None:
    """Store a partition at ``path`` atomically (processes drawing it at once write the same
    file); a cache that cannot be written is skipped with a warning."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        with open(partial, "wb") as file:
            np.savez(file, rows=np.concatenate(parts), sizes=np.array([p.size for p in parts]))
        os.replace(partial, path)
    except OSError as exc:
        warnings.warn(f"Partition cache not written ({exc}); set {PARTITION_CACHE_ENV} to a writable "
                      f"folder, or to an empty value to turn the cache off", RuntimeWarning, stacklevel=2)


def _iid_partition(labels: np.ndarray, num_partitions: int, seed: int) -> list[np.ndarray]:
    """IidPartitioner shards of the rows in a seeded random order."""
    from flwr_datasets.partitioner import IidPartitioner

    order = np.random.default_rng(seed % 2**63).permutation(labels.size)
    partitioner = IidPartitioner(num_partitions=num_partitions)
    partitioner.dataset = _label_dataset(labels[order], order)
    return [_rows(partitioner.load_partition(i)) for i in range(num_partitions)]


def _dirichlet_partition(
    labels: np.ndarray, num_partitions: int, alpha: float, min_size: int, seed: int
) -> list[np.ndarray]:
    """DirichletPartitioner's per-class Dir(alpha) split over the partitions."""
    from flwr_datasets.partitioner import DirichletPartitioner

    partitioner = DirichletPartitioner(
        num_partitions=num_partitions, partition_by=LABEL, alpha=alpha,
        min_partition_size=max(min_size, 1), self_balancing=False, shuffle=True, seed=seed,
    )
    partitioner.dataset = _label_dataset(labels, np.arange(labels.size))
    try:
        return [_rows(partitioner.load_partition(i)) for i in range(num_partitions)]
    except ValueError as exc:
        raise ValueError(
            f"Dirichlet partitioning of {labels.size} examples into num_partitions={num_partitions} "
            f"with alpha={alpha} could not give every partition at least {max(min_size, 1)} examples "
            f"({exc}). Use fewer clients, a larger partition.alpha or a smaller "
            "partition.min_partition_size."
        ) from exc


def _label_dataset(labels: np.ndarray, rows: np.ndarray) -> datasets.Dataset:
    """The partitioner's input: the labels plus each row's index in the training split."""
    return datasets.Dataset.from_dict({LABEL: labels, "row": rows.astype(np.int64)})


def _rows(partition: datasets.Dataset) -> np.ndarray:
    """The training-split row indices of a partition."""
    return np.asarray(partition.with_format("numpy", columns=["row"])[:]["row"], dtype=np.int64)


# ----------------------------------------------------------------------------------------------
# Per-process caches of decoded data


def load_client_train(cfg: Config, partition_id: int, num_partitions: int) -> ImageTensors:
    """The training examples of one client, decoded (only its rows), cached per process."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id={partition_id} is outside [0, num_partitions={num_partitions})")
    partition = (cfg.partition.name, float(cfg.partition.alpha), int(cfg.partition.min_partition_size))
    return _client_train_cached(
        _dataset_key(cfg.dataset), _resolve(cfg.data_dir), int(cfg.seed), partition, num_partitions, partition_id
    )


def train_labels(cfg: Config) -> np.ndarray:
    """The training split's labels (read-only), as the partitioner sees them, cached per process."""
    return _splits_cached(_dataset_key(cfg.dataset), _resolve(cfg.data_dir), int(cfg.seed))[2]


def load_test(cfg: Config) -> ImageTensors:
    """The whole test split, decoded, cached per process."""
    return _test_cached(_dataset_key(cfg.dataset), _resolve(cfg.data_dir), int(cfg.seed))


def load_validation(cfg: Config) -> ImageTensors:
    """The training rows held out by ``dataset.holdout_fraction`` (:func:`holdout_rows`), decoded,
    cached per process; ValueError when it is 0."""
    return _validation_cached(_dataset_key(cfg.dataset), _resolve(cfg.data_dir), int(cfg.seed))


def _dataset_key(cfg: DatasetConfig) -> tuple:
    """A hashable key of every DatasetConfig field (lists become tuples)."""
    return tuple((f.name, _hashable(getattr(cfg, f.name))) for f in dataclasses.fields(cfg))


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _dataset_config(key: tuple) -> DatasetConfig:
    """The DatasetConfig a :func:`_dataset_key` was made from."""
    return DatasetConfig(**{name: list(v) if isinstance(v, tuple) else v for name, v in key})


@functools.lru_cache(maxsize=2)
def _splits_cached(
    dataset_key: tuple, data_dir: str | None, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset, np.ndarray, datasets.Dataset | None]:
    """The training split clients share (without the validation rows), the test split, the
    former's labels (read-only) and the validation rows (None when ``holdout_fraction`` is 0), per
    process."""
    cfg = _dataset_config(dataset_key)
    train, test = load_splits(cfg, data_dir, seed)
    validation = None
    if cfg.holdout_fraction > 0:
        kept, held = holdout_rows(len(train), cfg.holdout_fraction, seed)
        train, validation = train.select(kept), train.select(held)
    labels = _labels_of(train).astype(np.int64)
    labels.setflags(write=False)
    return train, test, labels, validation


HOLDOUT_STREAM = 0x76616C  # "val": the holdout's random stream, apart from every other draw of the seed


def holdout_rows(num_rows: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held out): sorted row indices of a training split of ``num_rows`` rows, the held-out
    ones ``round(fraction * num_rows)`` rows drawn without replacement by a generator seeded with
    (``seed``, :data:`HOLDOUT_STREAM`). The kept rows are what is partitioned over the clients, so
    no client ever trains on a held-out row. ``fraction`` 0: every row kept, none held out."""
    count = int(round(fraction * num_rows))
    if fraction > 0 and not 1 <= count < num_rows:
        raise ConfigError(f"Invalid config value dataset.holdout_fraction={fraction}: holds out {count} of "
                          f"{num_rows} training examples; allowed a fraction that leaves at least one on "
                          "each side")
    rng = np.random.default_rng(np.random.SeedSequence([seed % 2**63, HOLDOUT_STREAM]))
    held = np.sort(rng.choice(num_rows, size=count, replace=False)).astype(np.int64)
    kept = np.setdiff1d(np.arange(num_rows, dtype=np.int64), held, assume_unique=True)
    return kept, held


@functools.lru_cache(maxsize=16)
def _client_train_cached(
    dataset_key: tuple, data_dir: str | None, seed: int, partition: tuple, num_partitions: int, partition_id: int
) -> ImageTensors:
    """One partition's decoded training data (see :func:`load_client_train`)."""
    train, _, labels, _ = _splits_cached(dataset_key, data_dir, seed)
    name, alpha, min_size = partition
    part_cfg = PartitionConfig(name=name, alpha=alpha, min_partition_size=min_size)
    rows = partition_indices(labels, num_partitions, part_cfg, seed)[partition_id]
    return to_image_tensors(train.select(rows), _dataset_config(dataset_key))


@functools.lru_cache(maxsize=2)
def _test_cached(dataset_key: tuple, data_dir: str | None, seed: int) -> ImageTensors:
    """The decoded test split (see :func:`load_test`)."""
    _, test, _, _ = _splits_cached(dataset_key, data_dir, seed)
    return to_image_tensors(test, _dataset_config(dataset_key))


@functools.lru_cache(maxsize=2)
def _validation_cached(dataset_key: tuple, data_dir: str | None, seed: int) -> ImageTensors:
    """The decoded validation rows (see :func:`load_validation`)."""
    validation = _splits_cached(dataset_key, data_dir, seed)[3]
    if validation is None:
        raise ValueError("no validation rows: dataset.holdout_fraction is 0")
    return to_image_tensors(validation, _dataset_config(dataset_key))


def clear_caches() -> None:
    """Forget every cached split, partition and decoded tensor of this process."""
    for cached in (_partition_cached, _splits_cached, _client_train_cached, _test_cached, _validation_cached):
        cached.cache_clear()


# ----------------------------------------------------------------------------------------------
# Batches


def batch_generator(seed: int, server_round: int, partition_id: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded from (seed, server_round, partition_id)."""
    state = np.random.SeedSequence([seed % 2**63, server_round, partition_id]).generate_state(1, np.uint64)[0]
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state) % 2**63)
    return generator


class BatchStream:
    """Endless stream of training batches from an ImageTensors already on the training device.

    Each pass over the partition is in a fresh random order (``torch.randperm`` with
    ``generator``); a batch that runs past the end of a pass continues in the next one, so
    ``batch_size`` may exceed the partition size (the batch then wraps around). With ``augment``,
    every sample gets a random crop from the image zero-padded by ``image_size // 8`` pixels
    (4 for 32 px) and a horizontal flip with probability 1/2. The padding is 0 in *normalized*
    space, i.e. the dataset's mean colour (torchvision's ``RandomCrop(padding=4)`` before
    ``Normalize`` would pad black). All randomness comes from ``generator``, which must live on
    the data's device, so a run is reproducible and a step makes no host round trip.
    """

    def __init__(self, data: ImageTensors, batch_size: int, augment: bool, generator: torch.Generator):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(data) == 0:
            raise ValueError("BatchStream needs at least one example")
        if not _same_device(torch.device(generator.device), data.images.device):
            raise ValueError(f"generator is on {generator.device} but the data is on {data.images.device}; "
                             "use batch_generator(..., device=<the data's device>)")
        self.data = data
        self.batch_size = batch_size
        self.augment = augment
        self.generator = generator
        self.pad = min(data.images.shape[-2:]) // 8 if augment else 0
        self._order = self._new_order()
        self._position = 0

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """The next (images, labels) batch; images augmented when ``augment`` is on."""
        index = self._next_indices()
        images = self.data.images.index_select(0, index)
        labels = self.data.labels.index_select(0, index)
        if self.augment:
            images = random_crop_flip(images, self.pad, self.generator)
        return images, labels

    def _new_order(self) -> Tensor:
        return torch.randperm(len(self.data), generator=self.generator, device=self.data.images.device)

    def _next_indices(self) -> Tensor:
        """``batch_size`` indices continuing the current pass, starting new passes as needed."""
        pieces, needed = [], self.batch_size
        while needed > 0:
            if self._position == len(self.data):
                self._order, self._position = self._new_order(), 0
            take = min(needed, len(self.data) - self._position)
            pieces.append(self._order[self._position:self._position + take])
            self._position += take
            needed -= take
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type, and same index where both name one (``cuda`` == ``cuda:0``)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def random_crop_flip(images: Tensor, pad: int, generator: torch.Generator) -> Tensor:
    """Per-sample random crop (zero padding ``pad``) and horizontal flip of a (B, C, H, W) batch."""
    batch, _, height, width = images.shape
    device = images.device
    if pad > 0:
        padded = F.pad(images, (pad, pad, pad, pad)).permute(0, 2, 3, 1)  # (B, H+2p, W+2p, C)
        top = torch.randint(0, 2 * pad + 1, (batch, 1), generator=generator, device=device)
        left = torch.randint(0, 2 * pad + 1, (batch, 1), generator=generator, device=device)
        rows = (top + torch.arange(height, device=device))[:, :, None]  # (B, H, 1)
        cols = (left + torch.arange(width, device=device))[:, None, :]  # (B, 1, W)
        samples = torch.arange(batch, device=device)[:, None, None]
        images = padded[samples, rows, cols].permute(0, 3, 1, 2).contiguous()
    flip = torch.rand(batch, generator=generator, device=device) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def test_batches(data: ImageTensors, batch_size: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Consecutive (images, labels) batches covering every example once: no shuffle, no augmentation."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(data), batch_size):
        yield data.images[start:start + batch_size], data.labels[start:start + batch_size]


test_batches.__test__ = False  # not a pytest test when imported into a test module
