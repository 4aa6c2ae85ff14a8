"""Whether tensors hold NaN or inf: the one check behind the reply checks (fedact_app.replies),
the aggregate check (fedact_app.strategy), checkpoints and the final model. Plain torch."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no entry is inf or NaN. The sum is inf or NaN when an entry is (IEEE addition never
    turns them back into a finite number), so one reduction without a temporary decides; only a
    sum that is not finite (such an entry, or an overflow of finite ones) is checked entry by entry."""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


def non_finite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names (sorted) of the floating-point tensors holding NaN or inf."""
    return sorted(name for name, t in tensors.items() if t.is_floating_point() and not all_finite(t))


def describe_names(names: list[str]) -> str:
    """The first five names, and how many more there are."""
    return f"{names[:5]}" + (f" and {len(names) - 5} more" if len(names) > 5 else "")
