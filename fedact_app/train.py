"""Plain PyTorch training and evaluation used by the ClientApp and the ServerApp (no Flower here)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


def batch_generator(seed: int, server_round: int, partition_id: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded from (seed, server_round, partition_id): the random
    stream of one client's round (its batches, for every task)."""
    state = np.random.SeedSequence([seed % 2**63, server_round, partition_id]).generate_state(1, np.uint64)[0]
    generator = torch.Generator(device=device)
    generator.manual_seed(int(state) % 2**63)
    return generator


def resolve_device(device: str, key: str = "device") -> torch.device:
    """``auto`` -> CUDA when one is visible, else CPU; ``cuda`` fails clearly when none is, naming
    the config ``key`` that asked for it (``device``, or the ServerApp's ``server_device``)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        if key == "server_device":
            raise RuntimeError("server_device=cuda but no CUDA device is visible to the ServerApp process; "
                               "use server_device=auto or server_device=cpu.")
        raise RuntimeError(
            "device=cuda but no CUDA device is visible to this process. In a Flower simulation a "
            "client sees a GPU only with --federation-config 'client-resources-num-gpus=...' > 0 "
            "(see README); use device=auto or device=cpu otherwise.")
    return torch.device(device)


def autocast(device: torch.device, precision: str):
    """``torch.autocast`` with bfloat16 for ``precision=bf16`` (forward and loss; the weights, the
    gradients and the optimizer state stay float32), a no-op context for ``fp32``."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def compiled_for_training(model: nn.Module, mode: str) -> nn.Module:
    """The module a client computes its training loss with: ``model`` itself for ``mode="none"``,
    else ``torch.compile(model, mode=mode, dynamic=False)``, a wrapper that shares ``model``'s
    parameters and buffers (``model`` keeps its ``state_dict`` keys; evaluation runs on it,
    eagerly). Compiling is lazy: the first training forward pays it, once per process and input
    shape (a client's training batches all have ``batch_size`` rows)."""
    if mode == "none":
        return model
    return torch.compile(model, mode=mode, dynamic=False)


def cosine_lr(server_round: int, num_rounds: int, lr: float, lr_min: float) -> float:
    """eta_r = lr_min + (lr - lr_min) * (1 + cos(pi (r - 1) / R)) / 2, constant within round r."""
    return lr_min + (lr - lr_min) * 0.5 * (1.0 + math.cos(math.pi * (server_round - 1) / num_rounds))


@dataclass
class TrainStats:
    loss: float  # mean training loss over the round's steps
    num_examples: int  # examples processed (steps x batch)


def classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor],
                        channels_last: bool = False) -> tuple[Tensor, int]:
    """Cross-entropy of an (images, labels) batch, and its number of examples."""
    images, labels = batch
    logits = model(images.contiguous(memory_format=memory_format(channels_last)))
    return F.cross_entropy(logits, labels), labels.shape[0]


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches, steps: int,
                precision: str = "fp32", channels_last: bool = False,
                after_step: Callable[[int], None] | None = None,
                loss_fn: Callable[[nn.Module, object], tuple[Tensor, int]] | None = None,
                train_module: nn.Module | None = None) -> TrainStats:
    """Run ``steps`` optimizer steps on batches drawn from ``batches.next_batch()``.

    ``loss_fn(module, batch) -> (loss, examples)`` (default: :func:`classification_loss`) runs
    under ``precision`` (:func:`autocast`) with ``module`` = ``train_module`` (default: ``model``;
    :func:`compiled_for_training` gives a compiled one over the same parameters). The loss is
    summed on the device and read once at the end (no host sync per step). ``after_step(k)`` runs
    after the k-th step (1-based), the gradients still in place.
    """
    if loss_fn is None:
        loss_fn = functools.partial(classification_loss, channels_last=channels_last)
    compiled = train_module is not None and train_module is not model
    train_module = model if train_module is None else train_module
    model.train()
    loss_sum = None
    num_examples = 0
    device = next(model.parameters()).device
    for step in range(1, steps + 1):
        batch = batches.next_batch()
        if compiled:
            # a new iteration for CUDA graphs (mode reduce-overhead): the previous step's graph
            # outputs may be overwritten from here on; a no-op without CUDA graphs
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(device, precision):
            loss, examples = loss_fn(train_module, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if after_step is not None:
            after_step(step)
        # a copy, not the first loss itself: a loss_fn may return a compiled module's output, which
        # under CUDA graphs lives in the graph's buffer that the next step's replay overwrites
        loss_sum = loss.detach().clone() if loss_sum is None else loss_sum + loss.detach()
        num_examples += examples
    return TrainStats(loss=float(loss_sum) / steps, num_examples=num_examples)


@dataclass
class EvalStats:
    loss: float
    accuracy: float
    num_examples: int


@torch.no_grad()
def evaluate(model: nn.Module, batches: Iterable[tuple[Tensor, Tensor]], precision: str = "fp32",
             channels_last: bool = False) -> EvalStats:
    """Mean cross-entropy and accuracy over all batches. The sums stay on the model's device
    (the loss in float64) and are read once at the end, so a GPU evaluation does not wait for
    the device after every batch."""
    model.eval()
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    layout = memory_format(channels_last)
    for images, labels in batches:
        with autocast(device, precision):
            logits = model(images.contiguous(memory_format=layout)).float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum")
        correct += (logits.argmax(dim=1) == labels).sum()
        count += labels.shape[0]
    return EvalStats(loss=float(loss_sum) / max(count, 1), accuracy=int(correct) / max(count, 1),
                     num_examples=count)
