"""FedACTAdamW against a plain reference of the seed's Algorithm 1 (lines 4-18).

The oracle, ``Reference``, is written here from the formulas alone: flattened float64 vectors, one
loop over the parameters, top-k by a stable descending sort. It never calls fedact_app.optim.
"""

import copy
import gc
import math
import subprocess
import sys
import textwrap
import tracemalloc
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fedact_app.optim.kernels as kernels
import fedact_app.optim.topk as topk
from fedact_app.optim import FedACTAdamW

SHAPES = [(6, 5), (7,), (3, 2, 2)]  # d = 49


class Reference:
    """Algorithm 1, lines 4-18, on flattened float64 vectors.

    ``hyper[i]`` holds lr, weight_decay, betas and eps of parameter i (its param group's values).
    """

    def __init__(self, xs, hyper, *, rho=0.5, tau=0.5, alpha=None, gamma=None,
                 trust_scope="global", trust_signal="corrected", scale_matched=False):
        self.x = [x.detach().reshape(-1).double().clone() for x in xs]
        self.hyper = hyper
        self.rho, self.tau = rho, tau
        self.alpha = 1.0 / tau if alpha is None else alpha
        self.gamma = tau if gamma is None else gamma
        self.scope, self.signal, self.scale_matched = trust_scope, trust_signal, scale_matched
        self.begin_round()

    def begin_round(self, v_bar=None, delta_g=None, global_step=0):
        self.m = [torch.zeros_like(x) for x in self.x]
        self.v = [torch.zeros_like(x) if v_bar is None else v_bar[i].reshape(-1).double().clone()
                  for i, x in enumerate(self.x)]
        self.dg = [torch.zeros_like(x) if delta_g is None else delta_g[i].reshape(-1).double().clone()
                   for i, x in enumerate(self.x)]
        self.k, self.t0 = 0, global_step

    def act(self, s):
        """phi for scores s: alpha on the top floor(tau*d) (stable descending sort), gamma elsewhere."""
        n_top = math.floor(self.tau * s.numel())
        order = torch.sort(s, descending=True, stable=True).indices
        phi = torch.full_like(s, self.gamma)
        phi[order[:n_top]] = self.alpha
        if self.scale_matched:
            phi = phi / phi.mean()
        return phi

    def step(self, grads):
        self.k += 1
        t = self.t0 + self.k
        live = [i for i, g in enumerate(grads) if g is not None]
        u, s = {}, {}
        for i in live:
            h = self.hyper[i]
            b1, b2 = h["betas"]
            g = grads[i].reshape(-1).double()
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            m_hat = self.m[i] / (1 - b1 ** self.k)
            v_hat = self.v[i] / (1 - b2 ** t)
            u_loc = m_hat / (torch.sqrt(v_hat) + h["eps"])
            u[i] = (1 - self.rho) * u_loc + self.rho * self.dg[i]
            s[i] = (u_loc if self.signal == "local" else u[i]) * g
        if self.signal == "none":
            phi = {i: torch.ones_like(u[i]) for i in live}
        elif self.scope == "tensor":
            phi = {i: self.act(s[i]) for i in live}
        else:
            flat = self.act(torch.cat([s[i] for i in live]))
            sizes = [s[i].numel() for i in live]
            phi = dict(zip(live, torch.split(flat, sizes)))
        self.u, self.s, self.phi = u, s, phi
        for i in live:
            h = self.hyper[i]
            self.x[i] = (1 - h["lr"] * h["weight_decay"]) * self.x[i] - h["lr"] * phi[i] * u[i]


# ---------------------------------------------------------------------- helpers


def hyper_of(opt_kwargs, n):
    h = dict(lr=opt_kwargs.get("lr", 3e-4), weight_decay=opt_kwargs.get("weight_decay", 0.01),
             betas=opt_kwargs.get("betas", (0.9, 0.999)), eps=opt_kwargs.get("eps", 1e-8))
    return [h] * n


def trust_of(opt_kwargs):
    keys = ("rho", "tau", "alpha", "gamma", "trust_scope", "trust_signal", "scale_matched")
    return {k: opt_kwargs[k] for k in keys if k in opt_kwargs}


def make_params(shapes=SHAPES, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def make_rounds(params, n_rounds=2, steps=3, seed=1, warm=True, global_steps=None, zero_frac=0.0):
    """Per round: (v_bar, delta_g, global_step, [grads per step])."""
    gen = torch.Generator().manual_seed(seed)

    def like(p, f):
        return f(p.shape, generator=gen, dtype=p.dtype)

    rounds = []
    for r in range(n_rounds):
        v_bar = [0.01 * like(p, torch.rand) for p in params] if warm else None
        delta_g = [0.5 * like(p, torch.randn) for p in params] if warm else None
        gs = (global_steps[r] if global_steps is not None else r * steps)
        grads = []
        for _ in range(steps):
            gs_k = []
            for p in params:
                g = like(p, torch.randn)
                if zero_frac:
                    g = g * (like(p, torch.rand) >= zero_frac)
                gs_k.append(g)
            grads.append(gs_k)
        rounds.append((v_bar, delta_g, gs, grads))
    return rounds


def drive(opt, params, ref, rounds):
    for v_bar, delta_g, gs, grads in rounds:
        opt.begin_round(v_bar=v_bar, delta_g=delta_g, global_step=gs)
        if ref is not None:
            ref.begin_round(v_bar=v_bar, delta_g=delta_g, global_step=gs)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = None if g is None else g.clone()
            opt.step()
            if ref is not None:
                ref.step(step_grads)


def set_grads(params, grads):
    """Give each parameter a copy of its gradient, as a backward pass would."""
    for p, g in zip(params, grads):
        p.grad = g.clone()


def assert_matches(params, ref, rtol=1e-12, atol=1e-12):
    for p, x in zip(params, ref.x):
        torch.testing.assert_close(p.detach().reshape(-1).double(), x, rtol=rtol, atol=atol)


def run_against_reference(opt_kwargs, *, dtype=torch.float64, rounds_kwargs=None, shapes=SHAPES,
                          rtol=1e-12, atol=1e-12):
    params = make_params(shapes, dtype)
    ref = Reference(params, hyper_of(opt_kwargs, len(params)), **trust_of(opt_kwargs))
    opt = FedACTAdamW(params, **opt_kwargs)
    rounds = make_rounds(params, **(rounds_kwargs or {}))
    drive(opt, params, ref, rounds)
    assert_matches(params, ref, rtol, atol)
    return opt, params, ref


BASE = dict(lr=1e-2, weight_decay=0.1, rho=0.5, tau=0.5)

# The implementations of m, v, u and the parameter update: a loop over tensors, torch._foreach_*,
# and torch's fused AdamW / SGD kernels (the default for CPU and CUDA parameters).
PATHS = {"loop": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
         "fused": dict(fused=True)}


# ---------------------------------------------------------------------- equivalence with the reference


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
@pytest.mark.parametrize("trust_signal", ["corrected", "local", "none"])
@pytest.mark.parametrize("path", PATHS)
def test_matches_reference(trust_scope, trust_signal, path):
    run_against_reference({**BASE, "trust_scope": trust_scope, "trust_signal": trust_signal,
                           **PATHS[path]}, rounds_kwargs=dict(global_steps=[0, 7]))


def random_settings(rng):
    """One draw of everything the step depends on: hyperparameters (tau with floor(tau d) = 0,
    alpha = gamma and gamma = 0 among them), scope, signal, scale matching, the implementation,
    tensor shapes (sizes of 1 included), rounds with and without the server's arrays, gradients
    with exact zeros or on a coarse grid (ties in the scores), and parameters that never get a
    gradient."""
    kw = dict(lr=rng.choice([1e-3, 1e-2, 0.1]), weight_decay=rng.choice([0.0, 0.01, 0.1]),
              betas=(rng.choice([0.0, 0.5, 0.9]), rng.choice([0.9, 0.99, 0.999])),
              eps=rng.choice([1e-8, 1e-6, 1e-3]), rho=rng.choice([0.0, 0.3, 0.5, 1.0]),
              tau=rng.choice([1.0, 0.999, 0.5, 0.001, rng.uniform(0.01, 1.0)]),
              trust_scope=rng.choice(["global", "tensor"]),
              trust_signal=rng.choice(["corrected", "local", "none"]), scale_matched=rng.random() < 0.3,
              **PATHS[rng.choice(list(PATHS))])
    if rng.random() < 0.5:
        low = rng.uniform(0.1, 2.0) if kw["scale_matched"] else rng.choice([0.0, 1.0, rng.uniform(0.0, 2.0)])
        kw["gamma"], kw["alpha"] = low, max(low, rng.choice([1.0, 2.0, rng.uniform(0.1, 5.0)]))
    shapes = [tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
    steps = dict(n_rounds=rng.randint(1, 3), steps=rng.randint(1, 4), warm=rng.random() < 0.7,
                 zero_frac=rng.choice([0.0, 0.0, 0.3, 0.7, 0.95]))
    steps["global_steps"] = [rng.randint(0, 50) for _ in range(steps["n_rounds"])]
    coarse = rng.random() < 0.3
    without_grad = {i for i in range(1, len(shapes)) if rng.random() < 0.15}
    return kw, shapes, steps, coarse, without_grad


@pytest.mark.parametrize("selector", ["numpy", "radix", "bracket", "bracket-misses"])
def test_random_settings_match_reference(selector, monkeypatch):
    """400 random draws of the settings (:func:`random_settings`), every step against the
    reference: combinations the tests above do not name. Each selection the host or the device
    runs: numpy's, the radix select (numpy hidden), and the host's bracket in chunks on threads,
    also when it misses the threshold."""
    import random

    if selector == "radix":
        monkeypatch.setattr(topk, "np", None)
    elif selector.startswith("bracket"):
        monkeypatch.setattr(topk, "_BRACKET_MIN", 16)
        monkeypatch.setattr(topk, "_HOST_CHUNK", 7)
        monkeypatch.setattr(topk, "_BRACKET_Z", 0.0 if selector == "bracket-misses" else 2.5)
    for draw in range(100):
        rng = random.Random(f"{selector}-{draw}")
        kw, shapes, steps, coarse, without_grad = random_settings(rng)
        params = make_params(shapes, seed=draw)
        ref = Reference(params, hyper_of(kw, len(params)), **trust_of(kw))
        rounds = [(v_bar, delta_g, gs, [[None if i in without_grad else torch.round(g * 2) / 2 if coarse else g
                                         for i, g in enumerate(step_grads)] for step_grads in grads])
                  for v_bar, delta_g, gs, grads in make_rounds(params, seed=draw + 1, **steps)]
        drive(FedACTAdamW(params, **kw), params, ref, rounds)
        try:
            assert_matches(params, ref)
        except AssertionError as err:
            raise AssertionError(f"{selector} draw {draw}: {kw}, shapes {shapes}, {steps}, coarse {coarse}, "
                                 f"without a gradient {sorted(without_grad)}") from err


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
def test_matches_reference_float32(trust_scope):
    run_against_reference({**BASE, "trust_scope": trust_scope}, dtype=torch.float32,
                          rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("trust_signal", ["corrected", "none"])
def test_rho_zero_ignores_delta_g(trust_signal):
    """rho = 0: local-only trust; with signal "none" it is AdamW warm-started from v_bar."""
    opt, params, _ = run_against_reference({**BASE, "rho": 0.0, "trust_signal": trust_signal},
                                           rounds_kwargs=dict(global_steps=[4, 9]))
    assert all("delta_g" not in opt.state[p] for p in params)  # not even allocated


def test_signal_none_is_fedadamw():
    """phi == 1: every coordinate takes the dense corrected AdamW step (FedAdamW)."""
    run_against_reference({**BASE, "trust_signal": "none"})
    # and alpha = gamma = 1 with a real selection takes the same steps
    p1, p2 = make_params(), make_params()
    rounds = make_rounds(p1)
    drive(FedACTAdamW(p1, **BASE, trust_signal="none"), p1, None, rounds)
    drive(FedACTAdamW(p2, **BASE, alpha=1.0, gamma=1.0), p2, None, rounds)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("path", PATHS)
def test_adamw_warm_start_special_case_is_torch_adamw(path):
    """rho = 0, phi = 1, v_bar = 0, t = k: torch.optim.AdamW (an independent oracle), with no
    begin_round at all (a plain optimizer) and two groups with their own lr / weight decay."""
    p1, p2 = make_params(), make_params()

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-2, "weight_decay": 0.0}]

    ours = FedACTAdamW(groups(p1), lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6, rho=0.0,
                       trust_signal="none", **PATHS[path])
    adamw = torch.optim.AdamW(groups(p2), lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6,
                              foreach=path == "foreach")
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        for a, b in zip(p1, p2):
            a.grad = torch.randn(a.shape, generator=gen, dtype=a.dtype)
            b.grad = a.grad.clone()
        ours.step()
        adamw.step()
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert ours.local_step == 6 and ours.global_step == 6


def test_alpha_equals_gamma_is_rescaled_lr():
    """phi = alpha everywhere: the FedAdamW step with lr * alpha (and wd / alpha, to keep lr * wd)."""
    p1, p2 = make_params(), make_params()
    rounds = make_rounds(p1)
    drive(FedACTAdamW(p1, lr=1e-2, weight_decay=0.1, alpha=2.0, gamma=2.0), p1, None, rounds)
    drive(FedACTAdamW(p2, lr=2e-2, weight_decay=0.05, trust_signal="none"), p2, None, rounds)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_rounds_reset_m_copy_v_and_use_k_and_t():
    """begin_round: m <- 0, v <- copy of v_bar, k <- 0; bias correction 1-b1^k and 1-b2^t."""
    params = make_params()
    kw = {**BASE, "betas": (0.5, 0.6)}  # small betas: a wrong k or t changes the result a lot
    ref = Reference(params, hyper_of(kw, len(params)), **trust_of(kw))
    opt = FedACTAdamW(params, **kw)
    rounds = make_rounds(params, n_rounds=3, steps=2, global_steps=[0, 2, 40])
    for v_bar, delta_g, gs, grads in rounds:
        opt.begin_round(v_bar=v_bar, delta_g=delta_g, global_step=gs)
        assert (opt.local_step, opt.global_step) == (0, gs)
        for p, vb, v in zip(params, v_bar, opt.second_moments()):
            assert torch.equal(opt.state[p]["exp_avg"], torch.zeros_like(p))
            assert torch.equal(v, vb) and v is not vb and v.data_ptr() != vb.data_ptr()
        ref.begin_round(v_bar, delta_g, gs)
        for step_grads in grads:
            set_grads(params, step_grads)
            opt.step()
            ref.step(step_grads)
        assert (opt.local_step, opt.global_step) == (2, gs + 2)
        assert_matches(params, ref)
    # a wrong t is visible: the same run with the k used for v (global_step 0 every round) differs
    other = make_params()
    wrong = [(vb, dg, 0, g) for vb, dg, _, g in rounds]
    drive(FedACTAdamW(other, **kw), other, None, wrong)
    assert not torch.allclose(other[0], params[0], rtol=1e-6, atol=1e-6)


def test_second_moments_are_the_live_v_aligned_with_params():
    params = make_params()
    opt = FedACTAdamW([{"params": params[:1]}, {"params": params[1:], "lr": 1e-3}])
    ref = Reference(params, hyper_of({}, len(params)))
    rounds = make_rounds(params, n_rounds=1, steps=2)
    drive(opt, params, ref, rounds)
    vs = opt.second_moments()
    assert len(vs) == len(params)
    for p, v, v_ref in zip(params, vs, ref.v):
        assert v is opt.state[p]["exp_avg_sq"] and v.shape == p.shape and v.dtype == p.dtype
        torch.testing.assert_close(v.reshape(-1), v_ref, rtol=1e-13, atol=0)


# ---------------------------------------------------------------------- the top-k selection


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("selector", ["numpy", "radix"])
def test_ties_select_exactly_floor_tau_d_lowest_index_first(trust_scope, path, selector, monkeypatch):
    """Gradients with 70 % exact zeros: s = 0 there, the threshold falls inside the zeros.
    On CPU the threshold comes from numpy; without numpy (and off CPU) from the radix select."""
    if selector == "radix":
        monkeypatch.setattr(topk, "np", None)
    kw = dict(lr=1e-2, weight_decay=0.0, rho=0.5, tau=0.5, trust_scope=trust_scope, **PATHS[path])
    params = make_params(shapes=[(9, 5), (11,), (4, 3)])  # d = 68, odd per-tensor sizes
    ref = Reference(params, hyper_of(kw, len(params)), **trust_of(kw))
    opt = FedACTAdamW(params, **kw)
    rounds = make_rounds(params, n_rounds=1, steps=3, zero_frac=0.7)
    v_bar, delta_g, gs, grads = rounds[0]
    opt.begin_round(v_bar, delta_g, gs)
    ref.begin_round(v_bar, delta_g, gs)
    for step_grads in grads:
        x0 = [p.detach().reshape(-1).clone() for p in params]
        set_grads(params, step_grads)
        opt.step()
        ref.step(step_grads)
        assert_matches(params, ref)
        # The phi the optimizer used, read off its own update (wd = 0: x1 = x0 - lr*phi*u) with
        # the reference's u, and checked against the rule directly rather than against a sort.
        phis = [(x0[i] - p.detach().reshape(-1)) / (kw["lr"] * ref.u[i]) for i, p in enumerate(params)]
        scores = [ref.s[i] for i in range(len(params))]
        if trust_scope == "global":
            phis, scores = [torch.cat(phis)], [torch.cat(scores)]
        for phi, s in zip(phis, scores):
            is_alpha = torch.isclose(phi, torch.full_like(phi, 2.0))
            assert torch.isclose(phi[~is_alpha], torch.full_like(phi[~is_alpha], 0.5)).all()
            assert int(is_alpha.sum()) == math.floor(0.5 * s.numel())
            assert is_alpha[s > 0].all() and not is_alpha[s < 0].any()
            tied = is_alpha[s == 0]
            assert 0 < int(tied.sum()) < tied.numel()  # the boundary runs through the zeros
            assert (tied[:-1].int() >= tied[1:].int()).all()  # and the lowest indices won


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
def test_all_scores_equal_take_the_first_indices(trust_scope):
    params = make_params(shapes=[(3, 3), (5,)])
    opt = FedACTAdamW(params, lr=1e-2, weight_decay=0.0, rho=0.0, tau=0.5, trust_scope=trust_scope)
    x0 = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)  # u identical everywhere, so s too
    opt.step()
    step = torch.cat([(a - p.detach()).reshape(-1) for a, p in zip(x0, params)]) / 1e-2
    alpha_steps = torch.isclose(step, torch.full_like(step, 2.0), rtol=1e-6)
    if trust_scope == "global":
        expected = torch.arange(14) < 7
    else:
        expected = torch.cat([torch.arange(9) < 4, torch.arange(5) < 2])
    assert torch.equal(alpha_steps, expected)


def test_k_zero_is_gamma_everywhere_and_tau_one_is_alpha_everywhere():
    small = [(3,), (4,)]  # d = 7; floor(0.1 * 7) = 0
    for kw, lr_factor in [(dict(tau=0.1, gamma=0.5, alpha=3.0), 0.5), (dict(tau=1.0, alpha=3.0, gamma=0.5), 3.0)]:
        for scope in ["global", "tensor"]:
            p1, p2 = make_params(small), make_params(small)
            rounds = make_rounds(p1)
            drive(FedACTAdamW(p1, lr=1e-2, weight_decay=0.1, trust_scope=scope, **kw), p1, None, rounds)
            drive(FedACTAdamW(p2, lr=1e-2 * lr_factor, weight_decay=0.1 / lr_factor, trust_signal="none"),
                  p2, None, rounds)
            for a, b in zip(p1, p2):
                torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    run_against_reference({**BASE, "tau": 0.1}, shapes=small)
    run_against_reference({**BASE, "tau": 1.0}, shapes=small)


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
def test_scale_matched(trust_scope):
    run_against_reference({**BASE, "scale_matched": True, "trust_scope": trust_scope, "tau": 0.3})


# ---------------------------------------------------------------------- groups, missing grads, paths


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
@pytest.mark.parametrize("trust_signal", ["corrected", "local"])
@pytest.mark.parametrize("path", PATHS)
def test_param_groups_with_their_own_lr_weight_decay_betas_eps(trust_scope, trust_signal, path):
    """Different betas give different bias corrections per group: s must still be comparable."""
    params = make_params()
    specs = [dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8),
             dict(lr=3e-2, weight_decay=0.0, betas=(0.5, 0.9), eps=1e-3)]
    opt = FedACTAdamW([{"params": params[:2], **specs[0]}, {"params": params[2:], **specs[1]}],
                      lr=1.0, trust_scope=trust_scope, trust_signal=trust_signal, **PATHS[path])
    ref = Reference(params, [specs[0], specs[0], specs[1]], trust_scope=trust_scope,
                    trust_signal=trust_signal)
    drive(opt, params, ref, make_rounds(params, global_steps=[0, 5]))
    assert_matches(params, ref)


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
@pytest.mark.parametrize("path", PATHS)
def test_param_without_grad_is_skipped_and_not_counted(trust_scope, path):
    kw = {**BASE, "trust_scope": trust_scope, **PATHS[path]}
    params = make_params()
    ref = Reference(params, hyper_of(kw, len(params)), **trust_of(kw))
    opt = FedACTAdamW(params, **kw)
    rounds = make_rounds(params)
    for _, _, _, grads in rounds:
        grads[0][1] = None  # param 1 has no grad at the first step of each round
        grads[2][0] = None
    x1 = params[1].detach().clone()
    v_bar, delta_g, gs, grads = rounds[0]
    opt.begin_round(v_bar, delta_g, gs)
    ref.begin_round(v_bar, delta_g, gs)
    for p, g in zip(params, grads[0]):
        p.grad = None if g is None else g.clone()
    opt.step()
    ref.step(grads[0])
    assert torch.equal(params[1].detach(), x1)  # not even weight decay
    assert_matches(params, ref)
    drive(opt, params, ref, rounds[1:])
    assert_matches(params, ref)


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
@pytest.mark.parametrize("trust_signal", ["corrected", "local", "none"])
def test_foreach_and_single_tensor_paths_agree(trust_scope, trust_signal):
    results = []
    for foreach in (False, True):
        params = make_params(dtype=torch.float32)
        opt = FedACTAdamW(params, **BASE, trust_scope=trust_scope, trust_signal=trust_signal,
                          foreach=foreach, fused=False)
        drive(opt, params, None, make_rounds(params, zero_frac=0.3))
        results.append((params, opt.second_moments()))
    for a, b in zip(*[p + v for p, v in results]):
        assert torch.equal(a, b)  # the same elementary ops in the same order


def count_fused_kernel_calls(monkeypatch):
    """Counts of torch's fused AdamW and SGD kernel calls, through wrappers that call the real ones."""
    calls = {"_fused_adamw_": 0, "_fused_sgd_": 0}
    for name in calls:
        def counting(*args, _real=getattr(torch, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(torch, name, counting)
    return calls


def test_fused_kernels_are_the_default_for_cpu_parameters(monkeypatch):
    """fused=None runs torch's fused AdamW and SGD kernels on CPU, once per run of parameters and
    step; fused=False never does."""
    calls = count_fused_kernel_calls(monkeypatch)
    for fused, expected in ((None, 6), (False, 0)):
        calls.update(dict.fromkeys(calls, 0))
        run_against_reference({**BASE, "fused": fused})  # 2 rounds x 3 steps, one run
        assert calls == {"_fused_adamw_": expected, "_fused_sgd_": expected}, fused


@pytest.mark.filterwarnings("ignore:FedACTAdamW\\(fused=True\\)")
@pytest.mark.parametrize("fused", [None, True])
def test_channels_last_and_non_contiguous_tensors_take_the_eager_operations(fused):
    """torch's fused kernels walk every tensor of their lists in its own memory order, so a
    channels_last parameter or a column-major gradient beside the flat (row-major) state would
    mix up coordinates; such a run takes the eager operations and still follows the reference."""
    kw = {**BASE, "fused": fused}
    params = make_params(shapes=[(4, 3, 2, 2), (6, 5), (7,)])
    params[0] = params[0].detach().to(memory_format=torch.channels_last).requires_grad_()
    ref = Reference(params, hyper_of(kw, len(params)), **trust_of(kw))
    # two groups, two runs: the second has contiguous parameters and only a gradient that is not
    opt = FedACTAdamW([{"params": params[:1]}, {"params": params[1:]}], **kw)
    for v_bar, delta_g, gs, grads in make_rounds(params, global_steps=[0, 4]):
        opt.begin_round(v_bar, delta_g, gs)
        ref.begin_round(v_bar, delta_g, gs)
        for g in grads:
            params[0].grad = g[0].contiguous(memory_format=torch.channels_last)
            params[1].grad = g[1].t().contiguous().t()  # the same values, column-major
            params[2].grad = g[2].clone()
            assert not params[1].grad.is_contiguous()
            opt.step()
            ref.step(g)
    assert_matches(params, ref)
    assert params[0].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.filterwarnings("ignore:FedACTAdamW\\(fused=True\\)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", PATHS)
def test_half_precision_parameters_follow_the_reference(dtype, path):
    """bfloat16/float16 parameters and state, tensors longer than the kernels' vector width
    (torch 2.13's CPU fused SGD kernel leaves half-precision parameters unchanged outside each
    tensor's tail, pytorch/pytorch#191763, so their update stays eager). FedAdamW: no top-k
    whose threshold a rounding could cross; the tolerance is the dtype's rounding over 6 steps,
    far below the 6 * lr = 0.6 a missing update would leave."""
    tol = dict(rtol=0.03, atol=0.05) if dtype == torch.bfloat16 else dict(rtol=0.0, atol=0.01)
    run_against_reference({**BASE, "lr": 0.1, "trust_signal": "none", **PATHS[path]}, dtype=dtype,
                          shapes=[(64, 33), (100,)], **tol)


def test_rho_one_without_delta_g_only_decays():
    """rho = 1 in a round without Delta_G (a first round): u = 0 and x only decays. The update's
    scale is then 0, where the fused SGD kernel (weight decay wd / scale) cannot serve."""
    x0 = [p.detach() for p in make_params()]
    _, params, _ = run_against_reference({**BASE, "rho": 1.0}, rounds_kwargs=dict(warm=False, n_rounds=1))
    decay = (1 - BASE["lr"] * BASE["weight_decay"]) ** 3  # three steps
    for p, x in zip(params, x0):
        torch.testing.assert_close(p.detach(), decay * x, rtol=1e-13, atol=1e-13)


def test_state_dict_round_trip_continues_identically():
    params = make_params()
    opt = FedACTAdamW(params, **BASE)
    (v_bar, delta_g, _, grads), = make_rounds(params, n_rounds=1, steps=4)
    opt.begin_round(v_bar, delta_g, global_step=5)

    def run(o, ps, step_grads):
        for sg in step_grads:
            set_grads(ps, sg)
            o.step()

    run(opt, params, grads[:2])
    saved = copy.deepcopy(opt.state_dict())
    clone = [p.detach().clone().requires_grad_() for p in params]
    run(opt, params, grads[2:])

    restored = FedACTAdamW(clone)  # other settings everywhere: all come from the state dict
    restored.load_state_dict(saved)
    assert (restored.local_step, restored.global_step) == (2, 7)
    assert all("delta_g" in restored.state[p] for p in clone)
    run(restored, clone, grads[2:])
    assert (restored.local_step, restored.global_step) == (opt.local_step, opt.global_step) == (4, 9)
    for a, b in zip(params, clone):
        assert torch.equal(a, b)


def test_bfloat16_params_keep_bfloat16_state():
    params = make_params(dtype=torch.bfloat16)
    opt = FedACTAdamW(params, **BASE)
    drive(opt, params, None, make_rounds(params, zero_frac=0.5))
    for p in params:
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
        assert opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.isfinite(p).all()


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs, argument, value", [
    (dict(lr=-1e-3), "lr", "-0.001"),
    (dict(eps=-1.0), "eps", "-1.0"),
    (dict(betas=(1.0, 0.999)), "betas", "1.0"),
    (dict(betas=(0.9, -0.1)), "betas", "-0.1"),
    (dict(weight_decay=-0.1), "weight_decay", "-0.1"),
    (dict(tau=0.0), "tau", "0.0"),
    (dict(tau=1.5), "tau", "1.5"),
    (dict(rho=-0.1), "rho", "-0.1"),
    (dict(rho=1.1), "rho", "1.1"),
    (dict(alpha=0.2, gamma=0.5), "alpha", "0.2"),
    (dict(gamma=-0.5), "gamma", "-0.5"),
    (dict(trust_scope="layer"), "trust_scope", "layer"),
    (dict(trust_signal="cautious"), "trust_signal", "cautious"),
    (dict(fused="yes"), "fused", "'yes'"),
    (dict(cuda_graph=None), "cuda_graph", "None"),
])
def test_constructor_validation(kwargs, argument, value):
    with pytest.raises(ValueError, match=f"Invalid {argument}") as info:
        FedACTAdamW(make_params(), **kwargs)
    assert value in str(info.value) and "expected" in str(info.value)  # the bad value and the range


def test_cuda_graph_survives_a_copy_and_is_ignored_off_cuda(monkeypatch):
    """``cuda_graph`` is kept by a deep copy (``__getstate__``), and a CPU selection, also the
    device engine's (numpy hidden), never captures a graph."""
    monkeypatch.setattr(topk, "np", None)
    params = make_params()
    opt = FedACTAdamW(params, **BASE, cuda_graph=False)
    assert copy.deepcopy(opt).cuda_graph is False and copy.deepcopy(FedACTAdamW(params)).cuda_graph is True
    opt = FedACTAdamW(params, **BASE)
    for _ in range(3):
        set_grads(params, [torch.randn_like(p) for p in params])
        opt.step()
    ((selector, _),) = opt._workspace.selections(opt.param_groups, opt.cuda_graph)
    assert not selector.device_engine.cuda_graph and selector.device_engine._graph is None


def test_constructor_validation_lists_allowed_values():
    with pytest.raises(ValueError, match="global.*tensor"):
        FedACTAdamW(make_params(), trust_scope="layer")
    with pytest.raises(ValueError, match="corrected.*local.*none"):
        FedACTAdamW(make_params(), trust_signal="x")


def test_param_group_validation():
    params = make_params()
    with pytest.raises(ValueError, match="tau"):
        FedACTAdamW([{"params": params[:1]}, {"params": params[1:], "tau": 0.25}])  # global scope
    with pytest.raises(ValueError, match="lr"):
        FedACTAdamW([{"params": params[:1]}, {"params": params[1:], "lr": -1.0}])
    # per-tensor selection may use its own tau per group
    FedACTAdamW([{"params": params[:1]}, {"params": params[1:], "tau": 0.25}], trust_scope="tensor")


def test_begin_round_validation():
    params = make_params()
    opt = FedACTAdamW(params)
    zeros = [torch.zeros_like(p) for p in params]
    with pytest.raises(ValueError, match="v_bar.*2 tensors for 3 parameters"):
        opt.begin_round(v_bar=zeros[:2])
    with pytest.raises(ValueError, match="delta_g.*4 tensors for 3 parameters"):
        opt.begin_round(delta_g=zeros + zeros[:1])
    bad = zeros[:1] + [torch.zeros(8)] + zeros[2:]
    with pytest.raises(ValueError, match=r"v_bar\[1\]: shape \(8,\).*\(7,\)"):
        opt.begin_round(v_bar=bad)
    with pytest.raises(ValueError, match=r"delta_g\[1\]: shape \(8,\).*\(7,\)"):
        opt.begin_round(delta_g=bad)
    with pytest.raises(ValueError, match="global_step"):
        opt.begin_round(global_step=-1)


def test_lr_must_be_a_float_or_a_one_element_tensor():
    """A 2-element lr tensor is refused with the argument's name (not torch's "Boolean value of
    Tensor ... ambiguous"); a one-element tensor takes the steps a float lr takes."""
    with pytest.raises(ValueError, match=r"Invalid lr: a tensor of shape \(2,\); expected a float or a one-element"):
        FedACTAdamW(make_params(), lr=torch.tensor([1e-3, 2e-3]))
    opt = FedACTAdamW(make_params())
    with pytest.raises(ValueError, match="Invalid lr: a tensor of shape"):
        opt.add_param_group({"params": make_params(shapes=[(2,)]), "lr": torch.ones(3)})
    results = []
    for lr in (1e-2, torch.tensor(1e-2, dtype=torch.float64)):
        params = make_params()
        drive(FedACTAdamW(params, **{**BASE, "lr": lr}), params, None, make_rounds(params))
        results.append(params)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


def test_add_param_group_takes_a_dict_only():
    opt = FedACTAdamW(make_params())
    with pytest.raises(TypeError, match="Invalid param_group: expected a dict.*got list"):
        opt.add_param_group(make_params(shapes=[(2,)]))


def test_assigned_state_tensors_are_honoured_at_the_next_step():
    """opt.state[p][key] = t (torch's convention) replaces m, v or Delta_G of p: the next step
    copies t into the flat buffers (the entry becomes a live view again); removing delta_g drops
    the correction of p. A tensor of another shape is refused by name."""
    params = make_params()
    ref = Reference(params, hyper_of(BASE, len(params)), **trust_of(BASE))
    opt = FedACTAdamW(params, **BASE)
    ((v_bar, delta_g, gs, grads),) = make_rounds(params, n_rounds=1, steps=4)
    opt.begin_round(v_bar, delta_g, gs)
    ref.begin_round(v_bar, delta_g, gs)

    def steps(step_grads):
        for sg in step_grads:
            set_grads(params, sg)
            opt.step()
            ref.step(sg)

    steps(grads[:2])
    new_v, new_dg = torch.full_like(params[1], 0.25), torch.randn_like(params[2])
    opt.state[params[0]]["exp_avg"] = torch.zeros_like(params[0])
    opt.state[params[1]]["exp_avg_sq"] = new_v
    opt.state[params[2]]["delta_g"] = new_dg
    del opt.state[params[1]]["delta_g"]
    ref.m[0] = torch.zeros_like(ref.m[0])
    ref.v[1] = torch.full_like(ref.v[1], 0.25)
    ref.dg[2] = new_dg.reshape(-1).clone()
    ref.dg[1] = torch.zeros_like(ref.dg[1])
    steps(grads[2:])
    assert_matches(params, ref)
    assert opt.state[params[1]]["exp_avg_sq"] is not new_v and torch.equal(new_v, torch.full_like(new_v, 0.25))
    assert all(v is opt.state[p]["exp_avg_sq"] for v, p in zip(opt.second_moments(), params))
    opt.state[params[0]]["exp_avg"] = torch.zeros(3, dtype=params[0].dtype)
    with pytest.raises(ValueError, match=r"Invalid state\[p\]\['exp_avg'\]: shape \(3,\).*\(6, 5\)"):
        opt.step()


def test_state_dict_of_an_older_version_without_the_flags_loads_and_steps():
    """A state dict saved before the foreach / fused / compile keys existed: the flags take their
    defaults (torch's own optimizers do the same in __setstate__) and the steps go on unchanged."""
    params = make_params()
    opt = FedACTAdamW(params, **BASE)
    ((v_bar, delta_g, gs, grads),) = make_rounds(params, n_rounds=1, steps=3)
    opt.begin_round(v_bar, delta_g, gs)
    set_grads(params, grads[0])
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        for key in ("foreach", "fused", "compile"):
            del group[key]
    clone = [p.detach().clone().requires_grad_() for p in params]
    restored = FedACTAdamW(clone, **BASE, foreach=False, fused=False)
    restored.load_state_dict(saved)
    assert [restored.param_groups[0][k] for k in ("foreach", "fused", "compile")] == [None, None, False]
    for sg in grads[1:]:
        for ps, o in ((params, opt), (clone, restored)):
            set_grads(ps, sg)
            o.step()
    for a, b in zip(params, clone):
        assert torch.equal(a, b)


def test_step_count_is_the_optimizers_not_each_parameters():
    """k and t count step() calls (the seed's local step), as the class docstring says: a
    parameter without a gradient at the first step takes k = 2 at the second, where
    torch.optim.AdamW uses that parameter's own count, 1. The parameters that had a gradient at
    every step match AdamW; the frozen one matches the reference loop, not AdamW."""
    kw = dict(lr=4e-3, weight_decay=0.0, rho=0.0, trust_signal="none")
    p1, p2 = make_params(), make_params()
    ref = Reference(p1, hyper_of(kw, len(p1)), **trust_of(kw))
    ours = FedACTAdamW(p1, **kw)
    adamw = torch.optim.AdamW(p2, lr=4e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(4)
    for step in range(2):
        grads = [None if (step == 0 and i == 1) else torch.randn(p.shape, generator=gen, dtype=p.dtype)
                 for i, p in enumerate(p1)]
        for a, b, g in zip(p1, p2, grads):
            a.grad = None if g is None else g.clone()
            b.grad = None if g is None else g.clone()
        ours.step()
        adamw.step()
        ref.step(grads)
    assert_matches(p1, ref)
    for i in (0, 2):
        torch.testing.assert_close(p1[i], p2[i], rtol=1e-13, atol=1e-13)
    assert (p1[1] - p2[1]).abs().max() > 5e-4  # about lr / 4: AdamW's first step is lr * sign(g)


def test_torch_compile_of_step_runs_the_step_eagerly():
    """torch.compile(opt.step) on the default (fused, CPU) path after begin_round: the step is
    left to eager mode (a graph break), so it runs and takes the eager optimizer's steps exactly."""
    p1, p2 = make_params(dtype=torch.float32), make_params(dtype=torch.float32)
    o1, o2 = FedACTAdamW(p1, **BASE), FedACTAdamW(p2, **BASE)
    ((v_bar, delta_g, gs, grads),) = make_rounds(p1, n_rounds=1, steps=3, global_steps=[4])
    o1.begin_round(v_bar, delta_g, gs)
    o2.begin_round(v_bar, delta_g, gs)
    compiled = torch.compile(o1.step)
    for sg in grads:
        for a, b, g in zip(p1, p2, sg):
            a.grad, b.grad = g.clone(), g.clone()
        compiled()
        o2.step()
    assert o1.local_step == o2.local_step == 3
    for a, b in zip(p1, p2):
        assert torch.equal(a, b)


def test_fused_true_where_the_kernels_cannot_run_warns_once_per_reason():
    """fused=True asks for torch's fused kernels; a channels_last weight (or a bfloat16 update)
    cannot take them: the step runs the eager operations and says so once, not silently.
    fused=None (the default: on where they can run) stays quiet."""
    def make():
        ps = make_params(shapes=[(4, 3, 2, 2), (7,)], dtype=torch.float32)
        ps[0] = ps[0].detach().to(memory_format=torch.channels_last).requires_grad_()
        return ps

    params = make()
    opt = FedACTAdamW(params, **BASE, fused=True)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.warns(RuntimeWarning, match=r"fused=True.*non-contiguous parameter or gradient") as record:
        opt.step()
    assert len(record) == 1 and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once per reason
        params = make()
        quiet = FedACTAdamW(params, **BASE)
        for p in params:
            p.grad = torch.ones_like(p)
        quiet.step()
    params = make_params(shapes=[(40,)], dtype=torch.bfloat16)
    params[0].grad = torch.ones_like(params[0])
    with pytest.warns(RuntimeWarning, match=r"fused=True.*update of torch.bfloat16"):
        FedACTAdamW(params, **BASE, fused=True).step()


def test_a_step_keeps_no_reference_to_the_gradients():
    """After step() the optimizer holds no gradient: zero_grad(set_to_none=True) frees them
    before the next backward allocates new ones, which would otherwise coexist with the old."""
    params = make_params(dtype=torch.float32)
    opt = FedACTAdamW(params, **BASE)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    grads = [weakref.ref(p.grad) for p in params]
    opt.zero_grad(set_to_none=True)
    gc.collect()
    assert all(g() is None for g in grads)


def test_sparse_gradients_raise():
    p = torch.zeros(4, 3, dtype=torch.float64, requires_grad=True)
    p.grad = torch.zeros(4, 3, dtype=torch.float64).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        FedACTAdamW([p]).step()


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
def test_device_selection_matches_reference(trust_scope, monkeypatch):
    """The selection used off CPU (the radix select over the scores' bytes), run here on CPU by
    hiding numpy."""
    monkeypatch.setattr(topk, "np", None)
    run_against_reference({**BASE, "trust_scope": trust_scope, "tau": 0.3},
                          rounds_kwargs=dict(zero_frac=0.2))


@pytest.mark.parametrize("second_dtype", [torch.float64, torch.float32], ids=["lends", "own-scratch"])
def test_device_selection_scratch_is_the_direction_buffer_when_dtypes_agree(second_dtype, monkeypatch):
    """Without numpy (as off CPU) the selection needs an integer scratch of d entries. When every
    scored direction has the scores' dtype it is their flat direction buffer, made once, and u is
    computed again after the selection; with float64 scores and a float32 run, a buffer of its
    own. Both follow the reference."""
    monkeypatch.setattr(topk, "np", None)
    params = make_params(shapes=[(9, 5), (11,)])
    params[1] = params[1].detach().to(second_dtype).requires_grad_()
    ref = Reference(params, hyper_of(BASE, len(params)), **trust_of(BASE))
    opt = FedACTAdamW(params, **BASE)
    scratches = set()
    for v_bar, delta_g, gs, grads in make_rounds(params, global_steps=[0, 7], zero_frac=0.3):
        opt.begin_round(v_bar, delta_g, gs)
        ref.begin_round(v_bar, delta_g, gs)
        for step_grads in grads:
            set_grads(params, step_grads)
            opt.step()
            ref.step(step_grads)
            ((selector, _),) = opt._workspace.selections(opt.param_groups, opt.cuda_graph)
            scratches.add(selector.device_engine.scratch.data_ptr())
    assert_matches(params, ref, rtol=1e-5, atol=1e-6)
    lends = second_dtype == torch.float64
    assert len(scratches) == 1
    assert (scratches == {opt._workspace.runs[0].direction.data_ptr()}) == lends
    assert all(run.lends_direction == lends for run in opt._workspace.runs)


# ---------------------------------------------------------------------- fast paths (docs/PERFORMANCE.md)


def test_the_apps_optimizers_leave_torch_dynamo_unimported_until_something_compiles():
    """Building FedACTAdamW, LocalSGD and FedLADAAdam, a step and zero_grad import no torch._dynamo
    (1.3 s that every deployment round would pay: a new process per message); once it is imported,
    torch's wrapped methods are used again. A fresh process: this one has compiled already."""
    code = textwrap.dedent("""
        import sys, torch
        from torch.optim import Optimizer
        from fedact_app.baselines import FedLADAAdam, LocalSGD
        from fedact_app.optim import FedACTAdamW
        from fedact_app.optimizer_base import unless_compiling
        for make in (FedACTAdamW, LocalSGD, FedLADAAdam):
            p = torch.nn.Parameter(torch.randn(8))
            opt = make([p], lr=0.1)
            p.grad = torch.randn(8)
            opt.step()
            opt.zero_grad()
            assert p.grad is None, make
        assert "torch._dynamo" not in sys.modules
        assert unless_compiling(Optimizer.zero_grad) is getattr(Optimizer.zero_grad, "__wrapped__",
                                                                Optimizer.zero_grad)
        import torch._dynamo
        assert unless_compiling(Optimizer.add_param_group) is Optimizer.add_param_group
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert (run.returncode, run.stdout.strip()) == (0, "ok"), run.stderr[-2000:]


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
@pytest.mark.parametrize("bracket_z", [4.0, 0.0], ids=["bracket", "bracket-misses"])
def test_bracketed_selection_matches_reference(trust_scope, bracket_z, monkeypatch):
    """The host selection's bracket (made to run on small tensors here, in chunks on threads), also
    when it misses the threshold and falls back to a full selection; gradients with 50 % zeros."""
    monkeypatch.setattr(topk, "_BRACKET_MIN", 256)
    monkeypatch.setattr(topk, "_HOST_CHUNK", 300)
    monkeypatch.setattr(topk, "_BRACKET_Z", bracket_z)
    run_against_reference({**BASE, "trust_scope": trust_scope}, shapes=[(40, 30), (700,), (9, 11, 3)],
                          rounds_kwargs=dict(zero_frac=0.5, global_steps=[0, 3]))


def test_state_is_packed_into_flat_live_views_across_rounds():
    """m, v, Delta_G are views of flat buffers; a round with, then without, then with Delta_G (the
    layout is rebuilt each time) still follows the reference, and v stays the live state."""
    params = make_params()
    ref = Reference(params, hyper_of(BASE, len(params)), **trust_of(BASE))
    opt = FedACTAdamW(params, **BASE)
    warm, cold = make_rounds(params, n_rounds=2, global_steps=[0, 3]), make_rounds(params, n_rounds=1, warm=False)
    drive(opt, params, ref, [cold[0], warm[1], (None, None, 6, cold[0][3]), warm[0]])
    assert_matches(params, ref)
    v = opt.second_moments()
    assert len({t.untyped_storage().data_ptr() for t in v}) == 1  # one flat buffer
    assert all(t is opt.state[p]["exp_avg_sq"] for t, p in zip(v, params))


def test_float32_and_float64_groups_share_one_global_selection():
    """Runs of different dtypes: the scores are float64 for all, the state keeps each dtype."""
    params = make_params(dtype=torch.float64)
    params[1] = params[1].detach().float().requires_grad_()
    ref = Reference(params, hyper_of(BASE, len(params)), **trust_of(BASE))
    opt = FedACTAdamW(params, **BASE)
    drive(opt, params, ref, make_rounds(params, zero_frac=0.3))
    assert_matches(params, ref, rtol=1e-5, atol=1e-6)
    assert opt.state[params[1]]["exp_avg"].dtype == torch.float32


@pytest.mark.parametrize("trust_signal, zero_frac", [("corrected", 0.0), ("corrected", 0.7), ("local", 0.0),
                                                     ("none", 0.0)])
def test_compiled_passes_match_reference(trust_signal, zero_frac):
    """compile=True: m, v, u and s in one torch.compile-d pass, and the compare with phi in another
    (ties: the eager tie-break), float32, against the reference."""
    run_against_reference({**BASE, "trust_signal": trust_signal, "compile": True}, dtype=torch.float32,
                          rounds_kwargs=dict(global_steps=[0, 7], zero_frac=zero_frac), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
@pytest.mark.parametrize("trust_signal, zero_frac", [("corrected", 0.7), ("local", 0.0)])
def test_compiled_step_with_the_counting_selection_matches_reference(trust_scope, trust_signal, zero_frac,
                                                                    monkeypatch):
    """compile=True off the host (here numpy hidden, as on CUDA): the compiled passes and the
    compiled counting selection (ties at the threshold with 70 % zero gradients), float32,
    against the reference; the direction is nobody's scratch, so it is not computed again."""
    monkeypatch.setattr(topk, "np", None)
    opt, _, _ = run_against_reference({**BASE, "trust_scope": trust_scope, "trust_signal": trust_signal,
                                       "compile": True}, dtype=torch.float32, rtol=1e-5, atol=1e-6,
                                      rounds_kwargs=dict(global_steps=[0, 7], zero_frac=zero_frac))
    ((selector, _),) = opt._workspace.selections(opt.param_groups, opt.cuda_graph)
    assert type(selector.device_engine) is topk._CountSelect
    assert not any(run.lends_direction for run in opt._workspace.runs)


@pytest.mark.parametrize("engine", ["numpy", "counting"])
def test_compile_failure_falls_back_to_eager_with_one_warning(engine, no_torch_compile, monkeypatch):
    """torch.compile failing: one warning for the process, whatever failed (the compiled passes,
    and with numpy hidden the counting selection too), and the steps of compile=False: bit for
    bit with numpy's selection; with the radix select in its own scratch instead of the
    direction's, u is not computed again after the selection, and the steps follow the
    reference."""
    if engine == "counting":
        monkeypatch.setattr(topk, "np", None)
    results = []
    for compile_ in (True, False):
        params = make_params(dtype=torch.float32)
        rounds = make_rounds(params)
        if compile_:
            ref = Reference(params, hyper_of(BASE, len(params)), **trust_of(BASE))
            with pytest.warns(RuntimeWarning, match="torch.compile failed.*no compiler here") as record:
                drive(FedACTAdamW(params, **BASE, compile=True), params, ref, rounds)
            assert len(record) == 1
            assert_matches(params, ref, rtol=1e-5, atol=1e-6)
        else:
            drive(FedACTAdamW(params, **BASE), params, None, rounds)
        results.append(params)
    if engine == "numpy":
        for a, b in zip(*results):
            assert torch.equal(a, b)


@pytest.mark.parametrize("trust_signal", ["corrected", "local"])
def test_gathered_scores_as_off_cpu_match_reference_and_the_cpu_path(trust_signal, monkeypatch):
    """foreach off CPU gathers g into the flat scores (two kernels); run here on CPU."""
    kw = {**BASE, "trust_signal": trust_signal, "foreach": True}
    results = []
    for gathers in (False, True):
        monkeypatch.setattr(kernels, "_gathers_scores", lambda device: gathers)
        opt, params, _ = run_against_reference(kw, rounds_kwargs=dict(zero_frac=0.3))
        results.append(params)
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- launches and memory on CPU
# CPU counterparts of the GPU targets (docs/PERFORMANCE.md): the ATen operations a step runs (a
# GPU launches about one kernel per operation), a step's peak allocation, the bytes it holds.
# "device" hides numpy, so the selection is the one a GPU runs.

# numpy's bracketed selection (CPU), the radix select (CUDA's default, here with numpy hidden), and
# the compiled counting selection (CUDA with compile=True; numpy hidden, float32)
ENGINES = ["numpy", "device", "counting"]
LARGE_D = (1 << 22) + 1000


def aten_operations(fn):
    """How many ATen operations ``fn()`` runs, nested ones included (torch.profiler)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.name.startswith("aten::") for event in prof.events())


def peak_bytes_allocated(fn):
    """The most bytes ``fn()`` has allocated at once beyond what existed before it: torch's CPU
    allocations from the profiler's memory events, numpy's from tracemalloc (numpy reports its
    buffers there); the two peaks are added, an upper bound. Returns that bound, then the two
    peaks (torch's, numpy's), which a failure names."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tracemalloc.start()
        try:
            fn()
            numpy_peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    nodes, allocations = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == torch._C._profiler._EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields))
    allocations.sort(key=lambda item: item[0])
    if not allocations:
        return numpy_peak, 0, numpy_peak
    before = allocations[0][1].total_allocated - allocations[0][1].alloc_size
    torch_peak = max(0, max(f.total_allocated for _, f in allocations) - before)
    return torch_peak + numpy_peak, torch_peak, numpy_peak


def large_optimizer(engine, trust_scope, monkeypatch, zero_frac=0.0):
    """FedACTAdamW (float32, tau = 0.3) on d = 2^22 + 1000 in two tensors, in a round with v_bar
    and Delta_G, and a function that sets fresh gradients (a fraction ``zero_frac`` exactly 0)."""
    if engine != "numpy":
        monkeypatch.setattr(topk, "np", None)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(2048, 2048, generator=gen).requires_grad_(), torch.randn(1000, generator=gen).requires_grad_()]
    opt = FedACTAdamW(params, **{**BASE, "tau": 0.3, "trust_scope": trust_scope, "compile": engine == "counting"})
    opt.begin_round(v_bar=[torch.rand(p.shape, generator=gen) for p in params],
                    delta_g=[torch.randn(p.shape, generator=gen) for p in params], global_step=5)

    def new_gradients():
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * (torch.rand(p.shape, generator=gen) >= zero_frac)

    return opt, params, new_gradients


@pytest.mark.parametrize("engine", ["numpy", "device"])
def test_tensor_scope_runs_at_most_one_and_a_half_times_the_operations_of_the_global_scope(engine, monkeypatch):
    """On 64 tensors a tensor-scope step runs at most 1.5x the ATen operations of a global-scope
    step, so its GPU launches do not grow with the number of tensors (a selection per tensor
    ran 4.3x on the numpy engine, 11.6x on the device engine). The counting engine's kernels are
    compiled, not ATen operations: its passes do not depend on the segments by construction."""
    if engine == "device":
        monkeypatch.setattr(topk, "np", None)
    counts = {}
    for trust_scope in ("global", "tensor"):
        params = make_params(shapes=[(17, 9)] * 64, dtype=torch.float32)
        opt = FedACTAdamW(params, **{**BASE, "trust_scope": trust_scope})
        ((v_bar, delta_g, gs, grads),) = make_rounds(params, n_rounds=1, steps=2)
        opt.begin_round(v_bar, delta_g, gs)
        for step_grads in grads:
            set_grads(params, step_grads)
            counts[trust_scope] = aten_operations(opt.step)  # the second step: layout made
    assert counts["tensor"] <= 1.5 * counts["global"], counts


@pytest.mark.parametrize("engine, trust_scope, zero_frac", [
    ("numpy", "global", 0.0), ("numpy", "tensor", 0.0), ("numpy", "global", 0.7),
    ("device", "global", 0.0), ("device", "tensor", 0.0),
    ("counting", "global", 0.7), ("counting", "tensor", 0.0)])
def test_a_step_after_the_first_allocates_less_than_half_d_bytes(engine, trust_scope, zero_frac, monkeypatch):
    """After the first step (layout, state, scratch) a step allocates less than d/2 bytes at its
    peak, numpy's selection included: no d-sized temporary, not even a bool one; the counting
    engine less than d/8. With 70 % zero gradients the threshold sits in a tie of millions of
    zeros, which the numpy engine counts instead of extracting."""
    opt, params, new_gradients = large_optimizer(engine, trust_scope, monkeypatch, zero_frac)
    bound = LARGE_D // 8 if engine == "counting" else LARGE_D // 2  # the counting passes' sums: 0.03 d
    for step in range(3):
        new_gradients()
        peak, torch_peak, numpy_peak = peak_bytes_allocated(opt.step)
        if step > 0:
            assert peak < bound, (step, f"torch {torch_peak}", f"numpy {numpy_peak}")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
def test_state_and_scratch_hold_at_most_20_bytes_a_float32_coordinate(engine, trust_scope, monkeypatch):
    """m, v, Delta_G, the direction and the scores (layout.py): 20 bytes a coordinate beyond the
    parameters and gradients, counted over every tensor and numpy array reachable from the
    optimizer (scripts/bench_optimizer.py's ``held_bytes``); what is not d-sized (the radix
    select's counters, 1 MiB here, its lane indices and per-segment tensors, the numpy engine's
    sample) stays under 1 MiB + 64 KiB."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from bench_optimizer import held_bytes

    opt, params, new_gradients = large_optimizer(engine, trust_scope, monkeypatch)
    for _ in range(2):
        new_gradients()
        opt.step()
    held = held_bytes(opt, params + [p.grad for p in params])
    assert 20 * LARGE_D <= held <= 20 * LARGE_D + (1 << 20) + (1 << 16), held / LARGE_D


# ---------------------------------------------------------------------- on a GPU (skipped without CUDA)
# Not run by CI (no GPU there). On a GPU machine: python3 -m pytest -q tests/test_optim.py -k cuda

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
@pytest.mark.parametrize("path", ["fused", "unfused", "compiled_steps"])
def test_cuda_steps_follow_the_reference_and_never_wait_for_the_device(trust_scope, path):
    """The CUDA path against the float64 reference loop on the CPU, with 30 % zero gradients (ties
    at the threshold): the radix select and its tie-break on the device with torch's fused
    kernels (the default) or the eager operations (fused=False), and with compile=True
    (float32, the compiled passes' tolerance) the compiled passes and the counting selection,
    captured as a CUDA graph at the second step. Every step runs under
    torch.cuda.set_sync_debug_mode("error"), which raises at a host sync; with compile=True
    every step after the first, which compiles (and may time kernels)."""
    compiled = path == "compiled_steps"
    kw = {**BASE, "trust_scope": trust_scope, "fused": False if path == "unfused" else None, "compile": compiled}
    params = make_params(dtype=torch.float32 if compiled else torch.float64)
    ref = Reference(params, hyper_of(kw, len(params)), **trust_of(kw))
    on_gpu = [p.detach().cuda().requires_grad_() for p in params]
    opt = FedACTAdamW(on_gpu, **kw)
    first = True
    for v_bar, delta_g, gs, grads in make_rounds(params, global_steps=[0, 7], zero_frac=0.3):
        opt.begin_round(v_bar=[t.cuda() for t in v_bar], delta_g=[t.cuda() for t in delta_g], global_step=gs)
        ref.begin_round(v_bar=v_bar, delta_g=delta_g, global_step=gs)
        for step_grads in grads:
            for p, g in zip(on_gpu, step_grads):
                p.grad = g.cuda()
            torch.cuda.set_sync_debug_mode("default" if compiled and first else "error")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            first = False
            ref.step(step_grads)
    if compiled:
        ((selector, _),) = opt._workspace.selections(opt.param_groups, opt.cuda_graph)
        assert type(selector.device_engine) is topk._CountSelect and selector.device_engine._graph is not None
        assert_matches([p.cpu() for p in on_gpu], ref, rtol=1e-5, atol=1e-6)
    else:
        assert_matches([p.cpu() for p in on_gpu], ref)


@needs_cuda
@pytest.mark.parametrize("trust_scope", ["global", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_graph_replays_the_selection_bit_for_bit(trust_scope, dtype):
    """The selection replayed as a CUDA graph (the default) against the same operations launched
    one by one (cuda_graph=False), on the same steps: parameters equal bit for bit after every
    step. The graph is captured at the first layout's second step, kept into the next round
    (the same settings: the same graph object), and captured anew at the second step after new
    trust settings (tau: a new selection) and after a new layout (a parameter without a
    gradient)."""
    kw = {**BASE, "trust_scope": trust_scope}
    params = make_params(dtype=dtype)
    twins = [[p.detach().cuda().requires_grad_() for p in params] for _ in range(2)]
    graphed, launched = FedACTAdamW(twins[0], **kw), FedACTAdamW(twins[1], **kw, cuda_graph=False)
    rounds = make_rounds(params, n_rounds=4, steps=4, global_steps=[0, 7, 15, 22], zero_frac=0.3)
    last_graph = None
    for r, (v_bar, delta_g, gs, grads) in enumerate(rounds):
        for opt in (graphed, launched):
            if r == 2:
                for group in opt.param_groups:
                    group["tau"] = 0.25
            opt.begin_round(v_bar=[t.cuda() for t in v_bar], delta_g=[t.cuda() for t in delta_g], global_step=gs)
        for k, step_grads in enumerate(grads):
            for opt, on_gpu in ((graphed, twins[0]), (launched, twins[1])):
                for i, (p, g) in enumerate(zip(on_gpu, step_grads)):
                    p.grad = None if (r == 3 and i == 0) else g.cuda()
                opt.step()
            for a, b in zip(*twins):
                assert torch.equal(a, b), (r, k)
            radix = [sel.device_engine for opt in (graphed, launched)
                     for sel, _ in opt._workspace.selections(opt.param_groups, opt.cuda_graph)]
            assert (radix[0]._graph is not None) == (k > 0 or r == 1) and radix[1]._graph is None, (r, k)
            if r == 1 and k == 0:
                assert radix[0]._graph is last_graph
            last_graph = radix[0]._graph


@needs_cuda
def test_cuda_fused_kernels_are_the_default(monkeypatch):
    """fused=None runs torch's fused AdamW and SGD kernels for CUDA parameters too (the faster
    setting there, docs/PERFORMANCE.md); fused=False does not."""
    calls = count_fused_kernel_calls(monkeypatch)
    for fused, expected in ((None, 1), (False, 0)):
        calls.update(dict.fromkeys(calls, 0))
        params = [p.detach().cuda().requires_grad_() for p in make_params(dtype=torch.float32)]
        for p in params:
            p.grad = torch.randn_like(p)
        FedACTAdamW(params, **BASE, fused=fused).step()
        assert calls == {"_fused_adamw_": expected, "_fused_sgd_": expected}, fused


@needs_cuda
@pytest.mark.parametrize("compile_", [False, True], ids=["radix", "compiled-counting"])
def test_cuda_step_allocates_nothing_d_sized_after_the_first(compile_):
    """After the first step (state and scratch), a step allocates less than d/2 bytes at its
    peak (d = 2^22 + 1000): no d-sized temporary, not even a bool one; with compile=True too
    (the counting selection's sums in a pass: about 0.03 bytes a score)."""
    params = [torch.randn(2048, 2048, device="cuda", requires_grad=True),
              torch.randn(1000, device="cuda", requires_grad=True)]
    opt = FedACTAdamW(params, **{**BASE, "tau": 0.3, "compile": compile_})
    opt.begin_round(v_bar=[torch.rand_like(p) for p in params], delta_g=[torch.randn_like(p) for p in params],
                    global_step=5)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        if step > 0:
            assert torch.cuda.max_memory_allocated() - before < ((1 << 22) + 1000) // 2, step
