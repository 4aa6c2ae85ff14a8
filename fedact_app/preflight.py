"""Checks of a config against the data, run by the ServerApp before round 1.

``Config.__post_init__`` checks every value on its own; what needs the dataset (can it feed
``num_clients`` clients under the chosen partition?) is checked here, once the server has loaded
the data, so a run fails before any training instead of in every ClientApp at round 1.
"""

from __future__ import annotations

import numpy as np

from fedact_app.config import Config, ConfigError
from fedact_app.data import partition_indices


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
