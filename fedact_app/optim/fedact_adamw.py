"""The :class:`FedACTAdamW` optimizer: its maths, arguments, param groups, state and rounds.

The step itself is :func:`fedact_app.optim.kernels.fedact_step` over the flat layout of
:mod:`fedact_app.optim.layout`; the exact top-k is :mod:`fedact_app.optim.topk`.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from fedact_app.optim.kernels import fedact_step, phi_factors
from fedact_app.optim.layout import TRUST_KEYS, Workspace
from fedact_app.optimizer_base import LazyDynamoOptimizer, check_aligned
from fedact_app.registry import TRUST_SCOPES, TRUST_SIGNALS, require_hyperparameters

__all__ = ["FedACTAdamW", "TRUST_SCOPES", "TRUST_SIGNALS"]



def _validate_hyperparameters(
    *, lr, betas, eps, weight_decay, rho, tau, alpha, gamma, trust_scope, trust_signal
) -> tuple[float, float]:
    """Check every hyperparameter of one param group; return the resolved ``(alpha, gamma)``."""
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Invalid lr: a tensor of shape {tuple(lr.shape)}; expected a float or a "
                         f"one-element tensor (one learning rate per param group)")
    alpha = 1.0 / tau if alpha is None and isinstance(tau, (int, float)) and tau > 0 else alpha
    gamma = tau if gamma is None else gamma
    require_hyperparameters(lr=float(lr) if isinstance(lr, Tensor) else lr, eps=eps, betas=betas, weight_decay=weight_decay, rho=rho, tau=tau,
                            gamma=gamma, alpha=alpha, trust_scope=trust_scope, trust_signal=trust_signal)
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
    v̄ synchronisation; ``rho = 0`` with ``trust_signal="none"`` is AdamW warm-started from v̄;
    ``alpha == gamma`` is a learning rate rescaled by ``alpha``.

    Step count. ``k`` and ``t`` count calls of :meth:`step` for the whole optimizer (the seed's
    local step), where :class:`torch.optim.AdamW` counts each parameter's own steps. So with
    ``rho = 0``, ``trust_signal="none"``, ``v_bar=None`` and ``global_step=0`` this is exactly
    AdamW as long as every parameter has a gradient at every step; a parameter that skips steps
    (frozen for a while, or added by :meth:`add_param_group` after some steps) takes the
    optimizer's ``k`` and ``t`` in its bias corrections, not its own count.

    Top-k selection. ``d`` counts the coordinates of the parameters that have a gradient this step.
    With ``trust_scope="global"`` (the seed's ``s in R^d``) one selection of ``floor(tau * d)``
    entries runs over all of them; with ``"tensor"`` each parameter tensor selects
    ``floor(tau * numel)`` of its own (as MGUP, cautious AdamW and timm do). Exactly that many
    entries get ``alpha``, also when ``s`` has ties: ties go to the lowest flat index, the flat
    order being ``param_groups`` order, then parameter order, then ``p.reshape(-1)`` order
    (:func:`fedact_app.optim.topk.top_k_indicator_`). The selection runs in float32 (float64 when
    a parameter is float64) whatever the parameter dtype. ``scale_matched=True`` (not in the seed)
    divides ``phi`` by its mean over the selection scope, ``(k*alpha + (d-k)*gamma)/d``.

    Args:
        params: parameters or param groups. ``lr``, ``weight_decay``, ``betas`` and ``eps`` may
            differ between groups; the trust settings (``rho`` to ``scale_matched``) must agree
            across groups when ``trust_scope="global"``.
        lr: learning rate eta (>= 0): a float or a one-element tensor.
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
        foreach: m, v, s and the update as one ``torch._foreach_*`` call each instead of a loop
            over tensors (``None``, the default: on). Both compute the same thing.
        fused: m, v and u as one call of torch's fused AdamW kernel and the update as one call
            of its fused SGD kernel, with FedACT's coefficients (kernels.py); equal to the eager
            operations up to rounding (where float16's ``eps`` underflows the kernel gives 0 where
            the eager ``0/0`` gives NaN, as in torch's AdamW). ``None`` (default): on for CPU and CUDA
            parameters: faster than the eager operations on CPU, within a few percent of them on
            CUDA (docs/PERFORMANCE.md).
            ``True``: on where the kernels can run; where they cannot (a device other than CPU
            or CUDA, a non-contiguous parameter or gradient such as channels_last, the update of
            bfloat16/float16 parameters) those tensors take the eager operations and a
            ``RuntimeWarning`` says so, once per reason.
        compile: m, v, u and s as one ``torch.compile``-d pass, and (one global threshold, no
            tie) the comparison with phi as another (float32/float64 parameters). Off the host
            (CUDA) the exact selection of float32 scores also runs compiled: by counting, one
            read of the scores a pass and no atomic addition, instead of the radix select's
            histograms, and without its scratch (:class:`fedact_app.optim.topk._CountSelect`).
            Compiled once per layout and process, at the first step. When compilation fails it
            warns once for the process and uses the eager operations (the radix select for the
            selection).
        cuda_graph: on CUDA, the exact selection's operations (about 140 small kernels) are
            captured as one CUDA graph at the second step of a layout and replayed at every
            later step, one launch instead of 140; the same kernels, so the same result bit for
            bit (:class:`fedact_app.optim.topk.TopKSelector`). ``False``: launched one by one.
            Ignored off CUDA. Inside a capture of the caller's (the whole step as a graph) the
            operations go into that graph; run a step with the same settings before capturing
            (as ``torch.cuda.graph`` asks), since new settings copy their ks from host memory.
            A capture that fails warns and launches the operations one by one.

    State per parameter: ``exp_avg`` (m), ``exp_avg_sq`` (v) and, while the round has a
    correction with ``rho > 0``, ``delta_g``; views of flat buffers (layout.py). Assigning one
    (``opt.state[p]["exp_avg"] = t``) is honoured: the next step copies it into the buffers. The
    local step ``k`` and the round's starting global step are kept in every param group
    (``"local_step"``, ``"round_start_step"``), so :meth:`state_dict` carries them. Calling
    :meth:`step` without :meth:`begin_round` behaves as after ``begin_round()``.

    The seed asks ``alpha > gamma > 0``; ``alpha == gamma`` and ``gamma == 0`` (a hard mask) are
    accepted as limits. Scores must be finite. ``torch.compile(opt.step)`` runs the step itself
    eagerly (the exact top-k is numpy and threads on CPU); ``compile=True`` compiles its passes.
    """

    def __init__(
        self,
        params,
        lr: float | Tensor = 3e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        rho: float = 0.5,
        tau: float = 0.5,
        alpha: Optional[float] = None,
        gamma: Optional[float] = None,
        trust_scope: str = "global",
        trust_signal: str = "corrected",
        *,
        scale_matched: bool = False,
        foreach: Optional[bool] = None,
        fused: Optional[bool] = None,
        compile: bool = False,
        cuda_graph: bool = True,
    ) -> None:
        _validate_hyperparameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rho=rho,
                                  tau=tau, alpha=alpha, gamma=gamma, trust_scope=trust_scope,
                                  trust_signal=trust_signal)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, rho=rho,
                        tau=tau, alpha=alpha, gamma=gamma, trust_scope=trust_scope,
                        trust_signal=trust_signal, scale_matched=bool(scale_matched), foreach=foreach,
                        fused=fused, compile=bool(compile))
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"Invalid cuda_graph: {cuda_graph!r}; expected True or False")
        self.cuda_graph = cuda_graph
        self._workspace: Optional[Workspace] = None
        self._fused_warned: set[str] = set()
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups and state

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group after validating its settings. ``alpha``/``gamma`` left at ``None``
        resolve here, once, from the group's ``tau`` (to ``1/tau`` and ``tau``)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"Invalid param_group: expected a dict with a 'params' entry, got "
                            f"{type(param_group).__name__} (add_param_group({{'params': ...}}))")
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        if not (merged.get("fused") is None or isinstance(merged["fused"], bool)):
            raise ValueError(f"Invalid fused: {merged['fused']!r}; expected None (on for CPU and CUDA parameters), "
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

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "cuda_graph": self.cuda_graph}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # keys that state dicts of older versions lack
            group.setdefault("local_step", 0)
            group.setdefault("round_start_step", 0)
            group.setdefault("foreach", None)
            group.setdefault("fused", None)
            group.setdefault("compile", False)
        self._workspace = None  # the loaded state is packed again at the next step
        self._fused_warned = set()
        self.cuda_graph = state.get("cuda_graph", True)

    def _check_trust_groups(self) -> None:
        groups = self.param_groups
        if not any(g["trust_scope"] == "global" for g in groups):
            return
        for key in TRUST_KEYS:
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
            k, alpha, gamma = phi_factors(d, group["tau"], group["alpha"], group["gamma"],
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
            check_aligned(name, arrays, params)
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
        if torch.compiler.is_compiling():  # traced by torch.compile: run the step eagerly
            _step_untraced(self)
        else:
            self._step()
        return loss

    def _step(self) -> None:
        self._check_trust_groups()
        groups = self.param_groups
        present = [[p for p in group["params"] if p.grad is not None] for group in groups]
        for params in present:  # refuse before any state changes
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("FedACTAdamW does not support sparse gradients")
                if torch.is_complex(p):
                    raise RuntimeError("FedACTAdamW does not support complex parameters")
        for params in present:
            for p in params:
                self._init_state(p)
        ws = self._workspace
        if ws is None or not ws.matches(groups, present, self.state):
            self._workspace = None  # release the old scratch before allocating the new
            ws = self._workspace = Workspace(groups, present, self.state)
        for run in ws.runs:
            refusal = run.prepare(groups[run.group])
            if refusal is not None and refusal not in self._fused_warned:
                self._fused_warned.add(refusal)
                warnings.warn(f"FedACTAdamW(fused=True): torch's fused kernels cannot run for {refusal}; "
                              f"those tensors take the eager operations", RuntimeWarning,
                              stacklevel=5)  # the caller of step()
        k = groups[0]["local_step"] + 1
        fedact_step(ws.runs, ws.selections(groups, self.cuda_graph), local_step=k,
                    global_step=groups[0]["round_start_step"] + k)
        for group in groups:
            group["local_step"] = k


def _step_untraced(optimizer: FedACTAdamW) -> None:
    """:meth:`FedACTAdamW._step` hidden from torch.compile's tracer (a graph break): the top-k
    runs numpy on torch's threads, and torch's fused AdamW kernel with the step's float lr is
    not traceable. ``torch._disable_dynamo`` imports torch._dynamo at its first call, which a
    trace has done already."""
    global _step_untraced_fn
    if _step_untraced_fn is None:
        _step_untraced_fn = torch._disable_dynamo(FedACTAdamW._step)
    _step_untraced_fn(optimizer)


_step_untraced_fn: Optional[Callable[[FedACTAdamW], None]] = None
