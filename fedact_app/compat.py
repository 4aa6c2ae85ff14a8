"""Make ``import torchvision`` (and so ``import timm``) work with a CPU-only torch build.

torchvision 0.28 from PyPI is a CUDA build. With the CPU torch its compiled ops (``_C``) do not
load, and its meta registrations (``torchvision/_meta_registrations.py``) then fail at import with
``RuntimeError: operator torchvision::nms does not exist``. Defining the two op schemas that file
registers fake kernels for, ``torchvision::nms`` and ``torchvision::qnms``, is enough for the
pure-Python parts of torchvision (transforms, datasets) and for timm; calling the ops themselves
still fails, as it would anyway without the compiled library.

Where torchvision's compiled library loads (a matching torch/torchvision pair, e.g. on the GPU
machines) it defines the real ops and this module defines nothing: the library is loaded first,
exactly as ``torchvision.extension`` would load it, so the two never both define the schemas.

Call :func:`ensure_torchvision_ops` before the first ``import torchvision`` / ``import timm``.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import torch

# The schemas exactly as torchvision declares them (csrc/ops/nms.cpp and its quantized variant).
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)

# Kept alive for the whole process: the definitions vanish when the Library object is collected.
_LIBRARY: torch.library.Library | None = None


def _has_op(name: str) -> bool:
    """Whether ``torch.ops.torchvision.<name>`` exists (the lookup raises when it does not)."""
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _load_compiled_ops() -> bool:
    """Load torchvision's ``_C`` extension if it is installed and loads; True when it did."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    for folder in spec.submodule_search_locations:
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(folder) / f"_C{suffix}"
            if path.is_file():
                try:
                    torch.ops.load_library(str(path))
                except (ImportError, OSError):
                    return False
                return _has_op("nms")
    return False


def ensure_torchvision_ops() -> None:
    """Define ``torchvision::nms``/``qnms`` where torchvision's compiled ops cannot load.

    Idempotent. Does nothing when the ops exist, when torchvision is not installed, or when
    torchvision was already imported (then it is too late, or it imported fine).
    """
    global _LIBRARY
    if _LIBRARY is not None or "torchvision" in sys.modules or _has_op("nms"):
        return
    if importlib.util.find_spec("torchvision") is None or _load_compiled_ops():
        return
    library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        if not _has_op(schema.split("(", 1)[0]):
            library.define(schema)
    _LIBRARY = library
