"""Wire format of the server's broadcast arrays (v_bar, Delta_G, SCAFFOLD's c): ``wire_dtype``.

``float32`` sends them as they are; ``float16`` and ``bfloat16`` halve their bytes. Flower's
``ArrayRecord`` goes through NumPy, which has no bfloat16, so bfloat16 travels as the int16 view
of its bits and the client, which composes the same config, views it back. Clients always compute
in float32 (:func:`from_wire`). float16's smallest normal is 6.1e-5 (subnormals down to 6e-8):
second moments below that lose precision or flush to zero, so ``bfloat16`` (float32's exponent
range, 8 bits of mantissa) is the one to use for v_bar; docs/PERFORMANCE.md has the measured effect.
"""

from __future__ import annotations

import torch
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
