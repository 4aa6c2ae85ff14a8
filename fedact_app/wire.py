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
(``Array.numpy`` copies the bytes out of a stream first), so a reply's arrays are copied once, into
where the server keeps them.
"""

from __future__ import annotations

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


def npy_values(array: Array) -> np.ndarray:
    """The values of a received ``Array`` of ``.npy`` bytes, as a read-only NumPy view of its bytes
    (no copy); a Fortran-ordered or object array is loaded by ``Array.numpy``. ValueError when the
    bytes are not such an array (a bad header, fewer bytes than its shape needs)."""
    if array.stype != "numpy.ndarray":
        raise ValueError(f"serialization type {array.stype!r}, expected 'numpy.ndarray'")
    stream = io.BytesIO(array.data)
    version = np.lib.format.read_magic(stream)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                   (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read_header is None:
        return array.numpy()
    shape, fortran_order, dtype = read_header(stream)
    if fortran_order or dtype.hasobject:
        return array.numpy()
    count = math.prod(shape)
    offset = stream.tell()
    if len(array.data) - offset < count * dtype.itemsize:
        raise ValueError(f"{len(array.data) - offset} bytes of values, {shape} {dtype} needs {count * dtype.itemsize}")
    return np.frombuffer(array.data, dtype=dtype, count=count, offset=offset).reshape(shape)


def _npy_array(tensor: Tensor) -> Array:
    array = tensor.detach().cpu().numpy()
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return Array(dtype=str(array.dtype), shape=tuple(array.shape), stype="numpy.ndarray",
                 data=b"".join((header.getvalue(), array.data)))
