r"""The functional core of :class:`FedACTAdamW`: one step over the flat layout (layout.py).

The step is memory-bound, so it is written as few passes over the d coordinates as eager PyTorch
allows: the equations that do not involve the gradient or the parameter tensor by tensor are one
operation over a run's flat buffers, the others one ``torch._foreach_*`` call, or one call of
torch's fused AdamW kernel (m, v, u) and of its fused SGD kernel (the update); ``compile=True``
fuses m, v, u and s into one compiled pass. docs/PERFORMANCE.md has the measurements.

Notation. With :math:`b_1 = 1-\beta_1^k` (``bias1``), :math:`r_2 = \sqrt{1-\beta_2^t}`
(``sqrt_bias2``) and the denominator :math:`D = \sqrt{v} + \epsilon r_2 = r_2 (\sqrt{\hat v} +
\epsilon)`, the local direction is :math:`u_{loc} = (r_2/b_1)\, m / D` and
:math:`u = \lambda\, m/D + \rho \Delta_G` with ``local_scale`` :math:`\lambda = (1-\rho) r_2/b_1`.
u and s are kept as positive multiples (``u = u_scale * direction``, ``s = s_scale * scores``),
which saves passes and leaves the ranking of s unchanged:

- with Delta_G (rho > 0): ``direction = Delta_G + (lambda/rho) m/D`` and ``u_scale = rho``;
- without: ``direction = m/D`` and ``u_scale = lambda``;
- ``scores = g * direction`` (``s_scale = u_scale``), or for FedACT-Local ``scores = g * m/D``
  (``s_scale = r_2/b_1``).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from fedact_app.optim.layout import FUSED_UPDATE_DTYPES, Run
from fedact_app.optim import topk
from fedact_app.optim.topk import TopKSelector


def fedact_step(runs: Sequence[Run], selections: Sequence[tuple[TopKSelector, list[dict]]], *,
                local_step: int, global_step: int) -> None:
    r"""One step of every run (prepared: :meth:`Run.prepare`).

    1. :func:`_direction`: m, v, u and s of every run (Eqs. adam_moments to trust_score); runs
       whose s scales differ are brought to the true s (one selection may span runs).
    2. :func:`_modulate`: each selection's top k (Eq. fedact_modulation), and
       ``direction <- phi * direction / phi_scale``.
    3. :func:`_update`: ``x <- (1 - lr*wd) x - (lr*u_scale*phi_scale) direction`` per parameter
       (Eq. fedact_update), the same operations as FedAdamW's (one fused kernel, or two).
    """
    scales = [_direction(run, local_step, global_step) for run in runs]
    scored = [(run, s) for run, (_, s) in zip(runs, scales) if run.scores is not None]
    if len({s for _, s in scored}) > 1:
        for run, s_scale in scored:
            run.scores.mul_(s_scale)
    phi_scale = _modulate(selections, [run for run, _ in scored])
    for run, (u_scale, _) in zip(runs, scales):
        _update(run, u_scale * (phi_scale if run.scores is not None else 1.0))
        run.grads = None  # the caller may free them (zero_grad) before the next backward


def _direction(run: Run, local_step: int, global_step: int) -> tuple[float, float]:
    """m, v, u and s of one run, in place (module docstring); returns ``(u_scale, s_scale)``.

    m, v and s need g, which comes tensor by tensor: with ``fused``, m, v and u are one call of
    torch's fused AdamW kernel (:func:`_moments_fused`), otherwise six operations
    (:func:`_moments_eager`); s see :func:`_scores`.
    """
    bias1 = 1.0 - run.beta1 ** local_step
    sqrt_bias2 = math.sqrt(1.0 - run.beta2 ** global_step)
    local_scale = (1.0 - run.rho) * sqrt_bias2 / bias1
    delta_g, local = run.delta_g, run.trust_signal == "local"
    u_scale = run.rho if delta_g is not None else local_scale
    s_scale = sqrt_bias2 / bias1 if local else u_scale
    # u = Delta_G + (lambda/rho) m/D, or m/D without Delta_G: what :func:`_modulate` computes
    # again when the device selection has used the direction's memory
    run.moments = (sqrt_bias2, delta_g, local_scale / run.rho if delta_g is not None else 1.0)
    if run.compile and _direction_compiled(run, sqrt_bias2, local_scale):
        return u_scale, s_scale
    # direction = Delta_G + (lambda/rho) m/D, or m/D without Delta_G and, until its scores, for
    # FedACT-Local
    correction = None if local else delta_g
    ratio = local_scale / run.rho if correction is not None else 1.0
    if run.fused:
        _moments_fused(run, sqrt_bias2, correction, ratio, global_step)
    else:
        _moments_eager(run, sqrt_bias2, correction, ratio)
    if run.scores is not None:
        _scores(run)                                         # s = s_scale * g * direction
    if local and delta_g is not None:
        torch.add(delta_g, run.direction, alpha=local_scale / run.rho, out=run.direction)
    return u_scale, s_scale


def _moments_eager(run: Run, sqrt_bias2: float, delta_g: Optional[Tensor], ratio: float) -> None:
    """m, v and ``direction = delta_g + ratio * m/D`` (``m/D`` without ``delta_g``) in six
    operations, with ``D = sqrt(v) + eps * sqrt_bias2``; ``foreach`` does m and v with one
    ``torch._foreach_*`` call each, the single-tensor path loops."""
    v = run.exp_avg_sq
    v.mul_(run.beta2)
    if run.foreach:
        torch._foreach_lerp_(run.exp_avg_views, run.grads, 1.0 - run.beta1)               # m = b1*m + (1-b1)*g
        torch._foreach_addcmul_(run.exp_avg_sq_views, run.grads, run.grads, 1.0 - run.beta2)  # v += (1-b2)*g*g
    else:
        for m_i, v_i, g in zip(run.exp_avg_views, run.exp_avg_sq_views, run.grads):
            m_i.lerp_(g, 1.0 - run.beta1)
            v_i.addcmul_(g, g, value=1.0 - run.beta2)
    _direction_from_moments(run, sqrt_bias2, delta_g, ratio)


def _direction_from_moments(run: Run, sqrt_bias2: float, delta_g: Optional[Tensor], ratio: float) -> None:
    """``direction <- delta_g + ratio * m/D`` (``m/D`` without ``delta_g``) from the run's m and
    v, with ``D = sqrt(v) + eps * sqrt_bias2``: three operations."""
    u = run.direction
    torch.sqrt(run.exp_avg_sq, out=u).add_(run.eps * sqrt_bias2)  # D
    if delta_g is not None:
        torch.addcdiv(delta_g, run.exp_avg, u, value=ratio, out=u)
    else:
        torch.div(run.exp_avg, u, out=u)


def _moments_fused(run: Run, sqrt_bias2: float, delta_g: Optional[Tensor], ratio: float,
                   global_step: int) -> None:
    """What :func:`_moments_eager` computes, as ``direction <- delta_g`` (``<- 0`` without it) and
    one call of torch's fused AdamW kernel with the direction in the parameters' place and no
    weight decay. At step ``t`` that kernel makes AdamW's m and v and
    ``direction <- direction - (lr / (1 - beta1^t)) m / (sqrt(v / (1 - beta2^t)) + eps)``, and
    ``m / (sqrt(v) / sqrt_bias2 + eps) = sqrt_bias2 m / D``, so
    ``lr = -ratio (1 - beta1^t) / sqrt_bias2`` adds ``ratio * m/D``. Two passes over d instead of
    six."""
    if delta_g is not None:
        run.direction.copy_(delta_g)
    else:
        run.direction.zero_()
    run.kernel_step.fill_(global_step)
    torch._fused_adamw_(run.direction_views, run.grads, run.exp_avg_views, run.exp_avg_sq_views, [],
                        [run.kernel_step] * len(run.params),
                        lr=-ratio * (1.0 - run.beta1 ** global_step) / sqrt_bias2,
                        beta1=run.beta1, beta2=run.beta2, weight_decay=0.0, eps=run.eps, amsgrad=False,
                        maximize=False)


def _direction_pass(g: Tensor, m: Tensor, v: Tensor, delta_g: Optional[Tensor], u: Tensor,
                    s: Optional[Tensor], c: Tensor, local: bool) -> None:
    """The equations of :func:`_direction` as one pass over flat buffers, for ``torch.compile``.
    ``g`` is the gathered gradient, held by ``s`` (or by ``u`` without scores); ``c`` holds
    1 - beta1, beta2, 1 - beta2, eps * sqrt_bias2 and lambda / rho (unused without Delta_G)."""
    m.copy_(torch.lerp(m, g, c[0]))
    v.copy_(v * c[1] + c[2] * g * g)
    q = m / (torch.sqrt(v) + c[3])
    direction = q if delta_g is None else delta_g + c[4] * q
    if s is not None:
        s.copy_(g * (q if local else direction))
    u.copy_(direction)


def _constants(values: list[float], like: Tensor) -> Tensor:
    """Scalars as a tensor on ``like``'s device (a compiled kernel then needs no recompilation
    when they change); off CPU copied from pinned memory, which does not wait for the device."""
    c = torch.tensor(values, dtype=like.dtype)
    return c if like.device.type == "cpu" else c.pin_memory().to(like.device, non_blocking=True)


def _run_compiled(run: Run, name: str, fn: Callable, *args) -> bool:
    """``fn(*args)`` compiled for ``run``'s layout (:func:`fedact_app.optim.topk.compiled_copy`:
    a code object per layout, so a process may step many layouts); False (for good, after one
    warning for the process, :func:`fedact_app.optim.topk.compile_failed`) when torch.compile
    does not work here."""
    if topk.compile_disabled():
        return False
    if name not in run.compiled:
        run.compiled[name] = topk.compiled_copy(fn)
    try:
        run.compiled[name](*args)
    except topk.CompileFailed as err:  # eager from now on
        if topk.compile_failed(err.__cause__ or err):
            warnings.warn(f"FedACTAdamW(compile=True): torch.compile failed ({err}); using the eager operations",
                          RuntimeWarning, stacklevel=9)  # step()'s caller
        return False
    return True


def _direction_compiled(run: Run, sqrt_bias2: float, local_scale: float) -> bool:
    """Gather g and run :func:`_direction_pass` compiled; False when torch.compile does not
    work here, and the caller runs the eager operations."""
    g, views = (run.scores, run.score_views) if run.scores is not None else (run.direction, run.direction_views)
    ratio = local_scale / run.rho if run.delta_g is not None else 1.0
    c = _constants([1.0 - run.beta1, run.beta2, 1.0 - run.beta2, run.eps * sqrt_bias2, ratio], g)
    torch._foreach_copy_(views, run.grads)
    return _run_compiled(run, "direction", _direction_pass, g, run.exp_avg, run.exp_avg_sq, run.delta_g,
                         run.direction, run.scores, c, run.trust_signal == "local")


def _phi_pass(s: Tensor, u: Tensor, c: Tensor) -> None:
    """``u <- u * (1 + c[1] * (s >= c[0]))``: the top-k compare and phi in one pass, for
    ``torch.compile`` (:func:`_modulate`'s ``direction += kappa * top * direction``)."""
    u.copy_(u + c[1] * (u * (s >= c[0])))


def _phi_compiled(run: Run, threshold: float, alpha_gamma: tuple[float, float]) -> bool:
    """Run :func:`_phi_pass` compiled on one run; False when torch.compile does not work here
    (nothing was changed then, and the caller runs the eager operations)."""
    alpha, gamma = alpha_gamma
    return _run_compiled(run, "phi", _phi_pass, run.scores, run.direction,
                         _constants([threshold, (alpha - gamma) / gamma], run.scores))


def _scores(run: Run) -> None:
    """``scores <- g * direction`` in the score dtype (float32/64 whatever the parameter dtype):
    gathered and multiplied in two kernels (:func:`_gathers_scores`), or tensor by tensor."""
    if run.foreach and _gathers_scores(run.scores.device):
        torch._foreach_copy_(run.score_views, run.grads)
        run.scores.mul_(run.direction)
        return
    for s, u, g in zip(run.score_views, run.direction_views, run.grads):
        if s.dtype == u.dtype == g.dtype:
            torch.mul(g, u, out=s)
        else:
            s.copy_(g).mul_(u)


def _gathers_scores(device: torch.device) -> bool:
    """Whether ``foreach`` computes s by gathering g into the flat scores and multiplying there:
    two kernels whatever the number of tensors, the better choice where launches cost (GPU); on
    CPU one product per tensor saves the gather pass (about 6 % of the step)."""
    return device.type != "cpu"


def _update(run: Run, scale: float) -> None:
    """x <- (1 - lr*wd) x - (lr*scale) direction, where ``scale * direction`` is phi * u.

    With ``fused`` (and ``scale > 0``, float32/float64) one call of torch's fused SGD kernel
    without momentum, ``x <- x - lr' (direction + wd' x)``, with ``lr' = lr * scale`` and
    ``wd' = wd / scale``; otherwise a decay and an add."""
    if run.fused and scale > 0.0 and run.direction.dtype in FUSED_UPDATE_DTYPES:
        torch._fused_sgd_(run.params, run.direction_views, [], weight_decay=run.weight_decay / scale,
                          momentum=0.0, lr=run.lr * scale, dampening=0.0, nesterov=False, maximize=False,
                          is_first_step=False)
        return
    decay, coef = 1.0 - run.lr * run.weight_decay, -run.lr * scale
    if run.foreach:
        if run.weight_decay != 0.0:
            torch._foreach_mul_(run.params, decay)
        torch._foreach_add_(run.params, run.direction_views, alpha=coef)
        return
    for p, u in zip(run.params, run.direction_views):
        if run.weight_decay != 0.0:
            p.mul_(decay)
        p.add_(u, alpha=coef)


def phi_factors(d: int, tau: float, alpha: float, gamma: float, scale_matched: bool) -> tuple[int, float, float]:
    """``k = floor(tau * d)`` and the factors alpha and gamma of a selection over d entries, both
    divided by the mean factor ``(k alpha + (d - k) gamma) / d`` when ``scale_matched``."""
    k = math.floor(tau * d)
    if scale_matched and d > 0:
        mean = (k * alpha + (d - k) * gamma) / d
        if mean > 0.0:
            alpha, gamma = alpha / mean, gamma / mean
    return k, alpha, gamma


def _modulate(selections: Sequence[tuple[TopKSelector, list[dict]]], runs: Sequence[Run]) -> float:
    """Apply phi (Eq. fedact_modulation) to the direction of every scored run; return the
    ``phi_scale`` left to the update: ``direction <- phi * direction / phi_scale``.

    Each selection's scores first become 1 on the top k of every segment and 0 elsewhere, each
    segment with the settings of its param group. When all segments share alpha and gamma
    (always, unless per-tensor scale matching or groups with their own factors), one operation
    per run finishes: ``direction += ((alpha - gamma) / gamma) * top * direction`` with
    ``phi_scale = gamma`` (``direction *= top`` and ``alpha`` when gamma = 0); otherwise the
    scores become phi segment by segment and multiply the direction (``phi_scale = 1``). With
    ``compile``, one host selection of one segment and no tie at its threshold, the comparison
    and that operation are one compiled pass (:func:`_phi_pass`).
    """
    plans = [(sel, [phi_factors(n, g["tau"], g["alpha"], g["gamma"], g["scale_matched"])
                    for n, g in zip(sel.sizes(), groups)]) for sel, groups in selections]
    host_threshold, fused = None, set()  # fused: runs done by one compiled pass
    if len(plans) == 1 and len(plans[0][1]) == 1 and any(run.compile for run in runs):
        sel, ((k, alpha, gamma),) = plans[0]
        if sel.on_host and 0 < k < sel.scores.numel() and gamma > 0:
            host_threshold = sel.threshold_on_host(k)
            if host_threshold[1] == sel.scores.numel():  # no tie straddles the threshold
                for run in runs:
                    if not (run.compile and _phi_compiled(run, host_threshold[0], (alpha, gamma))):
                        break
                    fused.add(id(run))
                if len(fused) == len(runs):
                    return gamma
    for sel, values in plans:
        sel.indicator_([k for k, _, _ in values], host_threshold)
    for run in runs:  # the device selection used these directions as its scratch (layout.py)
        if run.lends_direction:
            _direction_from_moments(run, *run.moments)
    pairs = {(alpha, gamma) for _, values in plans for _, alpha, gamma in values}
    if len(pairs) == 1:
        ((alpha, gamma),) = pairs
        for run in runs:
            if id(run) in fused:
                continue
            if gamma > 0.0:
                run.direction.addcmul_(run.direction, run.scores, value=(alpha - gamma) / gamma)
            else:
                run.direction.mul_(run.scores)
        return gamma if gamma > 0.0 else alpha
    for sel, values in plans:
        for (start, end), (_, alpha, gamma) in zip(zip(sel.bounds, sel.bounds[1:]), values):
            sel.scores[start:end].mul_(alpha - gamma).add_(gamma)
    for run in runs:
        run.direction.mul_(run.scores)
    return 1.0
