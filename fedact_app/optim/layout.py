"""The flat memory layout of :class:`FedACTAdamW`'s state and scratch.

The state of the parameters that take a step is packed, at the first step and whenever that set or
one of the state tensors changes, into one flat buffer per :class:`Run` (consecutive parameters of
one param group sharing device, dtype and state keys); ``state[p]["exp_avg"]`` and the others are
views of those buffers (shaped like ``p``, row-major). A state tensor assigned by the caller
(``opt.state[p]["exp_avg"] = t``) is copied into the buffers at the next step and its entry
becomes a view again. Scratch, rebuilt with the packing and never saved: u (parameter dtype), one
flat float32 (float64 when a parameter is float64) buffer per device for the scores s, and one
bool and one selector buffer (bool on CPU, int32 on the device path): ``10 d`` bytes beyond the
state for float32 parameters on CPU, ``13 d`` on a GPU, plus there the output of ``torch.topk``
of the smaller side (``12 min(k, d-k+1)`` bytes for float32 scores: about ``6 d`` at tau = 0.5),
all allocated once. The equations allocate nothing per step; the CPU selection copies what
``np.partition`` selects from (about 1 % of d, or a whole selection below 2**21 scores).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from fedact_app.optim.topk import TopKSelector, _select_on_host

# Settings of the trust modulation that one global top-k selection needs to agree on.
TRUST_KEYS = ("rho", "tau", "alpha", "gamma", "trust_scope", "trust_signal", "scale_matched")

_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# torch 2.13's CPU fused SGD kernel does not store bfloat16/float16 parameters from its vectorized
# loop (only the tail of each tensor moves; pytorch/pytorch#191763): those updates stay eager.
FUSED_UPDATE_DTYPES = (torch.float32, torch.float64)


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
    for p in params:
        if state[p][key].shape != p.shape:
            raise ValueError(f"Invalid state[p][{key!r}]: shape {tuple(state[p][key].shape)} does not "
                             f"match its parameter's {tuple(p.shape)}")
    flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    views = _views(flat, params)
    for p, view in zip(params, views):
        view.copy_(state[p][key])
        state[p][key] = view
    return flat, views


class Run:
    """Consecutive parameters of one param group with the same device, dtype and state keys.

    Buffers (made once per layout): ``exp_avg``, ``exp_avg_sq`` and ``delta_g_buffer`` are flat
    buffers of the state (the parameters' state tensors are their views); ``direction`` is the
    flat scratch for u (the denominator or Delta_G first, then u / u_scale); ``scores`` is this
    run's slice of its device's score buffer (``None`` for a group without trust signal: s, then
    phi); ``kernel_step`` holds the global step t for torch's fused AdamW kernel.

    Per step, :meth:`prepare` sets ``grads`` and the group's settings (``lr``, ``beta1``, ...,
    ``delta_g``: the flat Delta_G, or ``None`` when the round has none or ``rho == 0``).
    """

    def __init__(self, group: int, params: list[Tensor], scored: bool, state: dict) -> None:
        self.group, self.params, self.scored = group, params, scored
        self.device, self.dtype = params[0].device, params[0].dtype
        self.numel = sum(p.numel() for p in params)
        self.exp_avg, self.exp_avg_views = _pack(params, state, "exp_avg")
        self.exp_avg_sq, self.exp_avg_sq_views = _pack(params, state, "exp_avg_sq")
        self.delta_g_views: Optional[list[Tensor]] = None
        self.delta_g_buffer: Optional[Tensor] = None
        if "delta_g" in state[params[0]]:
            self.delta_g_buffer, self.delta_g_views = _pack(params, state, "delta_g")
        self.direction = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.direction_views = _views(self.direction, params)
        self.kernel_step = torch.zeros((), dtype=torch.float32, device=self.device)
        self.scores: Optional[Tensor] = None
        self.score_views: list[Optional[Tensor]] = [None] * len(params)

    def attach_scores(self, scores: Tensor) -> None:
        self.scores, self.score_views = scores, _views(scores, self.params)

    def holds(self, state: dict) -> bool:
        """Whether every parameter's state is still this run's views (nothing assigned or removed)."""
        dgs = self.delta_g_views or [None] * len(self.params)
        for p, m, v, dg in zip(self.params, self.exp_avg_views, self.exp_avg_sq_views, dgs):
            s = state.get(p)
            if s is None or s.get("exp_avg") is not m or s.get("exp_avg_sq") is not v or s.get("delta_g") is not dg:
                return False
        return True

    def prepare(self, group: dict) -> Optional[str]:
        """Set this step's gradients and ``group``'s settings; return why ``fused=True`` cannot
        run torch's fused kernels here (``None`` when it can, or was not asked for)."""
        self.grads = grads = [p.grad for p in self.params]
        self.lr, self.eps, self.weight_decay = group["lr"], group["eps"], group["weight_decay"]
        self.beta1, self.beta2 = group["betas"]
        self.rho, self.trust_signal = group["rho"], group["trust_signal"]
        self.delta_g = self.delta_g_buffer if self.rho > 0 else None
        self.foreach = True if group["foreach"] is None else group["foreach"]
        self.compile = (group["compile"] and self.dtype in (torch.float32, torch.float64)
                        and (self.scores is None or self.scores.dtype == self.dtype))
        fused = group["fused"]
        on = self.device.type == "cpu" if fused is None else fused and self.device.type in ("cpu", "cuda")
        # The kernels read every tensor of a list in its own memory order, so parameters and
        # gradients must be contiguous like the flat state's views (a channels_last weight is not).
        self.fused = (on and self.dtype in _FUSED_DTYPES and all(p.is_contiguous() for p in self.params)
                      and all(g.is_contiguous() for g in grads))
        if fused is not True:
            return None
        if self.device.type not in ("cpu", "cuda"):
            return f"parameters on {self.device.type} (the kernels run on CPU and CUDA)"
        if self.dtype not in _FUSED_DTYPES:
            return f"{self.dtype} parameters"
        if not self.fused:
            return "a non-contiguous parameter or gradient (e.g. channels_last)"
        if self.dtype not in FUSED_UPDATE_DTYPES:
            return (f"the update of {self.dtype} parameters (torch's CPU fused SGD kernel skips their "
                    f"store, pytorch/pytorch#191763)")
        return None


def _layout(p: Tensor, state: dict) -> tuple:
    return p.device, p.dtype, "delta_g" in state[p]


class Workspace:
    """The flat layout of one set of parameters with gradients, reused while that set and its
    state tensors are unchanged.

    ``runs`` tile the parameters in param_groups order. Per device, the scored runs share
    ``buffers[device]``: one flat score buffer (float64 if one of them is float64, else float32),
    one bool mask and one selector scratch (bool when numpy finds the threshold, int32 on the
    device path). ``trust_scope="global"`` needs all of them on one device.
    """

    def __init__(self, groups: list[dict], present: list[list[Tensor]], state: dict) -> None:
        self.key = self._key(groups, present)
        self.runs: list[Run] = []
        for index, (group, params) in enumerate(zip(groups, present)):
            start = 0
            for i in range(1, len(params) + 1):
                if i == len(params) or _layout(params[i], state) != _layout(params[start], state):
                    self.runs.append(Run(index, params[start:i], group["trust_signal"] != "none", state))
                    start = i
        by_device: dict[torch.device, list[Run]] = {}
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
        self._selections: tuple[tuple, list[tuple[TopKSelector, dict]]] = ((), [])

    @staticmethod
    def _key(groups: list[dict], present: list[list[Tensor]]) -> tuple:
        return tuple((g["trust_signal"] != "none", tuple((id(p), p.shape, p.dtype, p.device) for p in ps))
                     for g, ps in zip(groups, present))

    def matches(self, groups: list[dict], present: list[list[Tensor]], state: dict) -> bool:
        """Whether this layout serves the step: the same parameters with gradients, and every
        state tensor still one of its views."""
        return self.key == self._key(groups, present) and all(run.holds(state) for run in self.runs)

    def selections(self, groups: list[dict]) -> list[tuple[TopKSelector, dict]]:
        """The top-k selections of this step, each with the param group whose settings (tau,
        alpha, gamma, scale_matched) it takes; kept while the trust settings stay the same."""
        settings = tuple(tuple(g[key] for key in TRUST_KEYS) for g in groups)
        if settings != self._selections[0]:
            self._selections = (settings, self._build_selections(groups))
        return self._selections[1]

    def _build_selections(self, groups: list[dict]) -> list[tuple[TopKSelector, dict]]:
        if not self.buffers:
            return []
        if groups[0]["trust_scope"] == "global":
            if len(self.buffers) > 1:
                raise RuntimeError("trust_scope='global' ranks all coordinates together and needs every "
                                   "parameter with a gradient on one device; use trust_scope='tensor'")
            return [(TopKSelector(*next(iter(self.buffers.values()))), groups[0])]
        selections, offsets = [], dict.fromkeys(self.buffers, 0)
        for run in self.runs:
            if not run.scored:
                continue
            for p in run.params:
                start, n = offsets[run.device], p.numel()
                selections.append((TopKSelector(*(b[start:start + n] for b in self.buffers[run.device])),
                                   groups[run.group]))
                offsets[run.device] = start + n
        return selections

