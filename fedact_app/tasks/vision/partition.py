"""Vision data, step 3: which training rows each client holds (:func:`partition_indices`, flwr-datasets'
``IidPartitioner`` or ``DirichletPartitioner``, deterministic for the run's seed, so every process
computes the same partition without talking to the others), the rows held out for validation before
that (:func:`holdout_rows`), and the ServerApp's check that the data can feed ``num_clients``
clients (:func:`check_partitions`, before round 1)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from fedact_app.config import Config, ConfigError, PartitionConfig
from fedact_app.tasks.vision.cache import cache_folder, read_cache_file, write_cache_file
from fedact_app.tasks.vision.splits import LABEL

if TYPE_CHECKING:
    import datasets


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


def partition_cache_file(labels_bytes: bytes, num_partitions: int, name: str, alpha: float,
                         min_size: int, seed: int) -> Path | None:
    """Where a partition is kept between processes, or None when the cache is off
    (:func:`~.cache.cache_folder`).

    A Flower 1.41 deployment runs every message in a new ClientApp process, which would import
    flwr-datasets and draw the whole partition again each round (1-2.5 s for CIFAR-100 on
    100 clients); this file makes that a read of a few hundred kB. Its name hashes everything
    the draw depends on: the labels, the partition settings, the seed and the versions of
    flwr-datasets and numpy. Folder: ``$FEDACT_CACHE_DIR/partitions`` (default
    ``~/.cache/fedact``).
    """
    folder = cache_folder("partitions")
    if folder is None:
        return None
    from importlib.metadata import version

    settings = (num_partitions, name, alpha, min_size, seed, version("flwr-datasets"), np.__version__)
    digest = hashlib.sha256(labels_bytes + repr(settings).encode()).hexdigest()[:32]
    return folder / f"{name}-{num_partitions}-{digest}.npz"


def _read_partition(path: Path | None, num_partitions: int, num_rows: int) -> list[np.ndarray] | None:
    """The partition stored at ``path``; None when there is none or it does not fit the data."""
    stored = read_cache_file(path, ("rows", "sizes"))
    if stored is None or any(a.dtype.kind not in "iu" for a in stored.values()):
        return None
    rows, sizes = stored["rows"].astype(np.int64), stored["sizes"].astype(np.int64)
    if (sizes.shape != (num_partitions,) or (sizes < 0).any() or sizes.sum() != rows.size
            or (rows.size and not 0 <= rows.min() <= rows.max() < num_rows)):
        return None
    return np.split(rows, np.cumsum(sizes)[:-1])


def _write_partition(path: Path | None, parts: Sequence[np.ndarray]) -> None:
    """Store a partition at ``path`` (:func:`~.cache.write_cache_file`)."""
    write_cache_file(path, "Partition", rows=np.concatenate(parts), sizes=np.array([p.size for p in parts]))


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
    import datasets  # only where a partition is drawn, not read from its file

    return datasets.Dataset.from_dict({LABEL: labels, "row": rows.astype(np.int64)})


def _rows(partition: datasets.Dataset) -> np.ndarray:
    """The training-split row indices of a partition."""
    return np.asarray(partition.with_format("numpy", columns=["row"])[:]["row"], dtype=np.int64)


def clear_cache() -> None:
    """Forget this process's partitions (the files on disk stay)."""
    _partition_cached.cache_clear()


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



# ----------------------------------------------------------------------------------------------
# Preflight (ServerApp, before round 1)


def describe_partition(cfg: Config) -> str:
    p = cfg.partition
    if p.name == "dirichlet":
        return f"partition=dirichlet (alpha={p.alpha:g}, every client >= {max(p.min_partition_size, 1)} examples)"
    return f"partition={p.name}"


def check_partitions(cfg: Config, labels: np.ndarray) -> None:
    """Raise ``ConfigError`` naming num_clients, the data and the partition when the training set
    (``labels``) cannot give each of ``num_clients`` clients a non-empty partition."""
    try:
        partition_indices(labels, cfg.num_clients, cfg.partition, cfg.seed)
    except ValueError as exc:
        raise ConfigError(
            f"Invalid config value num_clients={cfg.num_clients}: allowed at most as many clients as "
            f"dataset={cfg.dataset.name} ({len(labels)} training examples, {len(np.unique(labels))} "
            f"classes) can feed under {describe_partition(cfg)} with seed={cfg.seed}. {exc}") from exc
