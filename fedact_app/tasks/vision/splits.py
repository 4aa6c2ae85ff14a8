"""Vision data, step 1: the train and test splits, labels checked to lie in ``[0, num_classes)``
(:func:`load_splits`). A split (:data:`Split`) is a Hugging Face ``datasets.Dataset`` with two
columns, ``image`` and ``label`` (renamed from ``dataset.image_column`` /
``dataset.label_column``), or an :class:`ArraySplit` of images and labels: ``digits`` and
``synthetic`` here, and local image files read from their decoded copy on disk (:mod:`.decoded`).

Sources (``dataset.name`` / ``dataset.path`` / ``dataset.hub_path``):

- ``digits``: scikit-learn's ``load_digits()`` (1,797 real 8x8 digits shipped in the wheel),
  pixel values / 16 in [0, 1], split 80/20 stratified with a fixed ``random_state``
  (:data:`DIGITS_SPLIT_SEED`, independent of the run's seed so every run tests on the same 360);
  kept on disk after the first process computed it (:func:`_digits_arrays`).
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
``dataset.image_size``. ``digits`` and ``synthetic`` hold float32 arrays in [0, 1] shaped
(N, C, H, W) (:class:`ArraySplit`); a parquet column of float arrays (C, H, W) is read as such.
"""

from __future__ import annotations

import glob
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence, Union

import numpy as np

from fedact_app.config import ConfigError, DatasetConfig
from fedact_app.tasks.vision.cache import cache_folder, read_cache_file, write_cache_file
from fedact_app.tasks.hub import HubUnavailableError, unavailable_message

if TYPE_CHECKING:
    import datasets

DIGITS_SPLIT_SEED = 0  # fixed: the digits train/test split never depends on the run's seed
DIGITS_TEST_FRACTION = 0.2
SYNTHETIC_NOISE_STD = 0.3
IMAGE = "image"
LABEL = "label"


class DatasetUnavailableError(HubUnavailableError):
    """A hub dataset could not be loaded (offline, or not in the cache)."""


class LazyImages:
    """Images made when first read, by ``draw(rows)`` (the images of those row numbers; it must
    give the same image for a row at every call, whatever the other rows asked). A synthetic
    split knows its labels before its images, and draws each image from its own seed: a process
    that needs only the labels (the ServerApp's check of the partitions) draws none, and one
    that reads some rows (a client its partition, tuning its held-out rows) draws only those.
    :meth:`array` draws the whole split once (thread-safe; a draw that raised is tried again at
    the next read). Not picklable: splits stay in the process that made them."""

    def __init__(self, draw: Callable[[np.ndarray], np.ndarray], count: int) -> None:
        self._draw, self.count = draw, count
        self._array: np.ndarray | None = None
        self._lock = threading.Lock()

    def array(self) -> np.ndarray:
        """All the images, drawn at the first call and kept."""
        if self._array is None:
            with self._lock:
                if self._array is None:
                    self._array = self._draw(np.arange(self.count))
        return self._array

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The images of ``rows``, in that order: from the whole split where it was drawn, else
        drawn for these rows alone (not kept)."""
        return self._array[rows] if self._array is not None else self._draw(rows)


@dataclass(frozen=True, eq=False)  # (no == or hash over arrays)
class ArraySplit:
    """A split held as arrays: the rows ``rows`` (None: all) of ``all_images`` (N, C, H, W), float32
    in [0, 1] or uint8 pixels (the value divided by 255), and the split's int64 labels, one per
    row. ``all_images`` may be :class:`LazyImages` (synthetic data), made when first read.

    ``digits`` and ``synthetic`` are made in memory as these, and local image files are read as
    these from their decoded copy on disk (:mod:`.decoded`, ``all_images`` then mapped from the
    file), with the two things the pipeline asks of a ``datasets.Dataset`` (``len`` and
    ``select``), so that a process reading them never imports Hugging Face ``datasets`` (pandas,
    pyarrow, the hub client: about 1 CPU-second in every process that reads data, the
    ServerApp's, each Ray actor's, each deployed ClientApp's). ``select`` copies no image: a split
    of the mapped file that holds validation rows out costs no memory until its rows are read.
    Treat the arrays as read-only: cached splits share them.
    """

    all_images: np.ndarray | LazyImages
    labels: np.ndarray
    rows: np.ndarray | None = None

    @property
    def images(self) -> np.ndarray:
        """The split's images, in its order (a copy where it selects rows)."""
        if isinstance(self.all_images, LazyImages):
            return self.all_images.array() if self.rows is None else self.all_images.take(self.rows)
        return self.all_images if self.rows is None else self.all_images[self.rows]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def select(self, rows: Sequence[int] | np.ndarray) -> ArraySplit:
        """The given rows, in that order."""
        rows = np.array(rows, dtype=np.int64)  # (a copy: the caller's array may change later)
        return ArraySplit(self.all_images, self.labels[rows], rows if self.rows is None else self.rows[rows])


Split = Union["datasets.Dataset", ArraySplit]  # a train or test split (module docstring)


def load_splits(cfg: DatasetConfig, data_dir: str | None = None, seed: int = 42) -> tuple[Split, Split]:
    """The train and test splits (images and labels), labels validated.

    ``data_dir`` is the Hugging Face datasets cache (None: its default). ``seed`` only affects
    ``synthetic``. See the module docstring for the accepted sources and local layouts.
    """
    columns = (IMAGE, LABEL)
    if cfg.name == "digits":
        train, test = _digits_splits()
    elif cfg.name == "synthetic":
        train, test = _synthetic_splits(cfg, seed)
    else:
        train, test, columns = _load_external(cfg, resolve_path(data_dir))
        train = _normalize_columns(train, columns, cfg, cfg.train_split)
        test = _normalize_columns(test, columns, cfg, cfg.test_split)
    for split_name, split in ((cfg.train_split, train), (cfg.test_split, test)):
        check_labels(split, cfg, split_name, columns[1])
    return train, test


def resolve_path(path: str | None) -> str | None:
    """An absolute path (``~`` expanded), or None."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))


def _digits_splits() -> tuple[ArraySplit, ArraySplit]:
    """scikit-learn's digits as (1, 8, 8) float images in [0, 1], stratified 80/20 split."""
    arrays = _digits_arrays()
    return ArraySplit(arrays["x_train"], arrays["y_train"]), ArraySplit(arrays["x_test"], arrays["y_test"])


DIGITS_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
DIGITS_CACHE_FORMAT = 1  # raise it whenever _digits_arrays prepares the arrays differently


def _digits_arrays() -> dict[str, np.ndarray]:
    """The digits split as arrays: read from the cache on disk (:mod:`.cache`), else
    computed with scikit-learn and stored there. Importing scikit-learn costs about 1 s of CPU in
    every new process that reads the data (the ServerApp's, each Ray actor's and, in a deployment,
    each message's ClientApp); the file is 0.5 MB. Its name hashes the versions of scikit-learn
    and numpy, the split's settings and :data:`DIGITS_CACHE_FORMAT`."""
    from importlib.metadata import version

    folder = cache_folder("digits")
    settings = (version("scikit-learn"), np.__version__, DIGITS_TEST_FRACTION, DIGITS_SPLIT_SEED,
                DIGITS_CACHE_FORMAT)
    path = None if folder is None else folder / f"split-{hashlib.sha256(repr(settings).encode()).hexdigest()[:32]}.npz"
    stored = read_cache_file(path, DIGITS_ARRAYS)
    if stored is not None and _fits_digits(stored):
        return stored
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    labels = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=DIGITS_TEST_FRACTION, stratify=labels, random_state=DIGITS_SPLIT_SEED
    )
    arrays = {"x_train": x_tr, "y_train": y_tr, "x_test": x_te, "y_test": y_te}
    write_cache_file(path, "Digits split", **arrays)
    return arrays


def _fits_digits(arrays: dict[str, np.ndarray]) -> bool:
    """Whether stored arrays have the digits split's shapes, types and value ranges."""
    x_tr, y_tr, x_te, y_te = (arrays[name] for name in DIGITS_ARRAYS)
    return (x_tr.dtype == x_te.dtype == np.float32 and y_tr.dtype == y_te.dtype == np.int64
            and x_tr.shape[1:] == x_te.shape[1:] == (1, 8, 8) and len(x_tr) == len(y_tr) > 0
            and len(x_te) == len(y_te) > 0 and len(x_tr) + len(x_te) == 1797
            and all(0 <= a.min() and a.max() <= (1 if a.dtype == np.float32 else 9) for a in arrays.values()))


def _synthetic_splits(cfg: DatasetConfig, seed: int) -> tuple[ArraySplit, ArraySplit]:
    """Class-conditional images: a random mean pattern per class plus noise, clipped to [0, 1].

    Row i of a split is ``clip(means[labels[i]] + normal(0, 0.3, (c, h, w)), 0, 1)`` in float32,
    its noise drawn by the i-th child of the split's seed sequence (``SeedSequence.spawn``'s
    i-th), so that any row can be drawn alone: a client's partition of the seed's CIFAR-100-shaped
    split (5,000 of 50,000 images) draws a tenth of the images. The labels are drawn first, from
    the split's own seed; the images when first read (:class:`LazyImages`)."""
    means_seq, train_seq, test_seq = np.random.SeedSequence(seed % 2**63).spawn(3)
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    means = np.random.default_rng(means_seq).uniform(0.0, 1.0, (cfg.num_classes, *shape))

    def sample(seq: np.random.SeedSequence, n: int) -> ArraySplit:
        labels = np.random.default_rng(seq).permutation(np.arange(n) % cfg.num_classes).astype(np.int64)
        labels.setflags(write=False)  # the images are drawn from them later

        def draw(rows: np.ndarray) -> np.ndarray:
            images = np.empty((len(rows), *shape), dtype=np.float32)
            for out, row in zip(images, rows):
                child = np.random.SeedSequence(seq.entropy, spawn_key=(*seq.spawn_key, int(row)))
                pixels = np.random.default_rng(child).normal(0.0, SYNTHETIC_NOISE_STD, shape)
                pixels += means[labels[row]]
                out[...] = np.clip(pixels, 0.0, 1.0, out=pixels)
            return images

        return ArraySplit(LazyImages(draw, n), labels)

    return sample(train_seq, cfg.num_train), sample(test_seq, cfg.num_test)


def _load_external(
    cfg: DatasetConfig, data_dir: str | None
) -> tuple[datasets.Dataset, datasets.Dataset, tuple[str, str]]:
    """The raw train/test splits from ``cfg.path`` if set, else from the hub, and their
    (image, label) column names: the configured ones, or ``image``/``label`` for an image folder."""
    import datasets  # importable on the CPU torch: see fedact_app/tasks/vision/__init__.py

    splits = (cfg.train_split, cfg.test_split)
    columns = (cfg.image_column, cfg.label_column)
    if cfg.path is None:
        loaded = _load_hub(cfg, data_dir)
        source = f"hub dataset '{cfg.hub_path}'"
    else:
        builder, data_files = local_data_files(resolve_path(cfg.path), splits)
        loaded = datasets.load_dataset(builder, data_files=data_files, cache_dir=data_dir)
        source = f"dataset.path={cfg.path!r}"
        columns = local_columns(builder, cfg)
    missing = [s for s in splits if s not in loaded]
    if missing:
        raise ValueError(
            f"The {source} has no split(s) {missing}; it has {sorted(loaded)}. "
            "Set dataset.train_split / dataset.test_split to existing splits."
        )
    return loaded[cfg.train_split], loaded[cfg.test_split], columns


def _load_hub(cfg: DatasetConfig, data_dir: str | None) -> datasets.DatasetDict:
    """``load_dataset(cfg.hub_path)``; any I/O failure becomes a DatasetUnavailableError."""
    import datasets

    if not cfg.hub_path:
        raise ValueError(f"dataset {cfg.name!r} has neither dataset.path nor dataset.hub_path set.")
    try:
        return datasets.load_dataset(cfg.hub_path, cache_dir=data_dir)
    except OSError as exc:  # ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        hint = ("use local data with `dataset.path=<local parquet folder or image folder>` "
                f"(dataset={cfg.name}): parquet files for the splits '{cfg.train_split}' and "
                f"'{cfg.test_split}' with an image column '{cfg.image_column}' and an integer label column "
                f"'{cfg.label_column}' (values in [0, {cfg.num_classes})), or an image folder "
                f"<path>/{cfg.train_split}/<class>/* and <path>/{cfg.test_split}/<class>/*.")
        raise DatasetUnavailableError(unavailable_message("dataset", cfg.hub_path, exc, hint, data_dir)) from exc


def local_data_files(path: str, splits: Sequence[str]) -> tuple[str, dict[str, list[str]]]:
    """The ``load_dataset`` builder ("parquet" or "imagefolder") and data files per split."""
    if "{split}" in path:
        return "parquet", {s: _existing_files(path.format(split=s), path) for s in splits}
    root = Path(path)
    if root.is_file():
        return "parquet", _sibling_split_files(root, splits)
    if not root.is_dir():
        raise FileNotFoundError(f"dataset.path={path!r} does not exist (expected a parquet file or folder, "
                                "or an image folder; see fedact_app/tasks/vision/splits.py)")
    if all((root / s).is_dir() for s in splits):
        if all(glob.glob(str(root / s / "*.parquet")) for s in splits):
            return "parquet", {s: sorted(glob.glob(str(root / s / "*.parquet"))) for s in splits}
        return "imagefolder", {s: [str(root / s / "**")] for s in splits}
    return "parquet", {s: _split_parquet_files(root, s) for s in splits}


def split_files(builder: str, files: list[str]) -> list[str]:
    """The files of one split from :func:`local_data_files`: its parquet files, or every file under
    an image folder's split (its one recursive pattern, ``<path>/<split>/**``), sorted."""
    if builder == "imagefolder":
        return sorted(f for f in glob.iglob(files[0], recursive=True) if os.path.isfile(f))
    return files


def local_columns(builder: str, cfg: DatasetConfig) -> tuple[str, str]:
    """The image and label columns of local data: ``image``/``label`` for an image folder (as
    ``datasets``' ``imagefolder`` names them), else the configured ones."""
    return (IMAGE, LABEL) if builder == "imagefolder" else (cfg.image_column, cfg.label_column)


def check_local_path(cfg: DatasetConfig) -> None:
    """Refuse a ``dataset.path`` the run could not read, without loading any data (milliseconds):
    ConfigError naming it when it fits none of the layouts above, when a split of an image folder
    holds no file, or when a parquet file's footer cannot be read (a truncated or non-parquet
    file). The launcher calls it before starting a SuperLink: in simulation every ClientApp reads
    this path on the same machine. ``compose()`` does not, since on a SuperNode the path names
    that node's files."""
    try:
        builder, data_files = local_data_files(resolve_path(cfg.path), (cfg.train_split, cfg.test_split))
        for split, files in data_files.items():
            if builder == "imagefolder":
                if not split_files(builder, files):
                    raise FileNotFoundError(f"the image folder's {split!r} split holds no files")
                continue
            for file in files:
                _read_parquet_footer(file)
    except (OSError, ValueError) as err:  # the layout's FileNotFoundError / ValueError, the footer's
        raise ConfigError(f"Invalid config value dataset.path={cfg.path!r}: allowed a parquet file, a folder "
                          f"of parquet files or an image folder that can be read (fedact_app/tasks/vision/splits.py); {err}"
                          ) from None


def _read_parquet_footer(file: str) -> None:
    """Read only ``file``'s parquet footer (schema, row groups); ValueError naming it if that fails."""
    import pyarrow.parquet as pq

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


def check_labels(ds: Split, cfg: DatasetConfig, split: str, column: str) -> None:
    """Labels must be integers in [0, num_classes): clear error naming the column and value."""
    labels = labels_of(ds)
    where = f"Label column '{column}' of the {split!r} split of dataset {cfg.name!r}"
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{where} holds {labels.dtype} values; integer class ids are required")
    bad = labels[(labels < 0) | (labels >= cfg.num_classes)]
    if bad.size:
        raise ValueError(
            f"{where} holds the label {bad[0]}, outside [0, {cfg.num_classes}) "
            f"(dataset.num_classes={cfg.num_classes}); {bad.size} of {labels.size} labels are out of range"
        )


def labels_of(ds: Split) -> np.ndarray:
    """The label column as a numpy array (respecting any row selection)."""
    if isinstance(ds, ArraySplit):
        return ds.labels
    return np.asarray(ds.with_format("numpy", columns=[LABEL])[:][LABEL])

