"""One vector per dict of tensors: a reply's arrays decoded into one contiguous vector, the dict's
tensors views into it, so that a pass over every entry is one operation, not one per tensor.

:func:`views` cuts one vector into named tensors; :func:`consecutive` finds the
longest run of named entries that already lie one after the other in one storage (as such views
do), and :func:`as_vector` returns those entries as one vector: a view when they are
consecutive, else a copy (``torch.cat``). Plain torch, no Flower types.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

TensorDict = dict[str, Tensor]


def views(vector: Tensor, names: Sequence[str], shapes: Sequence[torch.Size]) -> TensorDict:
    """``vector`` cut into consecutive tensors of ``shapes``, named ``names`` (views, no copy)."""
    out, start = {}, 0
    for name, shape in zip(names, shapes):
        size = shape.numel()
        out[name] = vector[start:start + size].view(shape)
        start += size
    return out


def consecutive(tensors: Mapping[str, Tensor], names: Sequence[str]) -> int:
    """How many of ``names``, from the first, are contiguous tensors of one dtype that lie one
    after the other in one storage (so :func:`as_vector` can view them as one vector)."""
    count, end, first = 0, None, None
    for name in names:
        t = tensors[name]
        if not t.is_contiguous() or (first is not None and (
                t.dtype != first.dtype or t.device != first.device
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != end)):
            break
        first = first if first is not None else t
        end = t.storage_offset() + t.numel()
        count += 1
    return count


def as_vector(tensors: Mapping[str, Tensor], names: Sequence[str] | None = None) -> Tensor:
    """The entries ``names`` (default: all) as one 1-D vector: a view of their storage when they
    lie one after the other in it (:func:`consecutive`), else a new vector (``torch.cat``, which
    promotes mixed dtypes)."""
    names = list(tensors) if names is None else list(names)
    if not names:
        return torch.empty(0)
    first = tensors[names[0]]
    if consecutive(tensors, names) == len(names):
        total = sum(tensors[name].numel() for name in names)
        return first.as_strided((total,), (1,), first.storage_offset())
    return torch.cat([tensors[name].reshape(-1) for name in names])


class VectorPool:
    """Vectors reused from round to round: :meth:`take` hands out a free vector of the size and
    dtype asked for (a new one only when none is free), :meth:`recycle` frees all that were
    handed out, once nothing reads them any more (the next round). The first write to a new
    vector costs a page fault per 4 KiB page: on the 2-vCPU AMD EPYC VM of docs/PERFORMANCE.md,
    copying 10 ViT-Tiny replies (delta and v, 216 MB) into new vectors took 76-80 ms, into reused
    ones 12-13 ms. ``pin``: page-locked vectors, the staging of a copy to a GPU. Threads may take
    vectors at the same time (replies are decoded on several)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._free: dict[tuple[int, torch.dtype], list[Tensor]] = {}
        self._taken: list[Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        with self._lock:
            free = self._free.get((numel, dtype))
            vector = free.pop() if free else None
        if vector is None:  # allocated outside the lock: pinning 10 MB takes a while
            vector = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
        with self._lock:
            self._taken.append(vector)
        return vector

    def recycle(self) -> None:
        with self._lock:
            for vector in self._taken:
                self._free.setdefault((vector.numel(), vector.dtype), []).append(vector)
            self._taken.clear()
