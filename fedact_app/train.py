"""Plain PyTorch training and evaluation used by the ClientApp and the ServerApp (no Flower here)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA when one is visible, else CPU; ``cuda`` fails clearly when none is."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "device=cuda but no CUDA device is visible to this process. In a Flower simulation a "
            "client sees a GPU only with --federation-config 'client-resources-num-gpus=...' > 0 "
            "(see README); use device=auto or device=cpu otherwise.")
    return torch.device(device)


def cosine_lr(server_round: int, num_rounds: int, lr: float, lr_min: float) -> float:
    """eta_r = lr_min + (lr - lr_min) * (1 + cos(pi (r - 1) / R)) / 2, constant within round r."""
    return lr_min + (lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * (server_round - 1) / num_rounds))


@dataclass
class TrainStats:
    loss: float  # mean training loss over the round's steps
    num_examples: int  # examples processed (steps x batch)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches, steps: int) -> TrainStats:
    """Run ``steps`` optimizer steps on batches drawn from ``batches.next_batch()``.

    The loss is summed on the device and read once at the end (no host sync per step).
    """
    model.train()
    loss_sum = None
    num_examples = 0
    for _ in range(steps):
        images, labels = batches.next_batch()
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        num_examples += labels.shape[0]
    return TrainStats(loss=float(loss_sum) / steps, num_examples=num_examples)


@dataclass
class EvalStats:
    loss: float
    accuracy: float
    num_examples: int


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]]) -> EvalStats:
    """Mean cross-entropy and accuracy over all batches."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for images, labels in batches:
        logits = model(images)
        loss_sum += float(F.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(dim=1) == labels).sum())
        count += labels.shape[0]
    return EvalStats(loss=loss_sum / max(count, 1), accuracy=correct / max(count, 1),
                     num_examples=count)
