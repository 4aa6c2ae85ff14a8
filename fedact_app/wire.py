"""Wire format of the arrays in Flower messages: how a dict of tensors becomes one ``ArrayRecord``
(:func:`packed_record`, read back by :func:`unpacked` or, checked entry by entry, by
:func:`packed_entries`), and the dtype of the server's broadcast arrays (v_bar, Delta_G,
SCAFFOLD's c; ``wire_dtype``) and of the clients' reply arrays (Delta, v, SCAFFOLD's change
of c; ``reply_dtype``).

A packed record holds one array per dtype, named by it (``"float32"``: every float32 tensor's
values one after the other, in the dict's order), and a ``"layout"`` array: the UTF-8 JSON list
``[[name, dtype, shape], ...]`` that cuts them back into named tensors. Flower 1.41 moves a
message as content-addressed objects, one per array and per 5 MiB chunk of it, each pulled and
pushed on its own between SuperLink, SuperNode and ClientApp: a FedACT training message of
ViT-Tiny is 19 objects packed, 485 with one array per tensor (docs/PERFORMANCE.md has the
measured rounds). Every array is NumPy's ``.npy`` bytes, as Flower's own ``Array`` writes them.

``float32`` sends the broadcast arrays as they are; ``float16`` and ``bfloat16`` halve their
bytes. NumPy has no bfloat16, so bfloat16 travels as the int16 view of its bits and the client,
which composes the same config, views it back. Clients always compute in float32
(:func:`from_wire`). float16's smallest normal is 6.1e-5 (subnormals down to 6e-8): second
moments below that lose precision or flush to zero, so ``bfloat16`` (float32's exponent range,
8 bits of mantissa) is the one to use for v_bar; docs/PERFORMANCE.md has the measured effect.
``reply_dtype`` offers ``float32`` and ``bfloat16`` alone (float16 overflows above 65504): the
client rounds its reply's floating values to bfloat16 once it has trained in float32, and the
server widens them back exactly (fedact_app.replies.read_arrays) before any check.
"""

from __future__ import annotations

import functools
import io
import json
import math
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import Tensor

TensorDict = dict[str, Tensor]


BFLOAT16_BITS = "int16"  # NumPy's name of the dtype that holds bfloat16's bits in a packed record


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


def widen_bfloat16(target: np.ndarray, source: np.ndarray) -> None:
    """float32 ``target`` <- the bfloat16 values whose bits ``source`` (int16) holds, as
    :func:`from_wire` reads them but in one pass into a given array: a bfloat16 is the upper half
    of the float32 of the same value, so each is its bits shifted up by 16 (exact, NaN and
    infinities included)."""
    np.left_shift(source.view(np.uint16), 16, out=target.view(np.uint32), dtype=np.uint32)


NPY_MAGIC = b"\x93NUMPY"


def npy_values(array: Array) -> np.ndarray:
    """The values of a received ``Array`` of ``.npy`` bytes, as a read-only NumPy view of its bytes
    (no copy). The ``Array``'s own ``dtype`` and ``shape`` (what :func:`packed_record` and Flower's
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


LAYOUT = "layout"  # a packed record's entry naming its tensors


@dataclass(frozen=True)
class Entry:
    """Where one tensor of a packed record lies: in the array of its ``dtype`` (NumPy's name,
    the record's entry holding it), from ``offset`` on, ``shape`` in C order."""

    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def end(self) -> int:
        return self.offset + math.prod(self.shape)


def packed_record(tensors: TensorDict) -> ArrayRecord:
    """The tensors as one packed record (module docstring): their values copied once, on the host
    and in C order, into one array per dtype."""
    host = {name: t.detach().cpu().numpy() for name, t in tensors.items()}
    groups: dict[str, list[np.ndarray]] = {}
    for array in host.values():
        groups.setdefault(array.dtype.name, []).append(array)
    layout = json.dumps([[name, array.dtype.name, list(array.shape)] for name, array in host.items()],
                        separators=(",", ":")).encode()
    return ArrayRecord({LAYOUT: _npy_array([np.frombuffer(layout, np.uint8)]),
                        **{dtype: _npy_array(parts) for dtype, parts in groups.items()}})


def packed_entries(record: ArrayRecord) -> tuple[dict[str, Entry], dict[str, np.ndarray]]:
    """A packed record's tensors (name -> ``Entry``, in the record's order) and each dtype's
    values (read-only views of the record's bytes, :func:`npy_values`). ValueError naming what is
    wrong when the record is not one :func:`packed_record` writes: no layout, a layout that is not
    a list of ``[name, dtype, shape]`` with distinct names, a dtype the record holds no array of,
    an array of another dtype (this machine's byte order) or size than its tensors, or an array
    no tensor lies in."""
    if LAYOUT not in record:
        keys = [key[:80] for key in sorted(record)[:3]]  # a client's names, cut for the log
        raise ValueError(f"no {LAYOUT!r} entry (entries {keys}): not a packed record")
    raw = npy_values(record[LAYOUT])
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise ValueError(f"its {LAYOUT!r} is {raw.shape} {raw.dtype}, not UTF-8 bytes")
    try:
        layout = json.loads(raw.tobytes())
    except (ValueError, RecursionError) as err:
        raise ValueError(f"its {LAYOUT!r} is not JSON ({err})") from None
    if not isinstance(layout, list):
        raise ValueError(f"its {LAYOUT!r} is a {type(layout).__name__}, not a list of [name, dtype, shape]")
    entries: dict[str, Entry] = {}
    sizes: dict[str, int] = {}
    for item in layout:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str) and isinstance(item[1], str)
                and isinstance(item[2], list) and all(type(n) is int and n >= 0 for n in item[2])):
            raise ValueError(f"layout entry {str(item)[:80]} is not [name, dtype, shape]")
        name, dtype, shape = item
        if name in entries:
            raise ValueError(f"the layout names {name[:80]!r} twice")
        if dtype == LAYOUT or dtype not in record:
            raise ValueError(f"{name[:80]!r} is {dtype[:80]!r}, of which the record holds no array")
        entries[name] = Entry(dtype, tuple(shape), sizes.get(dtype, 0))
        sizes[dtype] = entries[name].end
    values = {}
    for dtype in record:
        if dtype == LAYOUT:
            continue
        if dtype not in sizes:
            raise ValueError(f"its array {dtype[:80]!r} holds no tensor of the layout")
        values[dtype] = npy_values(record[dtype])
        if values[dtype].dtype != _dtype(dtype) or values[dtype].shape != (sizes[dtype],):  # native byte order
            raise ValueError(f"its array {dtype!r} is {values[dtype].shape} {values[dtype].dtype.str}, the layout's "
                             f"tensors are ({sizes[dtype]},) {_dtype(dtype).str}")
    return entries, values


def unpacked(record: ArrayRecord) -> TensorDict:
    """The tensors of a packed record (:func:`packed_record`), in its order: views into one
    writable copy of each dtype's array. ValueError as :func:`packed_entries`."""
    entries, values = packed_entries(record)
    owned = {dtype: torch.from_numpy(array.copy()) for dtype, array in values.items()}
    return {name: owned[e.dtype][e.offset:e.end].view(e.shape) for name, e in entries.items()}


def _npy_array(parts: list[np.ndarray]) -> Array:
    """An ``Array`` of the parts' values one after the other (one dtype), as the ``.npy`` bytes
    ``np.save`` writes for that 1-D array, copied once."""
    dtype = parts[0].dtype
    size = sum(part.size for part in parts)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                  "fortran_order": False, "shape": (size,)})
    data = (part if part.flags.c_contiguous else part.copy(order="C") for part in parts)
    return Array(dtype=str(dtype), shape=(size,), stype="numpy.ndarray",
                 data=b"".join([header.getvalue(), *(part.data for part in data)]))
