"""The flat memory layout of :class:`FedACTAdamW`'s state and scratch.

The state of the parameters that take a step is packed, at the first step and whenever that set or
one of the state tensors changes, into one flat buffer per :class:`Run` (consecutive parameters of
one param group sharing device, dtype and state keys); ``state[p]["exp_avg"]`` and the others are
views of those buffers (shaped like ``p``, row-major). A state tensor assigned by the caller
(``opt.state[p]["exp_avg"] = t``) is copied into the buffers at the next step and its entry
becomes a view again.

What the optimizer holds beyond the parameters and gradients, in bytes per coordinate for
float32 parameters (20 d in all, CPU and GPU alike), and why each must exist:

- m (``exp_avg``, 4): the first moment, state carried from step to step (Alg. 1, line 8);
- v (``exp_avg_sq``, 4): the second moment, state, and what the client sends back as v_i;
- Delta_G (``delta_g``, 4, only while the round has one and rho > 0): the server's correction,
  read at every step of the round;
- the direction (4): u, which the update needs after the selection, and which the score pass
  needs before it (s = u * g);
- the scores (4, float32; float64 when a parameter is float64): s, because the exact top-k reads
  all of them before any coordinate's phi is known; the selection then turns them into phi's
  indicator in place.

Nothing else is d-sized. The host selection (CPU, numpy) works in chunks, with two bool chunks
per thread. The device selection (CUDA, or CPU without numpy) needs an integer scratch of d
entries for its histogram codes: it uses the flat direction buffer of the device's scored runs,
whose u is computed again from m, v and Delta_G after the selection (three passes; kernels.py),
or, when those runs' dtypes differ from the scores', a buffer of its own (4 d more), and its
histogram counters (at most 2^18 integers, or 768 a segment for more than 341 segments;
topk._lanes). With ``compile=True`` the device selection of float32 scores counts instead
(topk._CountSelect): no scratch, so the direction is lent to nobody and not computed again; its
tables take 0.06 bytes a score, and a pass 0.03 more. All of it is allocated once per layout,
and a step after the first allocates nothing d-sized.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from fedact_app.optim.topk import TopKSelector, _select_on_host, counts_compiled

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
    flat scratch for u (the denominator or Delta_G first, then u / u_scale), a slice of one buffer
    per device when the device selection borrows it (``lends_direction``); ``scores`` is this
    run's slice of its device's score buffer (``None`` for a group without trust signal: s, then
    phi); ``kernel_step`` holds the global step t for torch's fused AdamW kernel.

    Per step, :meth:`prepare` sets ``grads`` (dropped when the step ends) and the group's
    settings (``lr``, ``beta1``, ..., ``delta_g``: the flat Delta_G, or ``None`` when the round
    has none or ``rho == 0``).
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
        self.direction = self.direction_views = None  # attach_direction: Workspace decides where
        self.lends_direction = False
        self.kernel_step = torch.zeros((), dtype=torch.float32, device=self.device)
        self.scores: Optional[Tensor] = None
        self.score_views: list[Optional[Tensor]] = [None] * len(params)
        self.compiled: dict[str, Callable] = {}  # compile=True: its passes, compiled for this layout (kernels.py)

    def attach_scores(self, scores: Tensor) -> None:
        self.scores, self.score_views = scores, _views(scores, self.params)

    def attach_direction(self, direction: Optional[Tensor] = None, lends: bool = False) -> None:
        """Use ``direction`` (a new buffer when ``None``) for u; ``lends``: the device selection
        uses its memory as scratch, and u is computed again after it (kernels.py)."""
        if direction is None:
            direction = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self.direction, self.direction_views, self.lends_direction = direction, _views(direction, self.params), lends

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
        on = fused is not False and self.device.type in ("cpu", "cuda")  # None: on for both (PERFORMANCE.md)
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

    ``runs`` tile the parameters in param_groups order. Per device, the scored runs share one
    flat score buffer, ``scores[device]`` (float64 if one of them is float64, else float32), in
    that order. A selection covers one device's buffer: as one segment with
    ``trust_scope="global"`` (which needs all of them on one device), with one segment per
    parameter tensor with ``"tensor"``; either way one :class:`TopKSelector` per device.
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
        self.scored: dict[torch.device, list[Run]] = {}
        for run in self.runs:
            if run.scored:
                self.scored.setdefault(run.device, []).append(run)
        self.scores: dict[torch.device, Tensor] = {}
        self.scratch: dict[torch.device, Tensor] = {}
        self.compiled = all(g["compile"] for g in groups)  # the selections' engine (TopKSelector)
        for device, runs in self.scored.items():
            dtype = torch.float64 if any(r.dtype == torch.float64 for r in runs) else torch.float32
            numel = sum(r.numel for r in runs)
            scores = self.scores[device] = torch.empty(numel, dtype=dtype, device=device)
            # The radix select needs an integer scratch as wide as the scores; when every
            # direction has the scores' dtype, one flat direction buffer serves as that scratch.
            lends = (not _select_on_host(device) and not counts_compiled(device, dtype, numel, self.compiled)
                     and all(r.dtype == dtype for r in runs))
            directions = torch.empty(numel, dtype=dtype, device=device) if lends else None
            if lends:
                self.scratch[device] = directions
            offset = 0
            for run in runs:
                run.attach_scores(scores[offset:offset + run.numel])
                run.attach_direction(directions[offset:offset + run.numel] if lends else None, lends)
                offset += run.numel
        for run in self.runs:
            if run.direction is None:
                run.attach_direction()
        self._selections: tuple[tuple, list[tuple[TopKSelector, list[dict]]]] = ((), [])

    @staticmethod
    def _key(groups: list[dict], present: list[list[Tensor]]) -> tuple:
        return tuple((g["trust_signal"] != "none", g["compile"],
                      tuple((id(p), p.shape, p.dtype, p.device) for p in ps)) for g, ps in zip(groups, present))

    def matches(self, groups: list[dict], present: list[list[Tensor]], state: dict) -> bool:
        """Whether this layout serves the step: the same parameters with gradients, and every
        state tensor still one of its views."""
        return self.key == self._key(groups, present) and all(run.holds(state) for run in self.runs)

    def selections(self, groups: list[dict], cuda_graph: bool) -> list[tuple[TopKSelector, list[dict]]]:
        """The top-k selections of this step, each with the param group of every segment (whose
        tau, alpha, gamma and scale_matched it takes); kept while the trust settings and
        ``cuda_graph`` (:class:`TopKSelector`) stay the same."""
        settings = (tuple(tuple(g[key] for key in TRUST_KEYS) for g in groups), cuda_graph)
        if settings != self._selections[0]:
            self._selections = (settings, self._build_selections(groups, cuda_graph))
        return self._selections[1]

    def _build_selections(self, groups: list[dict], cuda_graph: bool) -> list[tuple[TopKSelector, list[dict]]]:
        if groups and groups[0]["trust_scope"] == "global":
            if len(self.scores) > 1:
                raise RuntimeError("trust_scope='global' ranks all coordinates together and needs every "
                                   "parameter with a gradient on one device; use trust_scope='tensor'")
            return [(TopKSelector(scores, [0, scores.numel()], self.scratch.get(device), cuda_graph, self.compiled),
                     [groups[0]]) for device, scores in self.scores.items()]
        selections = []
        for device, runs in self.scored.items():
            bounds, owners = [0], []
            for run in runs:
                for p in run.params:
                    bounds.append(bounds[-1] + p.numel())
                    owners.append(groups[run.group])
            selections.append((TopKSelector(self.scores[device], bounds, self.scratch.get(device), cuda_graph,
                                            self.compiled), owners))
        return selections
