"""Vision data, step 2: a split decoded into memory as :class:`ImageTensors` (float32, resized to
``dataset.image_size``, normalized with the dataset's mean/std)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from fedact_app.config import DatasetConfig
from fedact_app.tasks.vision.splits import IMAGE, ArraySplit, Split, labels_of

if TYPE_CHECKING:
    import datasets

CHUNK_ROWS = 1024  # images decoded at a time (PIL's work per block; the memory a writer of the blocks holds)


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

def to_image_tensors(ds: Split, cfg: DatasetConfig) -> ImageTensors:
    """Decode a split (its images and labels) into normalized float32 tensors."""
    images = _decode_images(ds, cfg)
    images = _resize(images, cfg.image_size)
    mean = torch.tensor(cfg.mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(cfg.std, dtype=torch.float32).view(-1, 1, 1)
    labels = torch.from_numpy(labels_of(ds).astype(np.int64))
    return ImageTensors(((images - mean) / std).contiguous(), labels)


def _decode_images(ds: Split, cfg: DatasetConfig) -> Tensor:
    """(N, C, H, W) float32 in [0, 1], from PIL images or from (C, H, W) arrays."""
    if isinstance(ds, ArraySplit):
        return _array_images(ds.images, cfg)
    pixels = image_pixels(ds, cfg)
    if pixels is None:  # arrays: their values as they are, whatever the dtype (uint8 too)
        return _array_images(np.asarray(ds.with_format("numpy", columns=[IMAGE])[:][IMAGE], dtype=np.float32), cfg)
    return _array_images(pixels, cfg)


def image_pixels(ds: datasets.Dataset, cfg: DatasetConfig) -> np.ndarray | None:
    """A split's image column decoded to uint8 pixels (N, C, S, S) of ``cfg.channels`` at
    ``cfg.image_size`` (mode converted, resized with PIL's bilinear filter where the size differs);
    None when the column holds arrays rather than images."""
    chunks = image_chunks(ds, cfg)
    if chunks is None:
        return None
    empty = np.empty((0, cfg.channels, cfg.image_size, cfg.image_size), dtype=np.uint8)  # (a split without rows)
    return np.concatenate([empty, *chunks])


def image_chunks(ds: datasets.Dataset, cfg: DatasetConfig) -> Iterator[np.ndarray] | None:
    """:func:`image_pixels` as consecutive blocks of at most :data:`CHUNK_ROWS` rows, decoded one
    at a time as they are taken (a caller writing them out holds one block); None when the column
    holds arrays rather than images."""
    import datasets

    feature = ds.features[IMAGE]
    if isinstance(feature, dict) and "bytes" in feature:  # parquet written without HF metadata
        ds = ds.cast_column(IMAGE, datasets.Image())
        feature = ds.features[IMAGE]
    if not isinstance(feature, datasets.Image):
        return None
    return (_pil_pixels(batch[IMAGE], cfg) for batch in ds.select_columns([IMAGE]).iter(batch_size=CHUNK_ROWS))


def _array_images(arrays: Any, cfg: DatasetConfig) -> Tensor:
    """Image arrays (N, C, H, W) or (N, H, W), checked against ``cfg.channels``: floats in [0, 1]
    as float32, or uint8 pixels divided by 255."""
    arrays = np.asarray(arrays)
    if arrays.dtype == np.uint8:  # (astype copies: the arrays may be a read-only mapped file)
        images = torch.from_numpy(arrays.astype(np.float32)).div_(255.0)
    else:
        images = torch.as_tensor(arrays.astype(np.float32, copy=False))
    if images.dim() == 3:
        images = images.unsqueeze(1)
    if images.dim() != 4 or images.shape[1] != cfg.channels:
        raise ValueError(f"Image arrays of dataset {cfg.name!r} have shape {tuple(images.shape[1:])}; "
                         f"expected ({cfg.channels}, H, W)")
    return images


def _pil_pixels(images: list[Any], cfg: DatasetConfig) -> np.ndarray:
    """PIL images -> (B, C, S, S) uint8: mode converted, resized to S if needed."""
    mode = "RGB" if cfg.channels == 3 else "L"
    size = (cfg.image_size, cfg.image_size)
    arrays = []
    for image in images:
        image = image.convert(mode)
        if image.size != size:
            image = image.resize(size, Image.BILINEAR)
        arrays.append(np.asarray(image, dtype=np.uint8).reshape(cfg.image_size, cfg.image_size, cfg.channels))
    return np.ascontiguousarray(np.stack(arrays).transpose(0, 3, 1, 2))


def _resize(images: Tensor, size: int) -> Tensor:
    """Bilinear resize of an (N, C, H, W) batch to (size, size) when it is not that size."""
    if images.shape[-2:] == (size, size) or images.shape[0] == 0:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=True)

