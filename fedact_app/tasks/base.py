"""What a run trains, behind one interface the ClientApp and the ServerApp use: ``Task``.

A task owns the model, the data of each client and of the server, the loss and the metrics; it
knows nothing of the federated methods or of Flower. ``Config.task`` picks one from ``TASKS``
(a task module is imported only when its task is used, so vision runs never import transformers).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from fedact_app.config import Config
from fedact_app.registry import TASKS


class BatchSource(Protocol):
    """An endless stream of training batches on the training device."""

    def next_batch(self) -> Any: ...


class Task(ABC):
    """Model, data, loss and metrics of one kind of training."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A fresh model, on the CPU."""

    def shared_names(self, model: nn.Module) -> list[str]:
        """The ``state_dict`` entries that travel between server and clients and that the server
        aggregates: every entry by default (parameters and buffers)."""
        return list(model.state_dict())

    def check_data(self) -> None:
        """Checks of the config against the data, run on the server before round 1 (none by default)."""

    @abstractmethod
    def describe_train_data(self, partition_id: int, num_partitions: int) -> str:
        """What one client trains on, for the log: e.g. ``1,797 training examples``."""

    @abstractmethod
    def train_batches(self, partition_id: int, num_partitions: int, server_round: int,
                      device: torch.device, generator: torch.Generator) -> BatchSource:
        """The training batches of one client in ``server_round``; all randomness from
        ``generator`` (on ``device``, seeded from the run's seed, the round and the partition)."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, int]:
        """The training loss of a batch (under autocast when asked) and its number of examples."""

    @abstractmethod
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Metrics of ``model`` on the held-out data (the server's evaluation): ``test_loss`` and
        the task's own (``test_accuracy``, ``test_perplexity``, ...)."""

    @abstractmethod
    def evaluate_client(self, model: nn.Module, partition_id: int, num_partitions: int,
                        device: torch.device) -> tuple[dict[str, float], int]:
        """Metrics of ``model`` on one client's share of the held-out data, and its size."""


def build_task(cfg: Config) -> Task:
    """The ``Task`` of ``cfg.task``."""
    module, _, name = TASKS[cfg.task].partition(":")
    return getattr(importlib.import_module(module), name)(cfg)
