"""The base class of this app's optimizers: a ``torch.optim.Optimizer`` whose construction and
``zero_grad`` do not import ``torch._dynamo`` while nothing is being compiled.

torch wraps ``Optimizer.add_param_group`` and ``Optimizer.zero_grad`` in ``torch._disable_dynamo``,
whose first call imports ``torch._dynamo`` (1.3 s on a 2-core CPU, as long as importing torch)
only to keep torch.compile from tracing them. Before that import nothing can be compiling, so
the plain functions do the same. It matters where every round starts a new process: a Flower
1.41 deployment starts a ClientApp process for each message (docs/PERFORMANCE.md). torch's own
Adam and AdamW (LocalAdam, LocalAdamW) import it at their first step regardless.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Callable, Optional

from torch import Tensor
from torch.optim import Optimizer

__all__ = ["LazyDynamoOptimizer"]


def unless_compiling(method: Callable) -> Callable:
    """``method`` of :class:`torch.optim.Optimizer` as torch wraps it, or its plain function
    (``__wrapped__``) while ``torch._dynamo`` is not imported."""
    plain = getattr(method, "__wrapped__", None)
    return plain if plain is not None and "torch._dynamo" not in sys.modules else method


class LazyDynamoOptimizer(Optimizer):
    """:class:`torch.optim.Optimizer` that leaves ``torch._dynamo`` unimported until something
    else imports it (torch.compile does)."""

    def add_param_group(self, param_group: dict) -> None:
        unless_compiling(Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        unless_compiling(Optimizer.zero_grad)(self, set_to_none)


def check_aligned(name: str, arrays: Optional[Sequence[Tensor]], params: Sequence[Tensor]) -> None:
    """``arrays`` (a round's server arrays: v_bar, Delta_G, ...) is None or one tensor per
    parameter, in param_groups order, of the parameter's shape; else a TypeError/ValueError that
    names the argument and the index."""
    if arrays is None:
        return
    if len(arrays) != len(params):
        raise ValueError(f"Invalid {name}: {len(arrays)} tensors for {len(params)} parameters; "
                         f"expected one tensor per parameter, in param_groups order")
    for i, (a, p) in enumerate(zip(arrays, params)):
        if not isinstance(a, Tensor):
            raise TypeError(f"Invalid {name}[{i}]: expected a Tensor, got {type(a).__name__}")
        if a.shape != p.shape:
            raise ValueError(f"Invalid {name}[{i}]: shape {tuple(a.shape)} does not match "
                             f"parameter {i} of shape {tuple(p.shape)}")
