"""The federated methods: what a client optimizes, what it sends, and how the server aggregates.

This is the only module that knows methods. Everything here is plain PyTorch on dicts of tensors
keyed by the model's ``state_dict`` names; the Flower strategy and ClientApp only move these dicts
in and out of records. A method is one registry entry (``ALGORITHMS``) pairing a client rule
(``LocalRule``: builds the local optimizer, starts its round, packs its extra reply arrays) with a
server rule (``ServerRule``: owns the method's server state and aggregates).

Server rule of FedACT / FedAdamW (seed: Algorithm 1, lines 22-24), with weights w_i that are
uniform (1/S, as in the seed) or proportional to the clients' example counts:

    x^{r+1}   = x^r + server_lr * sum_i w_i Delta_i
    Delta_G^r = - sum_i w_i Delta_i / (sum_k eta_{i,k})      (= -1/(S K eta) sum_i Delta_i, equal K, eta)
    v_bar^{r+1} = sum_i w_i v_i

``Delta_G`` and ``v_bar`` cover trainable parameters only. Buffers (BatchNorm statistics) travel in
x and take the plain weighted mean of their deltas (``server_lr`` is for parameters); integer
buffers (``num_batches_tracked``) take the rounded mean, so they stay integers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fedact_app.optim import FedACTAdamW

TensorDict = dict[str, Tensor]
NamedParams = Sequence[tuple[str, torch.nn.Parameter]]


@dataclass
class ClientUpdate:
    """One client's reply to a training round, as plain tensors."""

    delta: TensorDict  # x_i^{r,K} - x^r for every model state entry
    num_steps: int  # K_i, local steps taken
    lr_sum: float  # sum_k eta_{i,k}, the learning rates used
    num_examples: int
    arrays: dict[str, TensorDict] = field(default_factory=dict)  # method-specific (FedACT: "v")


# ---------------------------------------------------------------- aggregation math (pure functions)


def client_weights(updates: Sequence[ClientUpdate], weighting: str) -> list[float]:
    """Aggregation weights summing to 1: ``uniform`` (1/S) or by ``examples``."""
    if weighting == "uniform":
        return [1.0 / len(updates)] * len(updates)
    if weighting == "examples":
        total = sum(u.num_examples for u in updates)
        return [u.num_examples / total for u in updates]
    raise ValueError(f"Invalid weighting {weighting!r}: allowed uniform, examples")


def weighted_mean(tensors: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """sum_i w_i t_i, accumulated in the tensors' (floating) dtype."""
    total = torch.zeros_like(tensors[0])
    for tensor, weight in zip(tensors, weights):
        total.add_(tensor, alpha=weight)
    return total


def mean_delta(updates: Sequence[ClientUpdate], weights: Sequence[float]) -> TensorDict:
    """The weighted mean of the clients' model deltas; integer entries are rounded to integers."""
    out = {}
    for name, first in updates[0].delta.items():
        deltas = [u.delta[name] for u in updates]
        if first.is_floating_point():
            out[name] = weighted_mean(deltas, weights)
        else:
            mean = weighted_mean([d.double() for d in deltas], weights)
            out[name] = torch.round(mean).to(first.dtype)
    return out


def apply_server_update(x: TensorDict, delta: TensorDict, server_lr: float,
                        trainable: set[str]) -> TensorDict:
    """x + server_lr * delta on trainable parameters, x + delta on buffers (new tensors)."""
    return {name: x[name] + (delta[name] * server_lr if name in trainable else delta[name])
            for name in x}


def global_correction(updates: Sequence[ClientUpdate], weights: Sequence[float],
                      trainable: Sequence[str]) -> TensorDict:
    """Delta_G = - sum_i w_i Delta_i / lr_sum_i over the trainable parameters."""
    scaled = [-w / u.lr_sum for u, w in zip(updates, weights)]
    return {name: weighted_mean([u.delta[name] for u in updates], scaled) for name in trainable}


def mean_arrays(updates: Sequence[ClientUpdate], key: str, weights: Sequence[float]) -> TensorDict:
    """The weighted mean of one method-specific array dict (e.g. v_bar = sum_i w_i v_i)."""
    names = updates[0].arrays[key].keys()
    return {name: weighted_mean([u.arrays[key][name] for u in updates], weights) for name in names}


# ---------------------------------------------------------------- rules


class LocalRule(ABC):
    """Client side of a method: the local optimizer and what it adds to the reply."""

    @abstractmethod
    def make_optimizer(self, named_params: NamedParams) -> torch.optim.Optimizer:
        """The local optimizer over the trainable parameters (learning rate set per round)."""

    @abstractmethod
    def begin_round(self, optimizer: torch.optim.Optimizer, named_params: NamedParams,
                    received: dict[str, TensorDict], global_step: int) -> None:
        """Reset the optimizer for a round from the server's broadcast arrays."""

    @abstractmethod
    def reply_arrays(self, optimizer: torch.optim.Optimizer,
                     named_params: NamedParams) -> dict[str, TensorDict]:
        """Method-specific arrays sent back with the model delta."""


class ServerRule(ABC):
    """Server side of a method: its state between rounds and its aggregation."""

    reply_keys: tuple[str, ...] = ()  # method-specific array dicts every reply must carry

    @abstractmethod
    def broadcast(self) -> dict[str, TensorDict]:
        """Arrays sent to every sampled client with the global model (absent ones mean zeros)."""

    @abstractmethod
    def aggregate(self, x: TensorDict, updates: Sequence[ClientUpdate]) -> TensorDict:
        """The next global model state from the current one and the round's updates."""


class FedACTLocal(LocalRule):
    """FedACT-AdamW on the client (seed: Algorithm 1, lines 4-21); ``trust_signal`` picks the
    variant: corrected (FedACT), local (FedACT-Local) or none (FedAdamW)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    def make_optimizer(self, named_params: NamedParams) -> FedACTAdamW:
        c = self.cfg
        return FedACTAdamW([p for _, p in named_params], lr=c.lr, betas=tuple(c.betas), eps=c.eps,
                           weight_decay=c.weight_decay, rho=c.rho, tau=c.tau, alpha=c.alpha,
                           gamma=c.gamma, trust_scope=c.trust_scope, trust_signal=c.trust_signal,
                           scale_matched=c.scale_matched)

    def begin_round(self, optimizer: FedACTAdamW, named_params: NamedParams,
                    received: dict[str, TensorDict], global_step: int) -> None:
        def aligned(key: str) -> list[Tensor] | None:
            arrays = received.get(key)
            return None if arrays is None else [arrays[name] for name, _ in named_params]

        optimizer.begin_round(v_bar=aligned("v_bar"), delta_g=aligned("delta_g"),
                              global_step=global_step)

    def reply_arrays(self, optimizer: FedACTAdamW, named_params: NamedParams) -> dict[str, TensorDict]:
        return {"v": {name: v for (name, _), v in zip(named_params, optimizer.second_moments())}}


class FedACTServer(ServerRule):
    """FedACT / FedAdamW aggregation (seed: Algorithm 1, lines 22-24; module docstring)."""

    reply_keys = ("v",)

    def __init__(self, cfg, trainable: Sequence[str]) -> None:
        self.server_lr = cfg.server_lr
        self.weighting = cfg.weighting
        self.trainable = list(trainable)
        self.v_bar: TensorDict | None = None
        self.delta_g: TensorDict | None = None

    def broadcast(self) -> dict[str, TensorDict]:
        arrays = {"v_bar": self.v_bar, "delta_g": self.delta_g}
        return {key: value for key, value in arrays.items() if value is not None}

    def aggregate(self, x: TensorDict, updates: Sequence[ClientUpdate]) -> TensorDict:
        weights = client_weights(updates, self.weighting)
        new_x = apply_server_update(x, mean_delta(updates, weights), self.server_lr,
                                    set(self.trainable))
        self.delta_g = global_correction(updates, weights, self.trainable)
        self.v_bar = mean_arrays(updates, "v", weights)
        return new_x


@dataclass(frozen=True)
class Algorithm:
    """A method: its client rule, its server rule, and config values it requires."""

    local: Callable[..., LocalRule]
    server: Callable[..., ServerRule]
    required: dict = field(default_factory=dict)  # algorithm config values the method fixes


ALGORITHMS: dict[str, Algorithm] = {
    "fedact": Algorithm(FedACTLocal, FedACTServer, {"trust_signal": "corrected"}),
    "fedadamw": Algorithm(FedACTLocal, FedACTServer, {"trust_signal": "none"}),
}
