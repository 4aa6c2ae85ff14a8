"""Vision data: what :class:`~fedact_app.tasks.vision.task.VisionTask` reads, decoded and cached per
process (in simulation one process serves many clients).

Everything a client trains on passes through four steps, one module each:

1. :mod:`.splits` - :func:`~.splits.load_splits`: the train and test splits (digits, synthetic, the
   hub or a local ``dataset.path``) with columns ``image`` and ``label``, labels checked; through
   :func:`~.decoded.decoded_splits` (:mod:`.decoded`), which reads local image files from their
   decoded copy on disk after the first process.
2. :mod:`.partition` - :func:`~.partition.holdout_rows` (only when ``dataset.holdout_fraction`` > 0)
   holds a seed-fixed slice of the training split out as the server's validation set;
   :func:`~.partition.partition_indices` says which training rows each client holds.
3. here - :func:`load_client_train` / :func:`load_test` / :func:`load_validation` decode only the
   rows needed into an :class:`~.tensors.ImageTensors` (:mod:`.tensors`), cached per process.
4. :mod:`.batches` - :class:`~.batches.BatchStream` / :func:`~.batches.test_batches`: batches from
   tensors already on the training device; augmentation runs there as tensor ops.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from fedact_app.config import Config, DatasetConfig, PartitionConfig
from fedact_app.tasks.vision import partition
from fedact_app.tasks.vision.partition import holdout_rows, partition_indices
from fedact_app.tasks.vision.decoded import decoded_splits
from fedact_app.tasks.vision.splits import Split, labels_of, resolve_path
from fedact_app.tasks.vision.tensors import ImageTensors, to_image_tensors


def load_client_train(cfg: Config, partition_id: int, num_partitions: int) -> ImageTensors:
    """The training examples of one client, decoded (only its rows), cached per process."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition_id={partition_id} is outside [0, num_partitions={num_partitions})")
    partition = (cfg.partition.name, float(cfg.partition.alpha), int(cfg.partition.min_partition_size))
    return _client_train_cached(
        _dataset_key(cfg.dataset), resolve_path(cfg.data_dir), int(cfg.seed), partition, num_partitions, partition_id
    )


def train_labels(cfg: Config) -> np.ndarray:
    """The training split's labels (read-only), as the partitioner sees them, cached per process."""
    return _splits_cached(_dataset_key(cfg.dataset), resolve_path(cfg.data_dir), int(cfg.seed))[2]


def load_test(cfg: Config) -> ImageTensors:
    """The whole test split, decoded, cached per process."""
    return _test_cached(_dataset_key(cfg.dataset), resolve_path(cfg.data_dir), int(cfg.seed))


def load_validation(cfg: Config) -> ImageTensors:
    """The training rows held out by ``dataset.holdout_fraction`` (:func:`holdout_rows`), decoded,
    cached per process; ValueError when it is 0."""
    return _validation_cached(_dataset_key(cfg.dataset), resolve_path(cfg.data_dir), int(cfg.seed))


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
) -> tuple[Split, Split, np.ndarray, Split | None]:
    """The training split clients share (without the validation rows), the test split, the
    former's labels (read-only) and the validation rows (None when ``holdout_fraction`` is 0), per
    process."""
    cfg = _dataset_config(dataset_key)
    train, test = decoded_splits(cfg, data_dir, seed)
    validation = None
    if cfg.holdout_fraction > 0:
        kept, held = holdout_rows(len(train), cfg.holdout_fraction, seed)
        train, validation = train.select(kept), train.select(held)
    labels = labels_of(train).astype(np.int64)
    labels.setflags(write=False)
    return train, test, labels, validation



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
    partition.clear_cache()
    for cached in (_splits_cached, _client_train_cached, _test_cached, _validation_cached):
        cached.cache_clear()
