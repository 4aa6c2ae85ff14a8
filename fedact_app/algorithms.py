"""The federated methods: what a client optimizes, what it sends, and how the server aggregates.

This is the only module that knows methods. Everything here is plain PyTorch on dicts of tensors
keyed by the model's ``state_dict`` names; the Flower strategy and ClientApp only move these dicts
in and out of records. A method is one registry entry (``ALGORITHMS``) pairing a client rule
(``LocalRule``: builds the local optimizer, starts its round, packs its extra reply arrays and the
client's kept state) with a server rule (``ServerRule``: owns the method's server state between
rounds and aggregates), plus the config keys the method reads. docs/METHODS.md has every method's
equations, defaults and sources; the server rules, with weights w_i that are uniform (1/S, as in
the seed) or proportional to the clients' example counts:

    mean (FedAvg, FedProx, LocalAdam, LocalAdamW):  x^{r+1} = x^r + server_lr * sum_i w_i Delta_i
    SCAFFOLD (Karimireddy et al. 2020, Alg. 1 l. 16-17):  x as mean;  c <- c + (S/N) sum_i w_i Delta c_i
    FedAdam (Reddi et al. 2021, Alg. 2):  d = sum_i w_i Delta_i;  m = b1 m + (1-b1) d;
        v = b2 v + (1-b2) d^2;  x^{r+1} = x^r + server_lr * m / (sqrt(v) + server_eps)
    FedACT / FedAdamW / FedACT-Local (seed: Algorithm 1, lines 22-24) and FedLADA:  x as mean;
        Delta_G^r = - sum_i w_i Delta_i / (sum_k eta_{i,k})   (= -1/(S K eta) sum_i Delta_i)
        v_bar^{r+1} = sum_i w_i v_i

With ``aggregation: trimmed_mean`` or ``median`` (fedact_app.aggregation) every sum_i w_i t_i
above is that coordinate-wise rule over the t_i instead, unweighted: over Delta_i for x, FedAdam's
d and the buffers, over v_i for v_bar, over Delta c_i for c, and Delta_G^r = -agg_i(Delta_i /
sum_k eta_{i,k}). ``Delta_G``, ``v_bar``, ``c`` and the FedAdam moments cover trainable parameters
only. Buffers (BatchNorm statistics) travel in x and take the aggregate of their deltas without
``server_lr`` (``server_lr`` and the server optimizer are for parameters); integer buffers
(``num_batches_tracked``) take it rounded, so they stay integers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from fedact_app.aggregation import Aggregation, TensorDict, client_weights
from fedact_app.baselines import FedLADAAdam, LocalSGD
from fedact_app.diagnostics import adam_direction
from fedact_app.optim import FedACTAdamW
from fedact_app.registry import METHODS, MethodSpec

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]


@dataclass
class ClientUpdate:
    """One client's reply to a training round, as plain tensors."""

    delta: TensorDict  # x_i^{r,K} - x^r for every model state entry
    num_steps: int  # K_i, local steps taken
    lr_sum: float  # sum_k eta_{i,k}, the learning rates used
    num_examples: int
    arrays: dict[str, TensorDict] = field(default_factory=dict)  # method-specific ("v", "delta_c")
    # L2 norms over the trainable parameters of "delta" and of each reply array, measured when
    # the reply was decoded (fedact_app.replies); absent: not measured
    norms: dict[str, float] = field(default_factory=dict)


@dataclass
class RoundInputs:
    """What a client starts a round from, besides the global model x^r."""

    received: dict[str, TensorDict]  # the server rule's broadcast arrays (an absent key means zeros)
    client_state: dict[str, TensorDict]  # this client's own arrays from its previous round ({} at first)
    global_step: int  # (r - 1) * K: steps before this round

    def to(self, device: torch.device) -> RoundInputs:
        def move(arrays: dict[str, TensorDict]) -> dict[str, TensorDict]:
            return {key: {n: t.to(device) for n, t in d.items()} for key, d in arrays.items()}

        return RoundInputs(move(self.received), move(self.client_state), self.global_step)


@dataclass
class LocalResult:
    """What a client rule adds at the end of its round."""

    arrays: dict[str, TensorDict] = field(default_factory=dict)  # sent with the delta (reply_keys)
    client_state: dict[str, TensorDict] = field(default_factory=dict)  # kept by this client


# ---------------------------------------------------------------- applying the aggregate


def apply_server_update(x: TensorDict, delta: TensorDict, server_lr: float,
                        trainable: set[str]) -> TensorDict:
    """x + server_lr * delta on trainable parameters, x + delta on buffers (new tensors)."""
    return {name: x[name] + (delta[name] * server_lr if name in trainable else delta[name])
            for name in x}


def aligned(arrays: dict[str, TensorDict], key: str, named_params: NamedParams) -> list[Tensor] | None:
    """``arrays[key]`` as a list aligned with ``named_params``, or None when the key is absent."""
    tensors = arrays.get(key)
    return None if tensors is None else [tensors[name] for name, _ in named_params]


def aligned_or_zeros(arrays: dict[str, TensorDict], key: str, named_params: NamedParams) -> list[Tensor]:
    """``aligned``, with zeros (on each parameter's device) for an absent key."""
    tensors = aligned(arrays, key, named_params)
    return tensors if tensors is not None else [torch.zeros_like(p) for _, p in named_params]


# ---------------------------------------------------------------- client rules


class LocalRule(ABC):
    """Client side of a method: the local optimizer, its round, and what it adds to the reply.

    One rule and one optimizer serve every client of a process (fedact_app.client_trainer), so
    ``begin_round`` must reset all per-client optimizer state. State a client keeps across the
    rounds it takes part in (SCAFFOLD's c_i) comes in ``RoundInputs.client_state`` and goes out in
    ``LocalResult.client_state``; the ClientApp stores it in Flower's per-node ``Context.state``.
    """

    def __init__(self, cfg) -> None:
        self.cfg = cfg  # AlgorithmConfig

    @abstractmethod
    def make_optimizer(self, named_params: NamedParams) -> torch.optim.Optimizer:
        """The local optimizer over the trainable parameters (learning rate set per round)."""

    @abstractmethod
    def begin_round(self, optimizer: torch.optim.Optimizer, named_params: NamedParams,
                    inputs: RoundInputs) -> None:
        """Reset the optimizer for a round; the parameters already hold x^r."""

    def end_round(self, optimizer: torch.optim.Optimizer, named_params: NamedParams,
                  inputs: RoundInputs, delta: TensorDict, lr_sum: float) -> LocalResult:
        """The round's extra reply arrays and kept state (none by default). ``inputs`` and ``delta``
        (x_i^{r,K} - x^r) are on the CPU."""
        return LocalResult()

    def last_step_direction(self, optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]] | None:
        """(u, g) per parameter of the optimizer's last step, u the update direction before any
        modulation (the trust-score diagnostics, fedact_app.diagnostics); None for a method
        without an adaptive direction (the SGD family)."""
        return None

    def amplified_fraction(self, optimizer: torch.optim.Optimizer) -> float | None:
        """The share of coordinates ACT amplified in the last step; None for a method without ACT."""
        return None


class SGDLocal(LocalRule):
    """Local SGD with L2 weight decay (FedAvg, FedAdam's clients) and, with ``mu > 0``, FedProx's
    proximal term anchored at x^r (Li et al. 2020, Eq. 2)."""

    def make_optimizer(self, named_params: NamedParams) -> LocalSGD:
        return LocalSGD([p for _, p in named_params], lr=self.cfg.lr,
                        weight_decay=self.cfg.weight_decay, mu=self.cfg.mu)

    def begin_round(self, optimizer: LocalSGD, named_params: NamedParams, inputs: RoundInputs) -> None:
        anchor = [p.detach().clone() for _, p in named_params] if self.cfg.mu > 0 else None
        optimizer.begin_round(anchor=anchor)


class ScaffoldLocal(SGDLocal):
    """SCAFFOLD's client, option II control variates (Karimireddy et al. 2020, Alg. 1 lines 7-13).

    Steps: y <- y - eta (g + c - c_i). After K steps with learning rates summing to sum_k eta:
    c_i^+ = c_i - c + (x^r - y) / sum_k eta (option II; = 1/(K eta) for a constant eta). Sends
    Delta c_i = c_i^+ - c_i with the model delta and keeps c_i^+ (``client_state["c_i"]``, zero on
    a client's first round)."""

    def begin_round(self, optimizer: LocalSGD, named_params: NamedParams, inputs: RoundInputs) -> None:
        c = aligned_or_zeros(inputs.received, "c", named_params)
        c_i = aligned_or_zeros(inputs.client_state, "c_i", named_params)
        optimizer.begin_round(correction=[c_g - c_l for c_g, c_l in zip(c, c_i)])

    def end_round(self, optimizer: LocalSGD, named_params: NamedParams, inputs: RoundInputs,
                  delta: TensorDict, lr_sum: float) -> LocalResult:
        c = inputs.received.get("c", {})
        c_i = inputs.client_state.get("c_i", {})
        c_i_new, delta_c = {}, {}
        for name, _ in named_params:
            old = c_i.get(name, torch.zeros_like(delta[name]))
            c_i_new[name] = old - c.get(name, torch.zeros_like(old)) - delta[name] / lr_sum
            delta_c[name] = c_i_new[name] - old
        return LocalResult(arrays={"delta_c": delta_c}, client_state={"c_i": c_i_new})


class AdamLocal(LocalRule):
    """LocalAdam: ``torch.optim.Adam`` (L2 weight decay in the gradient), fresh state every round."""

    optimizer_class: type[torch.optim.Optimizer] = torch.optim.Adam

    def make_optimizer(self, named_params: NamedParams) -> torch.optim.Optimizer:
        c = self.cfg
        return self.optimizer_class([p for _, p in named_params], lr=c.lr, betas=tuple(c.betas),
                                    eps=c.eps, weight_decay=c.weight_decay)

    def begin_round(self, optimizer: torch.optim.Optimizer, named_params: NamedParams,
                    inputs: RoundInputs) -> None:
        optimizer.state.clear()  # m = v = 0, step = 0: nothing carries over between rounds/clients

    def last_step_direction(self, optimizer: torch.optim.Optimizer) -> list[tuple[Tensor, Tensor]]:
        return adam_direction(optimizer)


class AdamWLocal(AdamLocal):
    """LocalAdamW: ``torch.optim.AdamW`` (decoupled weight decay), fresh state every round."""

    optimizer_class = torch.optim.AdamW


class FedLADALocal(LocalRule):
    """FedLADA's client: local AMSGrad amended by the global offset (fedact_app.baselines.FedLADAAdam),
    started from the server's v_bar and offset (``"v_bar"``, ``"delta_g"``); sends its final v_hat."""

    def make_optimizer(self, named_params: NamedParams) -> FedLADAAdam:
        c = self.cfg
        return FedLADAAdam([p for _, p in named_params], lr=c.lr, betas=tuple(c.betas), eps=c.eps,
                           weight_decay=c.weight_decay, rho=c.rho)

    def begin_round(self, optimizer: FedLADAAdam, named_params: NamedParams, inputs: RoundInputs) -> None:
        optimizer.begin_round(v_bar=aligned(inputs.received, "v_bar", named_params),
                              offset=aligned(inputs.received, "delta_g", named_params))

    def end_round(self, optimizer: FedLADAAdam, named_params: NamedParams, inputs: RoundInputs,
                  delta: TensorDict, lr_sum: float) -> LocalResult:
        moments = optimizer.second_moments()
        return LocalResult(arrays={"v": {name: v for (name, _), v in zip(named_params, moments)}})

    def last_step_direction(self, optimizer: FedLADAAdam) -> list[tuple[Tensor, Tensor]]:
        return optimizer.last_step_direction()


class FedACTLocal(LocalRule):
    """FedACT-AdamW on the client (seed: Algorithm 1, lines 4-21); ``trust_signal`` picks the
    variant: corrected (FedACT), local (FedACT-Local) or none (FedAdamW)."""

    def make_optimizer(self, named_params: NamedParams) -> FedACTAdamW:
        c = self.cfg
        return FedACTAdamW([p for _, p in named_params], lr=c.lr, betas=tuple(c.betas), eps=c.eps,
                           weight_decay=c.weight_decay, rho=c.rho, tau=c.tau, alpha=c.alpha,
                           gamma=c.gamma, trust_scope=c.trust_scope, trust_signal=c.trust_signal,
                           scale_matched=c.scale_matched, fused=c.fused, compile=c.compile)

    def begin_round(self, optimizer: FedACTAdamW, named_params: NamedParams, inputs: RoundInputs) -> None:
        optimizer.begin_round(v_bar=aligned(inputs.received, "v_bar", named_params),
                              delta_g=aligned(inputs.received, "delta_g", named_params),
                              global_step=inputs.global_step)

    def end_round(self, optimizer: FedACTAdamW, named_params: NamedParams, inputs: RoundInputs,
                  delta: TensorDict, lr_sum: float) -> LocalResult:
        moments = optimizer.second_moments()
        return LocalResult(arrays={"v": {name: v for (name, _), v in zip(named_params, moments)}})

    def last_step_direction(self, optimizer: FedACTAdamW) -> list[tuple[Tensor, Tensor]]:
        return optimizer.last_step_direction()

    def amplified_fraction(self, optimizer: FedACTAdamW) -> float:
        return optimizer.amplified_fraction()


# ---------------------------------------------------------------- server rules


class ServerRule(ABC):
    """Server side of a method: its state between rounds and its aggregation. Every per-client
    array it combines goes through ``aggregation`` (fedact_app.aggregation: the weighted mean by
    default, or a coordinate-wise robust rule), with the weights of ``cfg.weighting``."""

    reply_keys: tuple[str, ...] = ()  # method-specific array dicts every reply must carry
    nonnegative_keys: tuple[str, ...] = ()  # reply arrays that must be >= 0 (second moments)
    state_keys: tuple[str, ...] = ()  # attributes holding the state kept between rounds (None at first)

    def __init__(self, cfg, trainable: Sequence[str], num_clients: Optional[int] = None,
                 aggregation: Aggregation = Aggregation()) -> None:
        self.server_lr = cfg.server_lr
        self.weighting = cfg.weighting
        self.trainable = list(trainable)
        self.num_clients = num_clients  # N, all clients of the federation (SCAFFOLD's c update)
        self.aggregation = aggregation

    def weights(self, updates: Sequence[ClientUpdate]) -> list[float]:
        """The round's client weights w_i (``cfg.weighting``)."""
        return client_weights([u.num_examples for u in updates], self.weighting)

    def combine(self, updates: Sequence[ClientUpdate], key: str | None = None, *,
                divisors: Sequence[float] | None = None, names: Sequence[str] | None = None) -> TensorDict:
        """The updates' deltas (``key`` None) or their reply arrays ``key``, combined entry by
        entry by the rule's ``aggregation`` (``Aggregation.combine_dicts``)."""
        arrays = [u.delta if key is None else u.arrays[key] for u in updates]
        return self.aggregation.combine_dicts(arrays, self.weights(updates), divisors, names)

    def broadcast(self) -> dict[str, TensorDict]:
        """Arrays sent to every sampled client with the global model (absent ones mean zeros)."""
        return {}

    @abstractmethod
    def aggregate(self, x: TensorDict, updates: Sequence[ClientUpdate]) -> TensorDict:
        """The next global model state from the current one and the round's updates."""

    def state_dict(self) -> dict[str, TensorDict]:
        """The state kept between rounds (what a checkpoint saves); entries not yet set are absent."""
        return {key: dict(getattr(self, key)) for key in self.state_keys if getattr(self, key) is not None}

    def load_state_dict(self, state: dict[str, TensorDict]) -> None:
        """Restore ``state_dict()``'s output; every entry must cover exactly the trainable parameters."""
        unknown = set(state) - set(self.state_keys)
        if unknown:
            raise ValueError(f"{type(self).__name__} keeps {list(self.state_keys)}, not {sorted(unknown)}")
        for key, arrays in state.items():
            if set(arrays) != set(self.trainable):
                raise ValueError(f"{type(self).__name__} state {key!r} does not cover the trainable "
                                 f"parameters (e.g. {sorted(set(arrays) ^ set(self.trainable))[:3]})")
        for key in self.state_keys:
            setattr(self, key, {n: t.clone() for n, t in state[key].items()} if key in state else None)


class MeanServer(ServerRule):
    """x^{r+1} = x^r + server_lr * sum_i w_i Delta_i (FedAvg, FedProx, LocalAdam, LocalAdamW)."""

    def aggregate(self, x: TensorDict, updates: Sequence[ClientUpdate]) -> TensorDict:
        return apply_server_update(x, self.combine(updates), self.server_lr, set(self.trainable))


class ScaffoldServer(MeanServer):
    """SCAFFOLD's server (Karimireddy et al. 2020, Alg. 1 lines 16-17): x as ``MeanServer``,
    c <- c + (S/N) sum_i w_i Delta c_i, i.e. c + (1/N) sum_{i in S} Delta c_i with uniform weights,
    N the number of all clients. Broadcasts c (``"c"``; absent, i.e. zero, before round 1)."""

    reply_keys = ("delta_c",)
    state_keys = ("c",)

    def __init__(self, cfg, trainable: Sequence[str], num_clients: Optional[int] = None,
                 aggregation: Aggregation = Aggregation()) -> None:
        super().__init__(cfg, trainable, num_clients, aggregation)
        if not num_clients or num_clients < 1:
            raise ValueError(f"SCAFFOLD needs the total number of clients N >= 1, got {num_clients!r}")
        self.c: TensorDict | None = None

    def broadcast(self) -> dict[str, TensorDict]:
        return {} if self.c is None else {"c": self.c}

    def aggregate(self, x: TensorDict, updates: Sequence[ClientUpdate]) -> TensorDict:
        if len(updates) > self.num_clients:
            raise ValueError(f"{len(updates)} updates from N={self.num_clients} clients")
        new_x = super().aggregate(x, updates)
        step = self.combine(updates, "delta_c")
        scale = len(updates) / self.num_clients
        c = self.c or {name: torch.zeros_like(t) for name, t in step.items()}
        self.c = {name: c[name] + scale * step[name] for name in step}
        return new_x


class FedAdamServer(ServerRule):
    """FedAdam (Reddi et al. 2021, Algorithm 2, Adam branch) on the weighted mean delta d:
    m = b1 m + (1-b1) d;  v = b2 v + (1-b2) d^2;  x = x + server_lr * m / (sqrt(v) + server_eps),
    from m_{-1} = 0 and v_{-1} = server_eps^2 (the paper asks v_{-1} >= tau^2), without bias
    correction (the paper has none; Flower's FedAdam adds one). m and v persist across rounds."""

    state_keys = ("m", "v")

    def __init__(self, cfg, trainable: Sequence[str], num_clients: Optional[int] = None,
                 aggregation: Aggregation = Aggregation()) -> None:
        super().__init__(cfg, trainable, num_clients, aggregation)
        self.beta1, self.beta2 = cfg.server_betas
        self.server_eps = cfg.server_eps
        self.m: TensorDict | None = None
        self.v: TensorDict | None = None

    def aggregate(self, x: TensorDict, updates: Sequence[ClientUpdate]) -> TensorDict:
        d = self.combine(updates)
        if self.m is None:
            self.m = {name: torch.zeros_like(d[name]) for name in self.trainable}
            self.v = {name: torch.full_like(d[name], self.server_eps ** 2) for name in self.trainable}
        new_x = {}
        for name in x:
            if name not in self.m:  # buffers: plain mean
                new_x[name] = x[name] + d[name]
                continue
            self.m[name] = self.beta1 * self.m[name] + (1 - self.beta1) * d[name]
            self.v[name] = self.beta2 * self.v[name] + (1 - self.beta2) * d[name] ** 2
            new_x[name] = x[name] + self.server_lr * self.m[name] / (self.v[name].sqrt() + self.server_eps)
        return new_x


class FedACTServer(MeanServer):
    """FedACT / FedAdamW / FedACT-Local aggregation (seed: Algorithm 1, lines 22-24; module
    docstring), also FedLADA's: its offset g_a is Delta_G and its v is the mean of the clients' v_hat."""

    reply_keys = ("v",)
    nonnegative_keys = ("v",)
    state_keys = ("v_bar", "delta_g")

    def __init__(self, cfg, trainable: Sequence[str], num_clients: Optional[int] = None,
                 aggregation: Aggregation = Aggregation()) -> None:
        super().__init__(cfg, trainable, num_clients, aggregation)
        self.v_bar: TensorDict | None = None
        self.delta_g: TensorDict | None = None

    def broadcast(self) -> dict[str, TensorDict]:
        arrays = {"v_bar": self.v_bar, "delta_g": self.delta_g}
        return {key: value for key, value in arrays.items() if value is not None}

    def aggregate(self, x: TensorDict, updates: Sequence[ClientUpdate]) -> TensorDict:
        new_x = super().aggregate(x, updates)
        # Delta_G = -agg_i(Delta_i / lr_sum_i): the divisor -lr_sum_i gives the mean's
        # sum_i (-w_i / lr_sum_i) Delta_i bit for bit
        self.delta_g = self.combine(updates, divisors=[-u.lr_sum for u in updates], names=self.trainable)
        self.v_bar = self.combine(updates, "v")
        return new_x


# ---------------------------------------------------------------- the registry


@dataclass(frozen=True)
class Algorithm:
    """A method: its client rule, its server rule, and its spec (fedact_app.registry.METHODS:
    the algorithm config keys it reads and the values it fixes)."""

    local: Callable[..., LocalRule]
    server: Callable[..., ServerRule]
    spec: MethodSpec

    @property
    def uses(self) -> frozenset[str]:
        return self.spec.uses

    @property
    def required(self) -> Mapping:
        return self.spec.required

    @property
    def samples_trust_scores(self) -> bool:
        """Whether its clients have a trust score to sample (fedact_app.diagnostics): the local
        rule reads an update direction (the SGD family has none)."""
        return self.local.last_step_direction is not LocalRule.last_step_direction


RULES: dict[str, tuple[Callable[..., LocalRule], Callable[..., ServerRule]]] = {
    "fedavg": (SGDLocal, MeanServer),
    "fedprox": (SGDLocal, MeanServer),
    "scaffold": (ScaffoldLocal, ScaffoldServer),
    "fedadam": (SGDLocal, FedAdamServer),
    "localadam": (AdamLocal, MeanServer),
    "localadamw": (AdamWLocal, MeanServer),
    "fedlada": (FedLADALocal, FedACTServer),
    "fedadamw": (FedACTLocal, FedACTServer),  # trust_signal "none": phi = 1
    "fedact_local": (FedACTLocal, FedACTServer),  # trust_signal "local"
    "fedact": (FedACTLocal, FedACTServer),  # trust_signal "corrected"
}
ALGORITHMS: dict[str, Algorithm] = {name: Algorithm(*RULES[name], METHODS[name]) for name in METHODS}
