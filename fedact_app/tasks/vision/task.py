"""The vision task: timm / torchvision models on image datasets, cross-entropy, accuracy
(:mod:`.data`, :mod:`.models`, fedact_app.train)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedact_app.config import PartitionConfig
from fedact_app.tasks.base import Task
from fedact_app.tasks.vision.batches import BatchStream, test_batches
from fedact_app.tasks.vision.data import load_client_train, load_test, load_validation, train_labels
from fedact_app.tasks.vision.models import build_model
from fedact_app.tasks.vision.partition import check_partitions, partition_indices
from fedact_app.tasks.vision.tensors import ImageTensors
from fedact_app.train import classification_loss, evaluate


class VisionTask(Task):
    """Classification of ``cfg.dataset`` with ``cfg.model``; each client's partition and the test
    split stay resident on the training device (per process)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self._resident: dict[tuple, ImageTensors] = {}

    def build_model(self) -> nn.Module:
        return build_model(self.cfg.model, self.cfg.dataset)

    def check_data(self) -> None:
        check_partitions(self.cfg, train_labels(self.cfg))

    def describe_train_data(self, partition_id: int, num_partitions: int) -> str:
        return f"{len(load_client_train(self.cfg, partition_id, num_partitions))} training examples"

    def _on_device(self, key: tuple, load, device: torch.device) -> ImageTensors:
        if key not in self._resident:
            self._resident[key] = load().to(device)
        return self._resident[key]

    def train_batches(self, partition_id: int, num_partitions: int, server_round: int,
                      device: torch.device, generator: torch.Generator) -> BatchStream:
        data = self._on_device(("train", partition_id, num_partitions, str(device)),
                               lambda: load_client_train(self.cfg, partition_id, num_partitions), device)
        return BatchStream(data, self.cfg.batch_size, self.cfg.dataset.augment, generator)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
        return classification_loss(model, batch, self.cfg.channels_last)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """``test_loss``/``test_accuracy`` on the test split; with ``dataset.holdout_fraction`` > 0
        ``val_loss``/``val_accuracy`` on the held-out training rows instead (tuning never sees the
        test split, and its numbers cannot pass for test numbers)."""
        split, load = (("val", load_validation) if self.cfg.dataset.holdout_fraction > 0 else ("test", load_test))
        data = self._on_device((split, str(device)), lambda: load(self.cfg), device)
        stats = evaluate(model, test_batches(data, self.cfg.eval_batch_size), self.cfg.precision,
                         self.cfg.channels_last)
        return {f"{split}_loss": stats.loss, f"{split}_accuracy": stats.accuracy}

    def evaluate_client(self, model: nn.Module, partition_id: int, num_partitions: int,
                        device: torch.device) -> tuple[dict[str, float], int]:
        """The client's IID share of the test split."""
        test = load_test(self.cfg)
        rows = partition_indices(test.labels.numpy(), num_partitions, PartitionConfig(name="iid"),
                                 self.cfg.seed)[partition_id]
        index = torch.as_tensor(rows, dtype=torch.long)
        local = ImageTensors(test.images[index], test.labels[index]).to(device)
        stats = evaluate(model, test_batches(local, self.cfg.eval_batch_size), self.cfg.precision,
                         self.cfg.channels_last)
        return {"test_loss": stats.loss, "test_accuracy": stats.accuracy}, stats.num_examples
