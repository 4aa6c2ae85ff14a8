"""FedACT-AdamW, the client optimizer of FedACT (seed: Algorithm 1, lines 4-18).

A plain :class:`torch.optim.Optimizer`: it runs in any PyTorch training loop, and the federated
round structure enters only through :meth:`FedACTAdamW.begin_round` (the server's broadcast v̄ and
Δ_G and the global step count). FedAdamW (``trust_signal="none"``) and FedACT-Local
(``trust_signal="local"``) are the same class with another trust signal.

Speed (docs/PERFORMANCE.md): the step is memory-bound, so it is written as few passes over the d
coordinates as eager PyTorch allows. The state of the parameters that take a step lives in flat
buffers (one per run of parameters sharing group, device and dtype): the equations that do not
involve the gradient or the parameter tensor by tensor are one operation over all coordinates,
the others one ``torch._foreach_*`` call. The exact top-k threshold is found without sorting d
entries: on CPU a sample brackets it and an exact count plus a small selection finish it (numpy,
on torch's threads); elsewhere ``torch.topk`` of the smaller side gives it and the tie-break runs
on the device, with no host synchronisation. ``fused`` (the default on CPU) runs m, v and u as one
call of PyTorch's fused AdamW kernel and the parameter update as one call of its fused SGD kernel,
each with FedACT's coefficients; ``compile=True`` fuses m, v, u and s into one pass.
"""

from __future__ import annotations

import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from fedact_app.optimizer_base import LazyDynamoOptimizer

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with every install of this app
    np = None

__all__ = ["FedACTAdamW", "fedact_adamw", "TRUST_SCOPES", "TRUST_SIGNALS"]

TRUST_SCOPES = ("global", "tensor")
TRUST_SIGNALS = ("corrected", "local", "none")

# Settings of the trust modulation that one global top-k selection needs to agree on.
_TRUST_KEYS = ("rho", "tau", "alpha", "gamma", "trust_scope", "trust_signal", "scale_matched")

# Threshold selection on the host (CPU + numpy); see _threshold_on_host.
_BRACKET_MIN = 1 << 21  # below this many scores one np.partition is as fast
# bracket half-width, in standard deviations of the sample rank: a bracket misses T in about 1 %
# of the steps (then a full selection runs; 8 misses in 1,500 steps at d = 2.7 M), against a
# band 1.6x narrower than at 4 sigma: ViT-Tiny's step 1.0 ms and ResNet-18's 2.4 ms faster
_BRACKET_Z = 2.5
_HOST_CHUNK = 1 << 19  # scores per task: the passes over one chunk stay in cache
_TIE_CHUNK = 1 << 20  # scan length when looking for where a straddling tie is cut


def _validate_hyperparameters(
    *, lr, betas, eps, weight_decay, rho, tau, alpha, gamma, trust_scope, trust_signal
) -> tuple[float, float]:
    """Check every hyperparameter of one param group; return the resolved ``(alpha, gamma)``."""
    if not 0.0 <= lr:
        raise ValueError(f"Invalid lr: {lr!r}; expected lr >= 0")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid eps: {eps!r}; expected eps >= 0")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r}; expected two values (beta1, beta2), each in [0, 1)")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid betas[{i}]: {beta!r}; expected 0 <= betas[{i}] < 1")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay: {weight_decay!r}; expected weight_decay >= 0")
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"Invalid rho: {rho!r}; expected 0 <= rho <= 1")
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"Invalid tau: {tau!r}; expected 0 < tau <= 1")
    alpha = 1.0 / tau if alpha is None else alpha
    gamma = tau if gamma is None else gamma
    if not 0.0 <= gamma:
        raise ValueError(f"Invalid gamma: {gamma!r}; expected gamma >= 0 (and alpha >= gamma)")
    if not gamma <= alpha:
        raise ValueError(f"Invalid alpha: {alpha!r} is below gamma={gamma!r}; expected alpha >= gamma >= 0")
    if trust_scope not in TRUST_SCOPES:
        raise ValueError(f"Invalid trust_scope: {trust_scope!r}; expected one of {TRUST_SCOPES}")
    if trust_signal not in TRUST_SIGNALS:
        raise ValueError(f"Invalid trust_signal: {trust_signal!r}; expected one of {TRUST_SIGNALS}")
    return float(alpha), float(gamma)


class FedACTAdamW(LazyDynamoOptimizer):
    r"""AdamW with a global correction and coordinate-wise trust modulation (FedACT-AdamW).

    One local step of the seed's Algorithm 1 (lines 6-18). In round r the client starts from
    ``m = 0`` and ``v = v̄^r`` (:meth:`begin_round`); at local step ``k`` (1-based, restarting each
    round) and global step ``t = global_step + k``, with ``g`` the gradient, per coordinate:

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g \odot g
            &&\text{(Eq. adam\_moments)}\\
        \hat m &= m / (1-\beta_1^{k}), \qquad \hat v = v / (1-\beta_2^{t})
            &&\text{(Alg. 1, lines 10-11)}\\
        u_{loc} &= \hat m / (\sqrt{\hat v} + \epsilon)
            &&\text{(Eq. local\_adaptive\_direction)}\\
        u &= (1-\rho)\, u_{loc} + \rho\, \Delta_G
            &&\text{(Eq. global\_aware\_direction)}\\
        s &= u \odot g \quad (\text{FedACT-Local: } s = u_{loc} \odot g)
            &&\text{(Eq. trust\_score)}\\
        \phi_j &= \alpha \text{ if } j \in \mathrm{top}_{\lfloor \tau d \rfloor}(s) \text{ else } \gamma
            &&\text{(Eq. fedact\_modulation)}\\
        x &\leftarrow (1-\eta\lambda)\, x - \eta\, (\phi \odot u)
            &&\text{(Eq. fedact\_update)}

    The weight decay is decoupled and is not modulated by ``phi``. Special cases (seed, "Special
    cases"): ``phi == 1`` (``trust_signal="none"``) is FedAdamW, a dense corrected AdamW step with
    v̄ synchronisation; ``rho = 0`` with ``trust_signal="none"`` is AdamW warm-started from v̄ (and,
    with ``v_bar=None`` and ``global_step=0``, exactly :class:`torch.optim.AdamW`); ``alpha == gamma``
    is a learning rate rescaled by ``alpha``.

    Top-k selection. ``d`` counts the coordinates of the parameters that have a gradient this step.
    With ``trust_scope="global"`` (the seed's ``s in R^d``) one selection of ``floor(tau * d)``
    entries runs over all of them; with ``"tensor"`` each parameter tensor selects
    ``floor(tau * numel)`` of its own (as MGUP, cautious AdamW and timm do). Exactly that many
    entries get ``alpha``, also when ``s`` has ties (gradients with exact zeros make many): ties
    go to the lowest flat index, the flat order being ``param_groups`` order, then parameter
    order within a group, then ``p.reshape(-1)`` order, i.e. what
    ``torch.sort(s, descending=True, stable=True)`` picks. The selection runs in float32 (float64
    when a parameter is float64) whatever the parameter dtype; the state stays in the parameter
    dtype. ``scale_matched=True`` (not in the seed) divides ``phi`` by its mean over the selection
    scope, ``(k*alpha + (d-k)*gamma)/d``, so the mean step equals FedAdamW's.

    Args:
        params: parameters or param groups. ``lr``, ``weight_decay``, ``betas`` and ``eps`` may
            differ between groups; the trust settings (``rho`` to ``scale_matched``) must agree
            across groups when ``trust_scope="global"``.
        lr: learning rate eta (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: epsilon added to sqrt(v_hat) (>= 0).
        weight_decay: decoupled weight decay lambda (>= 0).
        rho: weight of the global correction Delta_G in u, in [0, 1].
        tau: trust ratio, in (0, 1].
        alpha: factor on the top entries (``None``: ``1 / tau``); ``alpha >= gamma``.
        gamma: factor on the other entries (``None``: ``tau``); ``gamma >= 0``.
        trust_scope: ``"global"`` or ``"tensor"``.
        trust_signal: ``"corrected"`` (s = u*g, FedACT), ``"local"`` (s = u_loc*g, FedACT-Local)
            or ``"none"`` (phi = 1, FedAdamW).
        scale_matched: divide phi by its mean (default off, as in the seed).
        foreach: the per-tensor steps (m, v, s and the parameter update, which need the
            gradient or the parameter tensor by tensor; with ``fused`` only s) as one
            ``torch._foreach_*`` call each instead of a loop; ``None`` (default): on, which
            measured as fast or faster on CPU too. Both compute the same thing.
        fused: m, v and u as one call of PyTorch's fused AdamW kernel (``torch._fused_adamw_``,
            which computes ``u <- u - (lr'/(1-beta1^t)) m / (sqrt(v/(1-beta2^t)) + eps)``; with
            ``u`` first set to Delta_G and ``lr'`` chosen negative that is FedACT's u, Eq.
            global_aware_direction) and the parameter update as one call of its fused SGD kernel
            (``torch._fused_sgd_``: ``x <- x - lr' (u + wd' x)``, Eq. fedact_update with
            ``lr' = lr * scale`` and ``wd' = wd / scale``): two passes over d instead of six,
            and one instead of two. ``None`` (default): on for CPU parameters, where it was
            measured (the step about 20 % faster); off on CUDA until measured there; ``True``
            also on CUDA. A run of parameters the kernels do not take (other devices or dtypes,
            a non-contiguous parameter or gradient, e.g. channels_last) runs the eager
            operations, and so does the update of bfloat16/float16 parameters (torch 2.13's CPU
            fused SGD kernel skips their store). Equal to the eager operations up to rounding
            (and where float16's ``eps`` underflows, the kernel's float arithmetic gives 0 where
            the eager ``0/0`` gives NaN, as in torch's own AdamW).
        compile: run m, v, u and s as one ``torch.compile``-d pass over the flat buffers, and
            (one global threshold, no tie) the comparison with phi as another (float32/float64
            parameters; on CPU the step 3-8 % faster than with ``fused``, after a compilation
            of some seconds per process). When compilation fails (no C++ compiler, an
            unsupported platform) it warns once and uses the eager operations.

    State per parameter: ``exp_avg`` (m), ``exp_avg_sq`` (v) and, while the round has a
    correction with ``rho > 0``, ``delta_g``. The local step ``k`` and the global step at the
    start of the round are kept in every param group (``"local_step"``, ``"round_start_step"``),
    so :meth:`state_dict` / :meth:`load_state_dict` carry them. Calling :meth:`step` without any
    :meth:`begin_round` behaves as after ``begin_round()`` with its defaults. Every call to
    :meth:`step` advances ``k``.

    The seed asks ``alpha > gamma > 0``; ``alpha == gamma`` (a rescaled learning rate) and
    ``gamma == 0`` (a hard mask) are accepted as limits. Scores must be finite (a NaN gradient
    makes the selection meaningless, as it makes the step).

    Memory layout. The state of the parameters that take a step is packed, at the first step and
    whenever that set or the state's tensors change, into one flat buffer per run of consecutive
    parameters of a group that share device and dtype; ``state[p]["exp_avg"]`` and the others are
    views of those buffers (shaped like ``p``, row-major). Scratch, rebuilt with the packing and
    never saved: u (parameter dtype), one flat float32 (float64) buffer per device for s and
    one bool and one selector buffer (bool on CPU, int32 on the device path): ``10 d`` bytes
    beyond the state for float32 parameters on CPU, ``13 d`` on a GPU, plus there the output of
    ``torch.topk`` of the smaller side (``12 min(k, d-k+1)`` bytes for float32 scores: about
    ``6 d`` at tau = 0.5), all allocated once. The equations allocate nothing per step; the CPU selection
    copies what ``np.partition`` selects from (about 1 % of d, or a whole segment below 2**21
    scores).
    """

    def __init__(
        self,
        params,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        rho: float = 0.5,
        tau: float = 0.5,
        alpha: Optional[float] = None,
        gamma: Optional[float] = None,
        trust_scope: str = "global",
        trust_signal: str = "corrected",
        scale_matched: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        compile: bool = False,
    ) -> None:
        _validate_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rho=rho,
                                  tau=tau, alpha=alpha, gamma=gamma, trust_scope=trust_scope,
                                  trust_signal=trust_signal)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, rho=rho,
                        tau=tau, alpha=alpha, gamma=gamma, trust_scope=trust_scope,
                        trust_signal=trust_signal, scale_matched=bool(scale_matched), foreach=foreach,
                        fused=fused, compile=bool(compile))
        self._workspace: Optional[_Workspace] = None
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups and state

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group after validating its settings. ``alpha``/``gamma`` left at ``None``
        resolve here, once, from the group's ``tau`` (to ``1/tau`` and ``tau``)."""
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        if not (merged.get("fused") is None or isinstance(merged["fused"], bool)):
            raise ValueError(f"Invalid fused: {merged['fused']!r}; expected None (on for CPU parameters), "
                             f"True or False")
        param_group["alpha"], param_group["gamma"] = _validate_hyperparameters(
            **{k: merged[k] for k in ("lr", "betas", "eps", "weight_decay", "rho", "tau", "alpha",
                                      "gamma", "trust_scope", "trust_signal")})
        super().add_param_group(param_group)
        group, first = self.param_groups[-1], self.param_groups[0]
        group["local_step"] = first.get("local_step", 0)
        group["round_start_step"] = first.get("round_start_step", 0)
        self._check_trust_groups()
        self._workspace = None

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("local_step", 0)
            group.setdefault("round_start_step", 0)
            group.setdefault("compile", False)
            group.setdefault("fused", None)
        self._workspace = None  # the loaded state is packed again at the next step

    def _check_trust_groups(self) -> None:
        groups = self.param_groups
        if not any(g["trust_scope"] == "global" for g in groups):
            return
        for key in _TRUST_KEYS:
            values = [g[key] for g in groups]
            if any(v != values[0] for v in values):
                raise ValueError(f"Invalid {key} across param groups: {values!r}; trust_scope='global' "
                                 f"selects over all groups at once and needs one {key} for all of them")

    def _init_state(self, p: Tensor, key: str = "exp_avg_sq") -> Tensor:
        """The one place state is created: the buffer ``key`` of ``p`` (m and v together).

        A new tensor invalidates the flat layout; the next :meth:`step` packs it (and the rest)
        into the flat buffers.
        """
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._workspace = None
        if key not in state:
            state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
            self._workspace = None
        return state[key]

    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def local_step(self) -> int:
        """k: local steps taken since the last :meth:`begin_round`."""
        return self.param_groups[0]["local_step"]

    @property
    def global_step(self) -> int:
        """t: the round's starting global step plus :attr:`local_step`."""
        return self.param_groups[0]["round_start_step"] + self.param_groups[0]["local_step"]

    def second_moments(self) -> list[Tensor]:
        """v for every parameter, aligned with the parameters (param_groups order).

        These are the live state tensors, not copies: clone them before the next step or
        :meth:`begin_round` if they must be kept. A parameter without state gets its (zero) state.
        """
        return [self._init_state(p, "exp_avg_sq") for p in self._all_params()]

    @torch.no_grad()
    def last_step_direction(self) -> list[tuple[Tensor, Tensor]]:
        """``(u, g)`` of the last :meth:`step` for every parameter with a gradient (param_groups
        order): u = (1-rho) m_hat / (sqrt(v_hat) + eps) + rho Delta_G before any modulation, read
        from the state (new tensors), and the gradient ``p.grad``. For diagnostics
        (fedact_app.diagnostics): the trust score of Appendix A is ``u * g``."""
        k = self.local_step
        if k == 0:
            raise RuntimeError("last_step_direction() needs a step() since the last begin_round()")
        t = self.global_step
        pairs = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            rho = group["rho"]
            for p in group["params"]:
                state = self.state.get(p)
                if p.grad is None or not state:
                    continue
                m_hat = state["exp_avg"] / (1.0 - beta1 ** k)
                v_hat = state["exp_avg_sq"] / (1.0 - beta2 ** t)
                u = m_hat.div_(v_hat.sqrt_().add_(group["eps"])).mul_(1.0 - rho)
                if rho > 0 and "delta_g" in state:
                    u.add_(state["delta_g"], alpha=rho)
                pairs.append((u, p.grad))
        return pairs

    def amplified_fraction(self) -> float:
        """The fraction of the coordinates of the last :meth:`step` (parameters with a gradient)
        whose factor phi_j exceeds 1, i.e. that ACT moves further than the dense corrected
        direction: in each selection scope the ``floor(tau d)`` top entries get alpha and the rest
        gamma (both divided by their mean with ``scale_matched``); phi = 1 without a trust signal."""
        groups = self.param_groups
        sizes = [[p.numel() for p in g["params"] if p.grad is not None] for g in groups]
        total = sum(map(sum, sizes))
        if groups[0]["trust_scope"] == "global":  # one selection; the settings agree across groups
            scopes = [(total, groups[0])]
        else:
            scopes = [(d, g) for g, ds in zip(groups, sizes) for d in ds]
        amplified = 0
        for d, group in scopes:
            if group["trust_signal"] == "none" or d == 0:
                continue
            k, alpha, gamma = _phi_factors(d, group["tau"], group["alpha"], group["gamma"],
                                           group["scale_matched"])
            amplified += k * (alpha > 1.0) + (d - k) * (gamma > 1.0)
        return amplified / total if total else 0.0

    @torch.no_grad()
    def begin_round(
        self,
        v_bar: Optional[Sequence[Tensor]] = None,
        delta_g: Optional[Sequence[Tensor]] = None,
        global_step: int = 0,
    ) -> None:
        """Start a round (seed: Algorithm 1, line 4): ``m <- 0``, ``v <- v_bar``, ``k <- 0``.

        Args:
            v_bar: the server's averaged second moment, one tensor per parameter in
                param_groups order (``None``: zeros). Copied into the state.
            delta_g: the global correction Delta_G^{r-1}, aligned the same way (``None``: zeros).
                Copied into the state of groups with ``rho > 0``; with ``None`` or ``rho == 0``
                nothing is stored and the term is skipped.
            global_step: t before this round's first step (``(r-1)*K`` in the seed).
        """
        params = self._all_params()
        for name, arrays in (("v_bar", v_bar), ("delta_g", delta_g)):
            if arrays is None:
                continue
            if len(arrays) != len(params):
                raise ValueError(f"Invalid {name}: {len(arrays)} tensors for {len(params)} parameters; "
                                 f"expected one tensor per parameter, in param_groups order")
            for i, (a, p) in enumerate(zip(arrays, params)):
                if not isinstance(a, Tensor):
                    raise TypeError(f"Invalid {name}[{i}]: expected a Tensor, got {type(a).__name__}")
                if a.shape != p.shape:
                    raise ValueError(f"Invalid {name}[{i}]: shape {tuple(a.shape)} does not match "
                                     f"parameter {i} of shape {tuple(p.shape)}")
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise ValueError(f"Invalid global_step: {global_step!r}; expected an integer >= 0")

        i = 0
        for group in self.param_groups:
            group["local_step"] = 0
            group["round_start_step"] = global_step
            for p in group["params"]:
                state = self.state[p]
                if v_bar is not None:
                    self._init_state(p, "exp_avg_sq").copy_(v_bar[i])
                elif "exp_avg_sq" in state:
                    state["exp_avg_sq"].zero_()
                if "exp_avg" in state:
                    state["exp_avg"].zero_()
                if delta_g is not None and group["rho"] > 0:
                    self._init_state(p, "delta_g").copy_(delta_g[i])
                elif state.pop("delta_g", None) is not None:
                    self._workspace = None
                i += 1

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One local step of Algorithm 1 (lines 6-18) from ``p.grad``; params without grad are
        skipped and not counted in d."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_trust_groups()
        k = self.param_groups[0]["local_step"] + 1
        t = self.param_groups[0]["round_start_step"] + k

        present = []  # per group: the parameters with a gradient
        for group in self.param_groups:
            params = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FedACTAdamW does not support sparse gradients")
                if torch.is_complex(p):
                    raise RuntimeError("FedACTAdamW does not support complex parameters")
                self._init_state(p)
                params.append(p)
            present.append(params)
        ws = self._workspace
        if ws is None or not ws.matches(self.param_groups, present):
            self._workspace = None  # release the old scratch before allocating the new
            ws = self._workspace = _Workspace(self.param_groups, present, self.state)

        batches = [_batch(run, self.param_groups[run.group]) for run in ws.runs]
        fedact_adamw(batches, ws.segments(self.param_groups), local_step=k, global_step=t)
        for group in self.param_groups:
            group["local_step"] = k
        return loss


# ---------------------------------------------------------------------- flat layout and scratch


def _views(flat: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """Consecutive views of the 1-D ``flat``, shaped like ``params``."""
    views, offset = [], 0
    for p in params:
        n = p.numel()
        views.append(flat[offset:offset + n].view(p.shape))
        offset += n
    return views


def _pack(params: Sequence[Tensor], state: dict, key: str) -> tuple[Tensor, list[Tensor]]:
    """One flat buffer holding ``state[p][key]`` of every parameter, and its views, which
    replace the state tensors."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    views = _views(flat, params)
    for p, view in zip(params, views):
        view.copy_(state[p][key])
        state[p][key] = view
    return flat, views


class _Run:
    """Consecutive parameters of one param group with the same device, dtype and state keys.

    ``exp_avg``, ``exp_avg_sq`` and ``delta_g`` are flat buffers of their state (the parameters'
    state tensors are the ``*_views``); ``direction`` is the flat scratch for u; ``kernel_step``
    holds the global step t for the fused AdamW kernel. ``scores`` and its views are this run's
    slice of the device's score buffer (``None`` for a group without trust signal).
    """

    def __init__(self, group: int, params: list[Tensor], scored: bool, state: dict) -> None:
        self.group, self.params, self.scored = group, params, scored
        self.device, self.dtype = params[0].device, params[0].dtype
        self.numel = sum(p.numel() for p in params)
        self.exp_avg, self.exp_avg_views = _pack(params, state, "exp_avg")
        self.exp_avg_sq, self.exp_avg_sq_views = _pack(params, state, "exp_avg_sq")
        self.delta_g = _pack(params, state, "delta_g")[0] if "delta_g" in state[params[0]] else None
        self.direction = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.direction_views = _views(self.direction, params)
        self.kernel_step = torch.zeros((), dtype=torch.float32, device=self.device)  # t, for _fused_moments
        self.scores: Optional[Tensor] = None
        self.score_views: list[Optional[Tensor]] = [None] * len(params)

    def attach_scores(self, scores: Tensor) -> None:
        self.scores, self.score_views = scores, _views(scores, self.params)


def _layout(p: Tensor, state: dict) -> tuple:
    return p.device, p.dtype, "delta_g" in state[p]


class _Workspace:
    """The flat layout of one set of parameters with gradients, reused while that set is unchanged.

    ``runs`` tile the parameters in param_groups order. Per device, the scored runs share
    ``buffers[device]``: one flat score buffer (float64 if one of them is float64, else float32),
    one bool mask and one selector scratch (bool when numpy finds the threshold, int32 on the
    device path). ``trust_scope="global"`` needs all of them on one device.
    """

    def __init__(self, groups: list[dict], present: list[list[Tensor]], state: dict) -> None:
        self.key = self._key(groups, present)
        self.runs: list[_Run] = []
        for index, (group, params) in enumerate(zip(groups, present)):
            start = 0
            for i in range(1, len(params) + 1):
                if i == len(params) or _layout(params[i], state) != _layout(params[start], state):
                    self.runs.append(_Run(index, params[start:i], group["trust_signal"] != "none", state))
                    start = i
        by_device: dict[torch.device, list[_Run]] = {}
        for run in self.runs:
            if run.scored:
                by_device.setdefault(run.device, []).append(run)
        self.buffers: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}
        for device, runs in by_device.items():
            dtype = torch.float64 if any(r.dtype == torch.float64 for r in runs) else torch.float32
            numel = sum(r.numel for r in runs)
            selector = torch.bool if _select_on_host(device) else torch.int32
            scores, mask, scratch = (torch.empty(numel, dtype=dt, device=device)
                                     for dt in (dtype, torch.bool, selector))
            offset = 0
            for run in runs:
                run.attach_scores(scores[offset:offset + run.numel])
                offset += run.numel
            self.buffers[device] = (scores, mask, scratch)
        self._segments: tuple[tuple, list[_TrustSegment]] = ((), [])

    @staticmethod
    def _key(groups: list[dict], present: list[list[Tensor]]) -> tuple:
        return tuple((g["trust_signal"] != "none", tuple((id(p), p.shape, p.dtype, p.device) for p in ps))
                     for g, ps in zip(groups, present))

    def matches(self, groups: list[dict], present: list[list[Tensor]]) -> bool:
        return self.key == self._key(groups, present)

    def segments(self, groups: list[dict]) -> list[_TrustSegment]:
        """The top-k selections of this step (kept while the trust settings stay the same)."""
        settings = tuple(tuple(g[key] for key in _TRUST_KEYS) for g in groups)
        if settings != self._segments[0]:
            self._segments = (settings, self._build_segments(groups))
        return self._segments[1]

    def _build_segments(self, groups: list[dict]) -> list[_TrustSegment]:
        if not self.buffers:
            return []
        g0 = groups[0]
        if g0["trust_scope"] == "global":
            if len(self.buffers) > 1:
                raise RuntimeError("trust_scope='global' ranks all coordinates together and needs every "
                                   "parameter with a gradient on one device; use trust_scope='tensor'")
            return [_TrustSegment(*next(iter(self.buffers.values())), g0)]
        segments, offsets = [], dict.fromkeys(self.buffers, 0)
        for run in self.runs:
            if not run.scored:
                continue
            for p in run.params:
                start, n = offsets[run.device], p.numel()
                segments.append(_TrustSegment(*(b[start:start + n] for b in self.buffers[run.device]),
                                              groups[run.group]))
                offsets[run.device] = start + n
        return segments


def _select_on_host(device: torch.device) -> bool:
    """Whether the threshold of scores on ``device`` is found by numpy (CPU) or on the device."""
    return device.type == "cpu" and np is not None


_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# torch 2.13's CPU fused SGD kernel does not store bfloat16/float16 parameters from its vectorized
# loop (only the tail of each tensor moves; pytorch/pytorch#191763): those updates stay eager.
_FUSED_UPDATE_DTYPES = (torch.float32, torch.float64)


def _uses_fused_kernels(run: _Run, grads: list[Tensor], fused: Optional[bool]) -> bool:
    """Whether a run's step uses torch's fused AdamW and SGD kernels (the ``fused`` option):
    ``None`` means on CPU. The kernels read every tensor of a list in its own memory order, so
    parameters and gradients must be contiguous like the flat state's views (a channels_last
    weight is not: the eager operations handle it)."""
    on = run.device.type == "cpu" if fused is None else fused and run.device.type in ("cpu", "cuda")
    return (on and run.dtype in _FUSED_DTYPES and all(p.is_contiguous() for p in run.params)
            and all(g.is_contiguous() for g in grads))


def _batch(run: _Run, group: dict) -> _ParamBatch:
    """One run's tensors for this step, with its group's settings."""
    beta1, beta2 = group["betas"]
    foreach = group["foreach"]
    grads = [p.grad for p in run.params]
    return _ParamBatch(
        params=run.params, grads=grads, exp_avg=run.exp_avg,
        exp_avg_views=run.exp_avg_views, exp_avg_sq=run.exp_avg_sq, exp_avg_sq_views=run.exp_avg_sq_views,
        delta_g=run.delta_g if group["rho"] > 0 else None, direction=run.direction,
        direction_views=run.direction_views, scores=run.scores, score_views=run.score_views,
        lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
        rho=group["rho"], trust_signal=group["trust_signal"],
        foreach=True if foreach is None else foreach,
        fused=_uses_fused_kernels(run, grads, group.get("fused")), kernel_step=run.kernel_step,
        compile=group.get("compile", False) and run.dtype in (torch.float32, torch.float64)
        and (run.scores is None or run.scores.dtype == run.dtype))


# ---------------------------------------------------------------------- functional core


@dataclass
class _ParamBatch:
    """One run of parameters: per-tensor lists, flat buffers (and their per-tensor views), and its
    group's settings."""

    params: list[Tensor]
    grads: list[Tensor]
    exp_avg: Tensor  # flat m
    exp_avg_views: list[Tensor]
    exp_avg_sq: Tensor  # flat v
    exp_avg_sq_views: list[Tensor]
    delta_g: Optional[Tensor]  # flat Delta_G; None when the round has none or rho == 0
    direction: Tensor  # flat scratch: the denominator (eager) or Delta_G (fused), then u / u_scale
    direction_views: list[Tensor]
    scores: Optional[Tensor]  # flat float32/64 scratch: s / s_scale, then phi; None for signal "none"
    score_views: list[Optional[Tensor]]
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    rho: float
    trust_signal: str
    foreach: bool
    fused: bool
    kernel_step: Tensor  # 0-dim float32 on the device: t for torch._fused_adamw_
    compile: bool


class _TrustSegment:
    """One top-k selection: the flat scores it ranks (turned into phi in place), its scratch (on
    the device path also ``torch.topk``'s output, :meth:`top_k_buffers`), its group's settings
    and, for a large segment selected on the host, the fixed random positions whose scores
    bracket the threshold (:func:`_threshold_on_host`)."""

    def __init__(self, scores: Tensor, mask: Tensor, selector: Tensor, group: dict) -> None:
        self.scores, self.mask, self.selector = scores, mask, selector
        self.tau, self.alpha, self.gamma = group["tau"], group["alpha"], group["gamma"]
        self.scale_matched = group["scale_matched"]
        self.on_host = selector.dtype == torch.bool
        self.draws = 0  # samples drawn so far; a bracket that misses draws a new one
        self.sample = self.draw_sample()
        self._top_k: Optional[tuple[Tensor, Tensor]] = None

    def top_k_buffers(self, n: int) -> tuple[Tensor, Tensor]:
        """Values and indices buffers of ``n`` entries for ``torch.topk`` of the scores on the
        device path, allocated at the first step (n depends only on d and tau)."""
        if self._top_k is None or self._top_k[0].numel() != n:
            self._top_k = (torch.empty(n, dtype=self.scores.dtype, device=self.scores.device),
                           torch.empty(n, dtype=torch.int64, device=self.scores.device))
        return self._top_k

    def draw_sample(self) -> Optional["np.ndarray"]:
        """Sorted random positions (a cache-friendly gather), reproducible per size and draw."""
        d = self.scores.numel()
        if not self.on_host or d < _BRACKET_MIN:
            return None
        n = min(d // 16, math.ceil(2.0 * d ** (2.0 / 3.0)))  # balances sampling and extraction costs
        rng = np.random.default_rng([d, self.draws])
        self.draws += 1
        return np.sort(rng.integers(0, d, n))


def fedact_adamw(batches: Sequence[_ParamBatch], segments: Sequence[_TrustSegment], *,
                 local_step: int, global_step: int) -> None:
    r"""Functional core of :class:`FedACTAdamW`: one step for all batches.

    1. :func:`_direction`: m, v, u and s of every batch (Eqs. adam_moments to trust_score); the
       equations that do not involve g are one operation over the batch's flat buffers. u and s
       come out scaled by positive constants (``u = u_scale * direction``,
       ``s = s_scale * scores``), which saves passes and leaves the ranking of s unchanged;
       batches whose s scales differ are brought to the true s.
    2. :func:`_modulate`: each segment's top k (Eq. fedact_modulation), and
       ``direction <- phi * direction / phi_scale``.
    3. :func:`_update`: ``x <- (1 - lr*wd) x - (lr*u_scale*phi_scale) direction`` per parameter
       (Eq. fedact_update), the same operations as FedAdamW's (one fused kernel, or two).
    """
    scales = [_direction(b, local_step, global_step) for b in batches]
    scored = [(b, s) for b, (_, s) in zip(batches, scales) if b.scores is not None]
    if len({s for _, s in scored}) > 1:  # one selection may span batches: rank the true s
        for b, s_scale in scored:
            b.scores.mul_(s_scale)
    phi_scale = _modulate(segments, [b for b, _ in scored])
    for b, (u_scale, _) in zip(batches, scales):
        _update(b, u_scale * (phi_scale if b.scores is not None else 1.0))


def _direction(b: _ParamBatch, local_step: int, global_step: int) -> tuple[float, float]:
    r"""m, v, u and s of one batch, in place; returns ``(u_scale, s_scale)``.

    With :math:`c_1 = 1-\beta_1^k`, :math:`c_2 = \sqrt{1-\beta_2^t}` and the denominator
    :math:`D = \sqrt{v} + \epsilon c_2 = c_2 (\sqrt{\hat v} + \epsilon)`, the local direction is
    :math:`u_{loc} = (c_2/c_1)\, m / D`. Writing :math:`\sigma = (1-\rho) c_2 / c_1`:

    - with Delta_G (rho > 0): ``direction = Delta_G + (sigma/rho) m/D`` and ``u = rho * direction``;
    - without: ``direction = m/D`` and ``u = sigma * direction``;
    - ``scores = g * direction`` (so ``s = u_scale * scores``), or for FedACT-Local
      ``scores = g * m/D`` (``s_scale = c2/c1``).

    m, v and s need g, which comes tensor by tensor: with ``fused``, m, v and u are one call of
    torch's fused AdamW kernel (:func:`_moments_fused`), otherwise six operations
    (:func:`_moments_eager`); s see :func:`_scores`.
    """
    c1 = 1.0 - b.beta1 ** local_step
    c2 = math.sqrt(1.0 - b.beta2 ** global_step)
    sigma = (1.0 - b.rho) * c2 / c1
    dg, local = b.delta_g, b.trust_signal == "local"
    u_scale = b.rho if dg is not None else sigma
    s_scale = c2 / c1 if local else u_scale
    if b.compile and _direction_compiled(b, c2, sigma):
        return u_scale, s_scale
    # direction = dG + (sigma/rho) m/D, or m/D without dG and, until its scores, for FedACT-Local
    correction = None if local else dg
    ratio = sigma / b.rho if correction is not None else 1.0
    if b.fused:
        _moments_fused(b, c2, correction, ratio, global_step)
    else:
        _moments_eager(b, c2, correction, ratio)
    if b.scores is not None:
        _scores(b)                                           # s = s_scale * g * direction
    if local and dg is not None:
        torch.add(dg, b.direction, alpha=sigma / b.rho, out=b.direction)
    return u_scale, s_scale


def _moments_eager(b: _ParamBatch, c2: float, dg: Optional[Tensor], ratio: float) -> None:
    """m, v and ``direction = dg + ratio * m/D`` (``m/D`` without ``dg``) in six operations, with
    ``D = sqrt(v) + eps * c2``; ``foreach`` does m and v with one ``torch._foreach_*`` call
    each, the single-tensor path loops."""
    m, v, u = b.exp_avg, b.exp_avg_sq, b.direction
    v.mul_(b.beta2)
    if b.foreach:
        torch._foreach_lerp_(b.exp_avg_views, b.grads, 1.0 - b.beta1)               # m = b1*m + (1-b1)*g
        torch._foreach_addcmul_(b.exp_avg_sq_views, b.grads, b.grads, 1.0 - b.beta2)  # v = b2*v + (1-b2)*g*g
    else:
        for m_i, v_i, g in zip(b.exp_avg_views, b.exp_avg_sq_views, b.grads):
            m_i.lerp_(g, 1.0 - b.beta1)
            v_i.addcmul_(g, g, value=1.0 - b.beta2)
    torch.sqrt(v, out=u).add_(b.eps * c2)                    # D
    if dg is not None:
        torch.addcdiv(dg, m, u, value=ratio, out=u)
    else:
        torch.div(m, u, out=u)


def _moments_fused(b: _ParamBatch, c2: float, dg: Optional[Tensor], ratio: float, global_step: int) -> None:
    """What :func:`_moments_eager` computes, as ``direction <- dg`` (``<- 0`` without ``dg``) and
    one call of torch's fused AdamW kernel with the direction in the parameters' place and no
    weight decay. At step ``t`` that kernel makes AdamW's m and v and
    ``direction <- direction - (lr / (1 - beta1^t)) m / (sqrt(v / (1 - beta2^t)) + eps)``, and
    ``m / (sqrt(v) / c2 + eps) = c2 m / D``, so ``lr = -ratio (1 - beta1^t) / c2`` adds
    ``ratio * m/D``. Two passes over d instead of six."""
    if dg is not None:
        b.direction.copy_(dg)
    else:
        b.direction.zero_()
    b.kernel_step.fill_(global_step)
    torch._fused_adamw_(b.direction_views, b.grads, b.exp_avg_views, b.exp_avg_sq_views, [],
                        [b.kernel_step] * len(b.params), lr=-ratio * (1.0 - b.beta1 ** global_step) / c2,
                        beta1=b.beta1, beta2=b.beta2, weight_decay=0.0, eps=b.eps, amsgrad=False,
                        maximize=False)


def _direction_pass(g: Tensor, m: Tensor, v: Tensor, dg: Optional[Tensor], u: Tensor,
                    s: Optional[Tensor], c: Tensor, local: bool) -> None:
    """The equations of :func:`_direction` as one pass over flat buffers, for ``torch.compile``.
    ``g`` is the gathered gradient, held by ``s`` (or by ``u`` without scores); ``c`` holds
    1 - beta1, beta2, 1 - beta2, eps * c2 and sigma / rho (unused without Delta_G)."""
    m.copy_(torch.lerp(m, g, c[0]))
    v.copy_(v * c[1] + c[2] * g * g)
    q = m / (torch.sqrt(v) + c[3])
    direction = q if dg is None else dg + c[4] * q
    if s is not None:
        s.copy_(g * (q if local else direction))
    u.copy_(direction)


_COMPILED: dict[str, object] = {}


def _constants(values: list[float], like: Tensor) -> Tensor:
    """Scalars as a tensor on ``like``'s device (a compiled kernel then needs no recompilation
    when they change); off CPU copied from pinned memory, which does not wait for the device."""
    c = torch.tensor(values, dtype=like.dtype)
    return c if like.device.type == "cpu" else c.pin_memory().to(like.device, non_blocking=True)


def _run_compiled(name: str, fn: Callable, *args) -> bool:
    """``torch.compile(fn)(*args)``, compiled once per process; False (after one warning, and
    for good) when torch.compile does not work here."""
    if "error" in _COMPILED:
        return False
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False, fullgraph=True)
    try:
        _COMPILED[name](*args)
    except Exception as exc:  # noqa: BLE001 - whatever the compiler raised: eager from now on
        _COMPILED["error"] = exc
        warnings.warn(f"FedACTAdamW(compile=True): torch.compile failed ({type(exc).__name__}: {exc}); "
                      f"using the eager operations", RuntimeWarning, stacklevel=5)
        return False
    return True


def _direction_compiled(b: _ParamBatch, c2: float, sigma: float) -> bool:
    """Gather g and run :func:`_direction_pass` compiled; False when torch.compile does not
    work here, and the caller runs the eager operations."""
    g, views = (b.scores, b.score_views) if b.scores is not None else (b.direction, b.direction_views)
    ratio = sigma / b.rho if b.delta_g is not None else 1.0
    c = _constants([1.0 - b.beta1, b.beta2, 1.0 - b.beta2, b.eps * c2, ratio], g)
    torch._foreach_copy_(views, b.grads)
    return _run_compiled("direction", _direction_pass, g, b.exp_avg, b.exp_avg_sq, b.delta_g, b.direction,
                         b.scores, c, b.trust_signal == "local")


def _phi_pass(s: Tensor, u: Tensor, c: Tensor) -> None:
    """``u <- u * (1 + c[1] * (s >= c[0]))``: the top-k compare and phi in one pass, for
    ``torch.compile`` (:func:`_modulate`'s ``direction += kappa * top * direction``)."""
    u.copy_(u + c[1] * (u * (s >= c[0])))


def _phi_compiled(b: _ParamBatch, threshold: float, alpha_gamma: tuple[float, float]) -> bool:
    """Run :func:`_phi_pass` compiled on one batch; False when torch.compile does not work
    here (nothing was changed then, and the caller runs the eager operations)."""
    alpha, gamma = alpha_gamma
    return _run_compiled("phi", _phi_pass, b.scores, b.direction,
                         _constants([threshold, (alpha - gamma) / gamma], b.scores))


def _scores(b: _ParamBatch) -> None:
    """``scores <- g * direction`` in the score dtype (float32/64 whatever the parameter dtype):
    gathered and multiplied in two kernels (:func:`_gathers_scores`), or tensor by tensor."""
    if b.foreach and _gathers_scores(b.scores.device):
        torch._foreach_copy_(b.score_views, b.grads)
        b.scores.mul_(b.direction)
        return
    for s, u, g in zip(b.score_views, b.direction_views, b.grads):
        if s.dtype == u.dtype == g.dtype:
            torch.mul(g, u, out=s)
        else:
            s.copy_(g).mul_(u)


def _gathers_scores(device: torch.device) -> bool:
    """Whether ``foreach`` computes s by gathering g into the flat scores and multiplying there:
    two kernels whatever the number of tensors, the better choice where launches cost (GPU); on
    CPU one product per tensor saves the gather pass (about 6 % of the step)."""
    return device.type != "cpu"


def _update(b: _ParamBatch, scale: float) -> None:
    """x <- (1 - lr*wd) x - (lr*scale) direction, where ``scale * direction`` is phi * u.

    With ``fused`` (and ``scale > 0``, float32/float64) one call of torch's fused SGD kernel
    without momentum, ``x <- x - lr' (direction + wd' x)``, with ``lr' = lr * scale`` and
    ``wd' = wd / scale``; otherwise a decay and an add."""
    if b.fused and scale > 0.0 and b.direction.dtype in _FUSED_UPDATE_DTYPES:
        torch._fused_sgd_(b.params, b.direction_views, [], weight_decay=b.weight_decay / scale, momentum=0.0,
                          lr=b.lr * scale, dampening=0.0, nesterov=False, maximize=False, is_first_step=False)
        return
    decay, coef = 1.0 - b.lr * b.weight_decay, -b.lr * scale
    if b.foreach:
        if b.weight_decay != 0.0:
            torch._foreach_mul_(b.params, decay)
        torch._foreach_add_(b.params, b.direction_views, alpha=coef)
        return
    for p, u in zip(b.params, b.direction_views):
        if b.weight_decay != 0.0:
            p.mul_(decay)
        p.add_(u, alpha=coef)


def _phi_factors(d: int, tau: float, alpha: float, gamma: float, scale_matched: bool) -> tuple[int, float, float]:
    """``k = floor(tau * d)`` and the factors alpha and gamma of a selection over d entries, both
    divided by the mean factor ``(k alpha + (d - k) gamma) / d`` when ``scale_matched``."""
    k = math.floor(tau * d)
    if scale_matched and d > 0:
        mean = (k * alpha + (d - k) * gamma) / d
        if mean > 0.0:
            alpha, gamma = alpha / mean, gamma / mean
    return k, alpha, gamma


def _phi_values(seg: _TrustSegment) -> tuple[int, float, float]:
    """:func:`_phi_factors` of a segment."""
    return _phi_factors(seg.scores.numel(), seg.tau, seg.alpha, seg.gamma, seg.scale_matched)


def _modulate(segments: Sequence[_TrustSegment], batches: Sequence[_ParamBatch]) -> float:
    """Apply phi (Eq. fedact_modulation) to the direction of every scored batch; return the
    ``phi_scale`` left to the update: ``direction <- phi * direction / phi_scale``.

    Each segment's scores first become 1 on its top k and 0 elsewhere (``top``). When all
    segments share alpha and gamma (always, unless per-tensor scale matching), one operation per
    batch finishes: ``direction += ((alpha - gamma) / gamma) * top * direction`` with
    ``phi_scale = gamma`` (``direction *= top`` and ``alpha`` when gamma = 0); otherwise the
    scores become phi segment by segment and multiply the direction (``phi_scale = 1``). With
    ``compile``, one global threshold and no tie, the comparison and that operation are one
    compiled pass (:func:`_phi_pass`).

    On the host, a global segment's threshold is found with its work split over threads, and
    per-tensor segments are spread over threads.
    """
    values = [_phi_values(seg) for seg in segments]
    host = [(seg, k) for seg, (k, _, _) in zip(segments, values)
            if seg.on_host and 0 < k < seg.scores.numel()]
    if len(host) == 1:
        found = [_threshold_on_host(host[0][0], host[0][1], parallel=True)]
    else:
        found = _host_map(lambda item: _threshold_on_host(*item, parallel=False), host,
                          [seg.scores.numel() for seg, _ in host])
    thresholds = {id(seg): t for (seg, _), t in zip(host, found)}
    fused = set()  # batches done by one compiled pass: one global threshold, no tie, gamma > 0
    if len(found) == len(segments) == 1 and found[0][1] == segments[0].scores.numel() and values[0][2] > 0:
        for b in batches:
            if not (b.compile and _phi_compiled(b, found[0][0], values[0][1:])):
                break
            fused.add(id(b))
        if len(fused) == len(batches):
            return values[0][2]
    for seg, (k, _, _) in zip(segments, values):
        _top_k_indicator(seg, k, thresholds.get(id(seg)))
    pairs = {(alpha, gamma) for _, alpha, gamma in values}
    if len(pairs) == 1:
        ((alpha, gamma),) = pairs
        for b in batches:
            if id(b) in fused:
                continue
            if gamma > 0.0:
                b.direction.addcmul_(b.direction, b.scores, value=(alpha - gamma) / gamma)
            else:
                b.direction.mul_(b.scores)
        return gamma if gamma > 0.0 else alpha
    for seg, (_, alpha, gamma) in zip(segments, values):
        seg.scores.mul_(alpha - gamma).add_(gamma)
    for b in batches:
        b.direction.mul_(b.scores)
    return 1.0


def _top_k_indicator(seg: _TrustSegment, k: int, host_threshold: Optional[tuple[float, int]]) -> None:
    """``seg.scores`` <- 1 on its ``k`` largest entries, ties to the lowest index, 0 elsewhere.

    ``host_threshold``: ``(T, cut)`` from :func:`_threshold_on_host` for a host segment: the
    entries ``>= T`` before ``cut`` and ``> T`` from ``cut`` on are exactly the top k.
    """
    s = seg.scores
    d = s.numel()
    if k == 0 or k == d:
        s.fill_(1.0 if k else 0.0)
    elif host_threshold is None:
        _top_k_indicator_on_device(seg, k)
    else:
        threshold, cut = host_threshold
        head, tail = s[:cut], s[cut:]
        torch.ge(head, threshold, out=head)
        if cut < d:
            torch.gt(tail, threshold, out=tail)


def _threshold_on_host(seg: _TrustSegment, k: int, parallel: bool) -> tuple[float, int]:
    """The ``k``-th largest score ``T`` of a host segment (0 < k < d), exactly, and the index
    ``cut`` such that ``{s > T} ∪ {s == T before cut}`` has exactly ``k`` entries (``cut = d``
    when no tie straddles the boundary).

    A large segment's sample brackets T between two of its order statistics ``lo <= hi``
    (:func:`_bracket`); one pass counts the scores above ``hi`` and extracts those in
    ``[lo, hi]`` (about ``2.5 d / sqrt(n)`` of them for n samples at tau = 0.5), in chunks that
    stay in cache, on threads when ``parallel``; a selection on the extracted scores gives T.
    When the bracket misses (checked exactly) the selection runs on all scores and a new sample
    is drawn: the result is exact either way.
    """
    a = seg.scores.numpy()
    d = a.size
    band, n_above = a, 0
    if seg.sample is not None:
        lo, hi = _bracket(a[seg.sample], (d - k) / d)
        above, inside = seg.mask.numpy(), seg.selector.numpy()
        step = _HOST_CHUNK  # the passes over one chunk stay in cache

        def work(i: int) -> tuple[int, np.ndarray]:
            return _count_and_extract(a[i:i + step], lo, hi, above[i:i + step], inside[i:i + step])

        chunks = range(0, d, step)
        sizes = [min(step, d - i) for i in chunks]
        parts = _host_map(work, chunks, sizes) if parallel else [work(i) for i in chunks]
        n_above = sum(n for n, _ in parts)
        candidates = np.concatenate([c for _, c in parts])
        if 0 < k - n_above <= candidates.size:
            band = candidates
        else:  # the bracket missed T (rare): select on everything, and draw a new sample
            n_above = 0
            seg.sample = seg.draw_sample()
    j = band.size - (k - n_above)  # T is band's entry j in ascending order
    part = np.partition(band, j)
    threshold = part[j]
    if j == 0 or part[:j].max() != threshold:  # no score below the top k equals T
        return float(threshold), d
    # A tie straddles the boundary: the top k hold every score above T and the first `need`
    # scores equal to T, need being how many of them fall in the band's top part.
    need = int(np.count_nonzero(part[j:] == threshold))
    return float(threshold), _index_after(a, threshold, need)


def _count_and_extract(a: "np.ndarray", lo: float, hi: float, above: "np.ndarray",
                       inside: "np.ndarray") -> tuple[int, "np.ndarray"]:
    """How many entries of ``a`` exceed ``hi``, and those in ``[lo, hi]`` (bool scratch given)."""
    np.greater(a, hi, out=above)
    np.greater_equal(a, lo, out=inside)
    np.not_equal(inside, above, out=inside)  # lo <= a <= hi
    return int(np.count_nonzero(above)), np.compress(inside, a)  # 2x faster than a[inside] here


def _bracket(sample: "np.ndarray", q: float) -> tuple[float, float]:
    """Entries ``lo <= hi`` of the sample around its ``q``-quantile, ``_BRACKET_Z`` standard
    deviations of the sample rank apart (``-inf`` / ``inf`` past its ends)."""
    n = sample.size
    half = _BRACKET_Z * math.sqrt(q * (1.0 - q) * n) + 1.0
    j_lo, j_hi = math.floor(q * n - half), math.ceil(q * n + half)
    inner = [j for j in (j_lo, j_hi) if 0 <= j < n]
    part = np.partition(sample, inner) if inner else sample
    lo = part[j_lo] if j_lo >= 0 else -np.inf
    hi = part[j_hi] if j_hi < n else np.inf
    return lo, hi


def _index_after(a: "np.ndarray", value: float, n: int) -> int:
    """The index just after the ``n``-th entry of ``a`` equal to ``value`` (n >= 1, flat order)."""
    for start in range(0, a.size, _TIE_CHUNK):
        equal = a[start:start + _TIE_CHUNK] == value
        count = int(np.count_nonzero(equal))
        if count >= n:
            return start + int(np.flatnonzero(equal)[n - 1]) + 1
        n -= count
    raise AssertionError("fewer entries equal the threshold than counted")  # pragma: no cover


_POOL: dict[tuple[int, int], ThreadPoolExecutor] = {}


def _host_map(fn: Callable, items: Sequence, sizes: Sequence[int]) -> list:
    """``[fn(x) for x in items]`` on up to ``torch.get_num_threads()`` threads: the host selection
    is numpy work that releases the GIL, so it can use the cores torch would use.

    The items are cut into one run of consecutive items per thread, of about equal total
    ``sizes``; the calling thread works through the first run itself. One task per thread, not
    one per item: handing 80 small per-tensor selections to a pool one by one cost more than
    the second core gave (ViT-Tiny, ``trust_scope="tensor"``, docs/PERFORMANCE.md)."""
    if len(sizes) != len(items):
        raise ValueError(f"_host_map: {len(sizes)} sizes for {len(items)} items")
    workers = min(torch.get_num_threads(), len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    key = (os.getpid(), workers - 1)  # a forked child builds its own pool
    if key not in _POOL:
        _POOL.clear()
        _POOL[key] = ThreadPoolExecutor(workers - 1, thread_name_prefix="fedact-select")
    runs = _balanced_runs(sizes, workers)
    pending = [_POOL[key].submit(lambda run=run: [fn(items[i]) for i in run]) for run in runs[1:]]
    try:
        results = [fn(items[i]) for i in runs[0]]
    finally:  # also when this thread's run raised: no task may go on writing the step's scratch
        wait(pending)
    for future in pending:
        results.extend(future.result())
    return results


def _balanced_runs(sizes: Sequence[int], n: int) -> list[range]:
    """``n`` runs of consecutive indices into ``sizes`` (some may be empty), the j-th ending at
    the first index where the running total reaches ``j / n`` of the whole."""
    total, bounds, running, j = sum(sizes), [0], 0, 1
    for i, size in enumerate(sizes):
        running += size
        while j < n and running * n >= total * j:
            bounds.append(i + 1)
            j += 1
    bounds += [len(sizes)] * (n + 1 - len(bounds))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _top_k_indicator_on_device(seg: _TrustSegment, k: int) -> None:
    """The device path of :func:`_top_k_indicator` (also without numpy), all tensor operations,
    so nothing waits for the device. The threshold T, the k-th largest score, is the smallest of
    the k largest scores or the largest of the d - k + 1 smallest (``torch.topk`` of the smaller
    side, into the segment's buffers); the tie-break is a running count of the entries equal to
    T, in the segment's ``mask`` (bool) and ``selector`` (integer) scratch.

    ``torch.topk``, not ``torch.kthvalue``: PyTorch's CUDA kthvalue runs one thread block per
    slice (``gatherKthValue`` in ATen's Sorting.cu), so one multiprocessor would read all d
    scores many times over (pytorch/pytorch#75599: 20x slower than a full sort for 10^8
    values), where topk's radix select spreads one large slice over many blocks (``mbtopk`` in
    TensorTopK.cu)."""
    s, mask, ranks = seg.scores, seg.mask, seg.selector
    d = s.numel()
    largest = k <= d - k + 1
    values, indices = seg.top_k_buffers(k if largest else d - k + 1)
    torch.topk(s, values.numel(), largest=largest, sorted=False, out=(values, indices))
    threshold = values.min() if largest else values.max()    # k-th largest, stays on the device
    # (scores must be finite: topk ranks NaN highest, and a NaN T selects nothing)
    torch.gt(s, threshold, out=ranks)
    need = k - ranks.sum()                                    # places left for entries equal to T
    torch.eq(s, threshold, out=mask)
    torch.cumsum(mask, 0, dtype=ranks.dtype, out=ranks)       # ties at or before each index
    mask.logical_and_(ranks.le_(need))                        # the first `need` ties
    torch.gt(s, threshold, out=s).add_(mask)
