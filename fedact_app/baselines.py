"""Local optimizers of the baselines that torch does not ship, as plain ``torch.optim.Optimizer``s.

- :class:`LocalSGD` — the client step of FedAvg, FedProx, SCAFFOLD and FedAdam (plain SGD with L2
  weight decay, plus FedProx's proximal term and SCAFFOLD's control-variate correction);
- :class:`FedLADAAdam` — FedLADA's locally amended AMSGrad (Sun et al. 2023).

LocalAdam and LocalAdamW are ``torch.optim.Adam`` / ``torch.optim.AdamW`` (fedact_app.algorithms);
FedAdamW, FedACT-Local and FedACT are :class:`fedact_app.optim.FedACTAdamW`.

Like FedACTAdamW, the federated round enters only through ``begin_round``: the arrays of the round
(the anchor x^r, the correction c - c_i, the server's v_bar and offset) are copied into the
optimizer state there, and every call resets all per-round state, so one warm optimizer can serve
many clients one after another. Outside a federated loop both classes work as ordinary optimizers
(``begin_round`` never called: no proximal term, no correction, FedLADA without an offset).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from fedact_app.optimizer_base import LazyDynamoOptimizer, check_aligned
from fedact_app.registry import require_hyperparameters

__all__ = ["LocalSGD", "FedLADAAdam"]


def _set_round_state(optimizer: Optimizer, key: str, arrays: Optional[Sequence[Tensor]]) -> None:
    """Copy ``arrays`` into ``state[p][key]`` for every parameter, or drop ``key`` when None."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    check_aligned(key, arrays, params)
    for i, p in enumerate(params):
        if arrays is None:  # no entry is created, and one left empty is removed
            state = optimizer.state.get(p)
            if state is not None:
                state.pop(key, None)
                if not state:
                    del optimizer.state[p]
            continue
        state = optimizer.state[p]
        if key in state:
            state[key].copy_(arrays[i])
        else:
            state[key] = arrays[i].detach().to(device=p.device, dtype=p.dtype).clone()


def _check_gradients(optimizer: Optimizer) -> None:
    """Refuse sparse and complex gradients before the step changes any state."""
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients")
            if torch.is_complex(p) or torch.is_complex(p.grad):
                raise RuntimeError(f"{name} does not support complex parameters or gradients")


class LocalSGD(LazyDynamoOptimizer):
    r"""SGD of the SGD-family clients: FedAvg, FedProx, SCAFFOLD (option II) and FedAdam.

    With ``g`` the stochastic gradient at ``x``, each step is

    .. math::
        d = g + \lambda x + \mu (x - x^r) + (c - c_i), \qquad x \leftarrow x - \eta d

    - ``lambda x``: L2 weight decay in the gradient (the seed's SGD rows, Appendix C: 1e-3);
    - ``mu (x - x^r)``: the gradient of FedProx's proximal term (mu/2)||x - x^r||^2 (Li et al.
      2020, Eq. 2), active when ``mu > 0`` and :meth:`begin_round` got ``anchor = x^r``;
    - ``c - c_i``: SCAFFOLD's correction (Karimireddy et al. 2020, Alg. 1 line 10:
      y <- y - eta (g_i(y) + c - c_i)), active when :meth:`begin_round` got ``correction``.
      It is added to the update itself, every step, so it moves ``x`` exactly as the paper says.

    No momentum: the seed's tables list plain SGD for these methods. Parameters without a
    gradient are skipped. The optimizer keeps no state across steps besides the round's
    ``anchor`` and ``correction``.

    Args:
        params: parameters or param groups.
        lr: learning rate eta (>= 0).
        weight_decay: L2 coefficient lambda (>= 0).
        mu: proximal coefficient (>= 0).
    """

    def __init__(self, params, lr: float = 0.1, weight_decay: float = 0.0, mu: float = 0.0) -> None:
        require_hyperparameters(lr=lr, weight_decay=weight_decay, mu=mu)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, mu=mu))

    @torch.no_grad()
    def begin_round(self, anchor: Optional[Sequence[Tensor]] = None,
                    correction: Optional[Sequence[Tensor]] = None) -> None:
        """Start a round: ``anchor`` is x^r (FedProx), ``correction`` is c - c_i (SCAFFOLD), each one
        tensor per parameter in param_groups order and copied; ``None`` switches the term off."""
        _set_round_state(self, "anchor", anchor)
        _set_round_state(self, "correction", correction)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, weight_decay, mu = group["lr"], group["weight_decay"], group["mu"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p, {})  # no empty entry for a parameter without round state
                d = p.grad.add(p, alpha=weight_decay) if weight_decay else p.grad.clone()
                if mu and "anchor" in state:
                    d.add_(p, alpha=mu).sub_(state["anchor"], alpha=mu)
                if "correction" in state:
                    d.add_(state["correction"])
                p.add_(d, alpha=-lr)
        return loss


class FedLADAAdam(LazyDynamoOptimizer):
    r"""FedLADA's local amended AMSGrad (Sun, Shen, Sun, Ding, Tao 2023, "Efficient Federated
    Learning via Local Adaptive Amended Optimizer with Linear Speedup", Algorithm FedLADA).

    In round r the client starts from ``m = 0`` and ``v = v_hat = v_bar`` (the server's mean of the
    clients' final ``v_hat``; ``eps**2`` everywhere before the first aggregation) and receives the
    global offset ``g_a`` (the server's mean update direction per unit of learning rate from the
    previous round, ``-mean_i Delta_i / sum_k eta``; zero in round 1). Each step, with ``g`` the
    stochastic gradient at ``x``:

    .. math::
        g &\leftarrow g + \lambda x \quad \text{(L2 weight decay, Adam-style; the seed's table)}\\
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g \odot g, \qquad
        \hat v \leftarrow \max(\hat v, v)\\
        x &\leftarrow x - \eta \left[ (1-\rho)\, m / \sqrt{\hat v} + \rho\, g_a \right]

    The paper writes the mix as ``alpha * local + (1 - alpha) * g_a``; ``rho = 1 - alpha`` is the
    seed's name for the weight of the global direction (0.5 in its Appendix C tables, where the
    two readings coincide). As in the paper there is no bias correction and no epsilon in the
    denominator: ``v_hat`` never falls below ``eps**2`` (it starts there and only grows by the
    max), so the division is safe; :meth:`begin_round` clamps a received ``v_bar`` to ``eps**2``
    from below, which changes nothing for a ``v_bar`` that FedLADA clients produced.

    Args:
        params: parameters or param groups.
        lr: learning rate eta (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: floor of ``sqrt(v_hat)`` (> 0).
        weight_decay: L2 coefficient lambda (>= 0).
        rho: weight of the global offset, in [0, 1].
    """

    def __init__(self, params, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, rho: float = 0.5) -> None:
        require_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rho=rho)
        if not 0.0 < eps:  # stricter than the common range: v_hat starts at eps**2
            raise ValueError(f"Invalid eps: {eps!r}; expected eps > 0 (v_hat starts at eps**2)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      rho=rho))

    def _params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _init_state(self, p: Tensor, eps: float) -> dict:
        """The one place state is created: m = 0, v = v_hat = eps**2 (the paper's start)."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.full_like(p, eps * eps, memory_format=torch.preserve_format)
            state["max_exp_avg_sq"] = state["exp_avg_sq"].clone()
        return state

    @torch.no_grad()
    def begin_round(self, v_bar: Optional[Sequence[Tensor]] = None,
                    offset: Optional[Sequence[Tensor]] = None) -> None:
        """Start a round: ``m <- 0``, ``v, v_hat <- max(v_bar, eps**2)`` (``eps**2`` when None) and
        the global offset ``g_a <- offset`` (None: zero). Both are one tensor per parameter, in
        param_groups order, and are copied."""
        params = self._params()
        check_aligned("v_bar", v_bar, params)
        i = 0
        for group in self.param_groups:
            eps = group["eps"]
            for p in group["params"]:
                state = self._init_state(p, eps)
                state["exp_avg"].zero_()
                if v_bar is None:
                    state["exp_avg_sq"].fill_(eps * eps)
                else:
                    state["exp_avg_sq"].copy_(v_bar[i]).clamp_min_(eps * eps)
                state["max_exp_avg_sq"].copy_(state["exp_avg_sq"])
                i += 1
        _set_round_state(self, "offset", offset)

    def second_moments(self) -> list[Tensor]:
        """``v_hat`` for every parameter (the live state, aligned with param_groups order): what a
        FedLADA client sends for the server's ``v_bar``."""
        return [self._init_state(p, group["eps"])["max_exp_avg_sq"]
                for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def last_step_direction(self) -> list[tuple[Tensor, Tensor]]:
        """``(u, g)`` of the last step for every parameter with a gradient: the direction
        u = (1-rho) m / sqrt(v_hat) + rho g_a the step moved along (new tensors, from the state)
        and ``p.grad``. For diagnostics (fedact_app.diagnostics)."""
        pairs = []
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if p.grad is None or not state:
                    continue
                u = (state["exp_avg"] / state["max_exp_avg_sq"].sqrt()).mul_(1.0 - group["rho"])
                if "offset" in state:
                    u.add_(state["offset"], alpha=group["rho"])
                pairs.append((u, p.grad))
        return pairs

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _check_gradients(self)
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            weight_decay, rho = group["weight_decay"], group["rho"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._init_state(p, eps)
                g = p.grad.add(p, alpha=weight_decay) if weight_decay else p.grad
                m, v, v_hat = state["exp_avg"], state["exp_avg_sq"], state["max_exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1.0 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                torch.maximum(v_hat, v, out=v_hat)
                direction = (m / v_hat.sqrt()).mul_(1.0 - rho)
                if "offset" in state:
                    direction.add_(state["offset"], alpha=rho)
                p.add_(direction, alpha=-lr)
        return loss
