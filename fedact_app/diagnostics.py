"""Mechanism diagnostics of the seed (Appendix A, "Evaluation metrics"), as plain PyTorch.

Server side, every round, over the S accepted client updates Delta_i (trainable parameters):

    DC^r = (1/S) sum_i cos(Delta_i, Delta_bar),   Delta_bar = (1/S) sum_j Delta_j
    ||Delta_G^r||_2, the global norm of the correction the server broadcasts next

Client side, on the trust score s = u (.) g of a local step (u: the method's update direction
before any modulation, g: the stochastic gradient; d coordinates of all trainable tensors):

    PosRatio  = (1/d) #{j : s_j > 0}
    TopMass_p = sum_{j in Top_p(s)} [s_j]_+ / sum_j [s_j]_+   (Top_p: the ceil(p d) largest s_j;
                                                                0 when the denominator is 0)
    amplified fraction = (1/d) #{j : phi_j > 1}   (coordinates ACT steps further than the dense
                                                   corrected direction; FedACT family only)

The seed averages PosRatio and TopMass_p over all (client, step) pairs of a round; a client here
samples every ``every``-th local step (a pass over d coordinates each), averages its samples, and
the server averages over the clients that report them (the same mean when all clients take the
same steps). Nothing here writes to the optimizer or the model: training is the same with the
diagnostics on or off.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Optional

import numpy as np
import torch
from torch import Tensor

# Client statistics: reply metric name -> metrics.jsonl column
CLIENT_METRICS = {"positive-ratio": "positive_ratio", "top-p-mass": "top_p_mass",
                  "amplified-fraction": "amplified_fraction"}


_FLOAT64_CHUNK = 1 << 16  # entries of each vector converted to float64 at a time on the CPU: the block stays in cache
_FLOAT64_BLOCK_DEVICE = 1 << 23  # on an accelerator: blocks of 8 Mi float64 entries, 64 MiB (few kernels, one sync)


def _float64_blocks(parts: Iterable[Sequence[Tensor]], rows: int) -> Iterator[Tensor]:
    """Blocks of ``rows`` float64 rows: row ``i`` holds, chunk by chunk, the entries of
    ``part[i]`` for every part (the same piece of each vector, equal sizes), and any row past
    ``len(part)`` is left for the caller to fill. Blocks share one buffer: use each before the next.
    The chunk is ``_FLOAT64_CHUNK`` entries on the CPU (4 times that for one row, twice for two),
    on a device ``_FLOAT64_BLOCK_DEVICE`` entries over the rows (at least ``_FLOAT64_CHUNK`` each)."""
    buffer: Optional[Tensor] = None
    for part in parts:
        flat = [t.detach().reshape(-1) for t in part]
        if buffer is None:  # on the CPU, fewer rows take longer chunks: one or two rows of 64 Ki
            # entries leave the cache mostly unused (the norm of one ViT-Tiny vector: 1.5 ms a
            # vector at 64 Ki, 1.0 ms at 256 Ki on the 2-vCPU AMD EPYC VM; 11 rows at 256 Ki: 3.5x slower)
            chunk = (_FLOAT64_CHUNK * max(1, 4 // rows) if flat[0].device.type == "cpu"
                     else max(_FLOAT64_CHUNK, _FLOAT64_BLOCK_DEVICE // rows))
            buffer = torch.empty(rows, chunk, dtype=torch.float64, device=flat[0].device)
        size = flat[0].numel()
        for start in range(0, size, buffer.shape[1]):
            block = buffer[:, :min(buffer.shape[1], size - start)]
            for row, x in zip(block, flat):
                row.copy_(x[start:start + block.shape[1]])
            yield block


def direction_consistency(deltas: Sequence[Mapping[str, Tensor]], names: Sequence[str]) -> float:
    """DC = (1/S) sum_i cos(Delta_i, Delta_bar) over the entries ``names`` (the cosine of a zero
    vector counts as 0). Products and sums in float64, over blocks that stay in cache: each block
    holds a chunk of every Delta_i and of their mean, and one matrix-vector product gives that
    chunk's <Delta_i, Delta_bar> and ||Delta_bar||^2."""
    return _direction_consistency(([d[name] for d in deltas] for name in names), len(deltas))


def vectors_direction_consistency(vectors: Sequence[Tensor]) -> float:
    """:func:`direction_consistency` of the S updates given as one vector each (equal sizes), e.g.
    ``fedact_app.packing.as_vector`` views of decoded replies: one pass over the S x d entries."""
    return _direction_consistency([vectors], len(vectors))


def _direction_consistency(parts: Iterable[Sequence[Tensor]], count: int) -> float:
    with_mean = squares = None  # <Delta_i, Delta_bar>, then ||Delta_bar||^2; ||Delta_i||^2 (on the device)
    for block in _float64_blocks(parts, count + 1):
        torch.mean(block[:count], dim=0, out=block[count])
        dots, norms = block.mv(block[count]), torch.linalg.vecdot(block[:count], block[:count])
        with_mean = dots if with_mean is None else with_mean + dots
        squares = norms if squares is None else squares + norms
    if with_mean is None:
        with_mean, squares = torch.zeros(count + 1, dtype=torch.float64), torch.zeros(count, dtype=torch.float64)
    with_mean, squares = with_mean.cpu(), squares.cpu()
    mean_norm = float(with_mean[count])
    cosines = [float(dot) / math.sqrt(float(norm) * mean_norm) if norm > 0 and mean_norm > 0 else 0.0
               for dot, norm in zip(with_mean[:count], squares)]
    return sum(cosines) / len(cosines)


def global_norm(tensors: Mapping[str, Tensor]) -> float:
    """sqrt(sum_p ||t_p||^2), squares and sums in float64 (over blocks that stay in cache)."""
    total = sum(float(block[0].dot(block[0])) for block in _float64_blocks(([t] for t in tensors.values()), 1))
    return math.sqrt(total)


def vector_norms(vectors: Sequence[Tensor]) -> list[float]:
    """Each vector's L2 norm (equal sizes), squares and sums in float64, all S in one pass over
    blocks of S rows (:func:`global_norm` of each, one vector at a time, costs S passes)."""
    if not vectors:
        return []
    squares = None
    for block in _float64_blocks([vectors], len(vectors)):
        part = torch.linalg.vecdot(block, block)
        squares = part if squares is None else squares + part
    return [0.0] * len(vectors) if squares is None else [math.sqrt(float(s)) for s in squares.cpu()]


def trust_score_statistics(scores: Sequence[Tensor], top_p: float) -> tuple[float, float]:
    """(PosRatio, TopMass_p) of one local step's trust scores, one tensor per parameter."""
    positive = torch.cat([s.detach().reshape(-1) for s in scores])
    if positive.dtype not in (torch.float32, torch.float64):  # bf16/fp16 parameters
        positive = positive.float()
    positive.clamp_min_(0.0)
    d = positive.numel()
    ratio = int(torch.count_nonzero(positive)) / d
    total = float(positive.sum(dtype=torch.float64))
    if total == 0.0:
        return ratio, 0.0
    k = min(d, math.ceil(round(top_p * d, 9)))  # round: 0.07 * 100 is 7.000000000000001
    return ratio, _sum_of_largest(positive, k) / total


def _sum_of_largest(values: Tensor, k: int) -> float:
    """The sum of the ``k`` largest entries of a 1-D tensor, in float64 (ties do not matter for a
    sum): ``np.partition`` on the CPU (about 10x faster there than ``torch.topk`` for k = 1 % of
    millions), ``torch.topk`` on a device."""
    if values.device.type == "cpu":
        array = values.numpy()
        return float(np.partition(array, array.size - k)[array.size - k:].sum(dtype=np.float64))
    return float(torch.topk(values, k, sorted=False).values.sum(dtype=torch.float64))


def adam_direction(optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
    """(u, g) of the last step of ``torch.optim.Adam``/``AdamW`` for every parameter with a
    gradient: u = m_hat / (sqrt(v_hat) + eps), the bias-corrected Adam direction (LocalAdam(W))."""
    pairs = []
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            state = optimizer.state.get(p)
            if p.grad is None or not state:
                continue
            step = float(state["step"])
            m_hat = state["exp_avg"] / (1.0 - beta1 ** step)
            v_hat = state["exp_avg_sq"] / (1.0 - beta2 ** step)
            pairs.append((m_hat / (v_hat.sqrt() + group["eps"]), p.grad))
    return pairs


class TrustProbe:
    """The client-side statistics of one round: every ``every``-th local step (``every = 0``:
    never), the trust score of the method's last step, summarized and averaged over the samples.

    ``direction``: returns the (u, g) pairs of the last step (parameters with a gradient), or None
    for a method without a trust score. ``amplified``: the last step's amplified fraction, or None.
    """

    def __init__(self, every: int, top_p: float,
                 direction: Callable[[], Optional[list[tuple[Tensor, Tensor]]]],
                 amplified: Callable[[], Optional[float]]) -> None:
        self.every, self.top_p = every, top_p
        self.direction, self.amplified = direction, amplified
        self.samples: dict[str, list[float]] = {key: [] for key in CLIENT_METRICS}

    def after_step(self, local_step: int) -> None:
        """Called after optimizer step ``local_step`` (1-based)."""
        if not self.every or local_step % self.every:
            return
        pairs = self.direction()
        if pairs is not None:
            ratio, mass = trust_score_statistics([u * g for u, g in pairs], self.top_p)
            self.samples["positive-ratio"].append(ratio)
            self.samples["top-p-mass"].append(mass)
        amplified = self.amplified()
        if amplified is not None:
            self.samples["amplified-fraction"].append(amplified)

    def summary(self) -> dict[str, float]:
        """The mean of each statistic over the sampled steps (statistics never sampled are absent)."""
        return {key: sum(values) / len(values) for key, values in self.samples.items() if values}


def mean_client_statistics(client_metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The round's client statistics: each one's mean over the clients that report it, under its
    metrics.jsonl column name (absent when no client reports it)."""
    out = {}
    for key, column in CLIENT_METRICS.items():
        values = [float(m[key]) for m in client_metrics if key in m]
        if values:
            out[column] = sum(values) / len(values)
    return out
