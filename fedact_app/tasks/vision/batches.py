"""Vision data, step 4: batches from an :class:`~.tensors.ImageTensors` already on the training
device; augmentation (random crop + horizontal flip) runs there as tensor ops."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from fedact_app.tasks.vision.tensors import ImageTensors


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
