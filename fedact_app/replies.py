"""What a client reply may carry: decoding its records into a ``ClientUpdate`` and checking every
array and number in it (docs/ROBUSTNESS.md has the table).

A reply is untrusted input. Arrays must match the global state (names, shapes, dtypes) and be
finite; second moments must be >= 0; the round's K and learning rate are the server's own
(``RoundTerms``), so a reply naming others is refused and Delta_G divides by the server's K eta_r;
every other number must be finite and in range. ``ReplyError`` names what is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flwr.app import MetricRecord, RecordDict

from fedact_app.algorithms import ClientUpdate, TensorDict
from fedact_app.diagnostics import CLIENT_METRICS, global_norm
from fedact_app.finite import all_finite


class ReplyError(ValueError):
    """A client reply that cannot be aggregated."""


def record_bytes(content: RecordDict) -> int:
    """Bytes of the arrays in a record dict (what dominates the wire)."""
    return sum(record.count_bytes() for record in content.array_records.values())


@dataclass(frozen=True)
class RoundTerms:
    """What the server itself set for a round, which a reply must agree with."""

    local_steps: int  # K
    lr: float  # the round's learning rate eta_r (constant within the round)
    max_examples: int | None = None  # K x batch_size: the most examples K steps can see

    @property
    def lr_sum(self) -> float:
        """sum_k eta_{i,k} = K eta_r, as the client computes it."""
        return self.lr * self.local_steps


def decode_update(content: RecordDict, state: TensorDict, reply_keys: Sequence[str],
                  trainable: Sequence[str], nonnegative: Sequence[str] = (),
                  max_update_norm: float | None = None, terms: RoundTerms | None = None) -> ClientUpdate:
    """Turn a reply's records into a ``ClientUpdate``, checking it fits the global state.

    ``nonnegative``: reply arrays that must hold no negative value (second moments).
    ``max_update_norm``: when set, the delta's global L2 norm over the trainable parameters,
    sqrt(sum_p ||Delta_p||^2), must not exceed it (the reply is rejected, not clipped).
    ``terms``: the round's own K, learning rate and example bound. With them, ``num-steps`` must
    be K, ``lr-sum`` K eta_r (to 1e-9 relative) and ``num-examples`` at most K x batch_size, and
    the update carries the server's K eta_r, not the reply's: Delta_G divides by it.
    Every metric must be a finite number (``train-loss`` included); the client statistics lie
    in [0, 1] and ``train-seconds`` is >= 0.
    """
    for key in ("delta", "metrics", *reply_keys):
        if key not in content:
            raise ReplyError(f"missing record {key!r}")
    metrics = content["metrics"]
    num_steps = count(metrics, "num-steps")
    num_examples = count(metrics, "num-examples")
    lr_sum = number(metrics, "lr-sum")
    if not lr_sum > 0:
        raise ReplyError(f"metric 'lr-sum' must be > 0, got {lr_sum!r}")
    number(metrics, "train-loss")
    if "train-seconds" in metrics and number(metrics, "train-seconds") < 0:
        raise ReplyError(f"metric 'train-seconds' must be >= 0, got {metrics['train-seconds']!r}")
    for key in CLIENT_METRICS:
        if key in metrics and not 0 <= number(metrics, key) <= 1:
            raise ReplyError(f"metric {key!r} must lie in [0, 1], got {metrics[key]!r}")
    if terms is not None:
        if num_steps != terms.local_steps:
            raise ReplyError(f"metric 'num-steps' {num_steps} differs from the round's local_steps={terms.local_steps}")
        if not math.isclose(lr_sum, terms.lr_sum, rel_tol=1e-9):
            raise ReplyError(f"metric 'lr-sum' {lr_sum!r} differs from the round's K x lr = {terms.lr_sum!r}")
        if terms.max_examples is not None and num_examples > terms.max_examples:
            raise ReplyError(f"metric 'num-examples' {num_examples} exceeds local_steps x batch_size = "
                             f"{terms.max_examples}")
        lr_sum = terms.lr_sum
    delta = content["delta"].to_torch_state_dict()
    _check_arrays("delta", delta, {name: state[name] for name in state})
    arrays = {}
    for key in reply_keys:
        arrays[key] = content[key].to_torch_state_dict()
        _check_arrays(key, arrays[key], {name: state[name] for name in trainable})
        if key in nonnegative and (negative := [n for n, t in arrays[key].items()
                                                if t.numel() and float(t.min()) < 0]):
            raise ReplyError(f"{key!r} has negative values (in {negative[:3]}); it must be >= 0")
    if max_update_norm:
        norm = global_norm({name: delta[name] for name in trainable})
        if norm > max_update_norm:
            raise ReplyError(f"update norm {norm:.4g} exceeds max_update_norm={max_update_norm:g}")
    return ClientUpdate(delta=delta, num_steps=num_steps, lr_sum=lr_sum, num_examples=num_examples,
                        arrays=arrays)


def number(metrics: MetricRecord, key: str) -> float:
    """``metrics[key]`` as a finite float; ReplyError when it is missing, not a number or not finite."""
    value = metrics.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReplyError(f"metric {key!r} missing or not a finite number: {value!r}")
    return float(value)


def count(metrics: MetricRecord, key: str, minimum: int = 1) -> int:
    """``metrics[key]`` as an integer >= ``minimum`` (a float with an integer value is accepted)."""
    value = number(metrics, key)
    if value < minimum or value != int(value):
        raise ReplyError(f"metric {key!r} must be an integer >= {minimum}, got {metrics[key]!r}")
    return int(value)


def _check_arrays(key: str, arrays: TensorDict, expected: TensorDict) -> None:
    if arrays.keys() != expected.keys():
        missing, extra = expected.keys() - arrays.keys(), arrays.keys() - expected.keys()
        raise ReplyError(f"{key!r}: wrong entries (missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})")
    for name, tensor in arrays.items():
        if tensor.shape != expected[name].shape or tensor.dtype != expected[name].dtype:
            raise ReplyError(f"{key!r}[{name!r}]: {tuple(tensor.shape)} {tensor.dtype}, expected "
                             f"{tuple(expected[name].shape)} {expected[name].dtype}")
        if tensor.is_floating_point() and not all_finite(tensor):
            raise ReplyError(f"{key!r}[{name!r}] has non-finite values")
