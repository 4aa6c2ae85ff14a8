"""Wire format of the arrays in Flower messages: the dtype of the server's broadcast arrays
(v_bar, Delta_G, SCAFFOLD's c; ``wire_dtype``) and how tensors become an ``ArrayRecord``.

``float32`` sends them as they are; ``float16`` and ``bfloat16`` halve their bytes. Flower's
``ArrayRecord`` goes through NumPy, which has no bfloat16, so bfloat16 travels as the int16 view
of its bits and the client, which composes the same config, views it back. Clients always compute
in float32 (:func:`from_wire`). float16's smallest normal is 6.1e-5 (subnormals down to 6e-8):
second moments below that lose precision or flush to zero, so ``bfloat16`` (float32's exponent
range, 8 bits of mantissa) is the one to use for v_bar; docs/PERFORMANCE.md has the measured effect.

:func:`array_record` builds the record Flower's ``ArrayRecord(tensors)`` builds (NumPy's ``.npy``
bytes, so any Flower app reads it) with one copy of each array instead of ``np.save`` into a
growing buffer and a copy out of it. :func:`npy_values` reads such an array back without a copy
(``Array.numpy`` parses the header and copies the bytes out of a stream first), so a reply's
arrays are copied once, into where the server keeps them.
"""

from __future__ import annotations

import functools
import io
import math

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import Tensor

TensorDict = dict[str, Tensor]


def to_wire(tensors: TensorDict, wire_dtype: str) -> TensorDict:
    """Floating tensors in ``wire_dtype`` (bfloat16 as its int16 bit pattern)."""
    if wire_dtype == "float32":
        return tensors
    dtype = getattr(torch, wire_dtype)
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point():
            t = t.to(dtype)
            t = t.view(torch.int16) if dtype == torch.bfloat16 else t
        out[name] = t
    return out


def from_wire(tensors: TensorDict, wire_dtype: str) -> TensorDict:
    """The float32 tensors a client computes with, from what :func:`to_wire` sent."""
    if wire_dtype == "bfloat16":
        return {name: t.view(torch.bfloat16).float() if t.dtype == torch.int16 else t
                for name, t in tensors.items()}
    return {name: t.float() if t.is_floating_point() else t for name, t in tensors.items()}


def array_record(tensors: TensorDict) -> ArrayRecord:
    """``ArrayRecord(tensors)``, each array's ``.npy`` bytes written once (45 MB: 18 ms instead of
    34 ms on the CPU of docs/PERFORMANCE.md); the bytes are those ``np.save`` writes for a
    C-contiguous array (a non-contiguous tensor is sent in C order)."""
    return ArrayRecord({name: _npy_array(t) for name, t in tensors.items()})


NPY_MAGIC = b"\x93NUMPY"


def npy_values(array: Array) -> np.ndarray:
    """The values of a received ``Array`` of ``.npy`` bytes, as a read-only NumPy view of its bytes
    (no copy). The ``Array``'s own ``dtype`` and ``shape`` (what :func:`array_record` and Flower's
    ``Array`` write) say what the last bytes hold; the ``.npy`` header before them must have the
    length its prefix states and say that dtype, that shape and C order, as ``np.save`` writes
    them (evaluating each header, as ``Array.numpy`` does, costs more than copying a small array).
    ValueError when the bytes are not such an array."""
    if array.stype != "numpy.ndarray":
        raise ValueError(f"serialization type {array.stype!r}, expected 'numpy.ndarray'")
    dtype = _dtype(array.dtype)
    shape = tuple(array.shape)
    if dtype.hasobject or any(not isinstance(n, int) or n < 0 for n in shape):
        raise ValueError(f"{shape} {dtype} is not an array of numbers")
    data = array.data
    size = math.prod(shape) * dtype.itemsize
    offset = len(data) - size
    if offset < 12 or not data.startswith(NPY_MAGIC) or data[6] not in (1, 2, 3):
        raise ValueError(f"{len(data)} bytes are no .npy array of {shape} {dtype} ({size} bytes of values)")
    start = 10 if data[6] == 1 else 12
    if start + int.from_bytes(data[8:start], "little") != offset:
        raise ValueError(f"{len(data)} bytes are no .npy array of {shape} {dtype}: the header's length "
                         f"and {size} bytes of values do not add up")
    header = data[start:offset]
    for field in (f"'descr': '{dtype.str}'", "'fortran_order': False", f"'shape': {shape!r}"):
        if field.encode() not in header:
            raise ValueError(f"the .npy header {header.strip()!r} does not say {field}")
    return np.frombuffer(array.data, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)


@functools.lru_cache(maxsize=64)
def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError as err:
        raise ValueError(f"dtype {name!r}: {err}") from None


def _npy_array(tensor: Tensor) -> Array:
    array = tensor.detach().cpu().numpy()
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return Array(dtype=str(array.dtype), shape=tuple(array.shape), stype="numpy.ndarray",
                 data=b"".join((header.getvalue(), array.data)))
