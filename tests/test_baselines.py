"""Every method's local steps and server rule against the published formulas, written out here.

The oracles are plain Python loops over floats (one coordinate at a time) on a diagonal quadratic
f_i(x) = sum_j a_ij x_j^2 / 2 - b_ij x_j, whose gradient a_i * x - b_i is known in closed form.
The production rules run through the registry (``ALGORITHMS[name]``), the interface the
ClientTrainer and the ServerApp use; the oracles never call fedact_app.
"""

import math

import pytest
import torch

from fedact_app.algorithms import ALGORITHMS, ClientUpdate, RoundInputs
from fedact_app.baselines import FedLADAAdam, LocalSGD
from fedact_app.config import AlgorithmConfig

# Two clients' diagonal quadratics on a 3-coordinate parameter "w".
A = [[1.0, 2.0, 0.5], [0.5, 1.5, 3.0]]
B = [[1.0, -1.0, 0.5], [-2.0, 0.5, 1.0]]
X0 = [0.3, -0.2, 0.8]


def grad(i, x):
    """Gradient of client i's quadratic at x (a list of floats)."""
    return [a * xj - b for a, b, xj in zip(A[i], B[i], x)]


def run_rule(cfg, client, x0, lr, steps, received=None, client_state=None, global_step=0):
    """One local round of ``cfg.name``'s registered client rule on client ``client``'s quadratic.
    Returns (x after the round as floats, LocalResult, the tensor delta)."""
    param = torch.nn.Parameter(torch.tensor(x0, dtype=torch.float64))
    named = [("w", param)]
    rule = ALGORITHMS[cfg.name].local(cfg)
    optimizer = rule.make_optimizer(named)
    for group in optimizer.param_groups:
        group["lr"] = lr
    inputs = RoundInputs(received or {}, client_state or {}, global_step)
    rule.begin_round(optimizer, named, inputs)
    a, b = torch.tensor(A[client], dtype=torch.float64), torch.tensor(B[client], dtype=torch.float64)
    for _ in range(steps):
        param.grad = (a * param - b).detach()
        optimizer.step()
    delta = {"w": param.detach() - torch.tensor(x0, dtype=torch.float64)}
    result = rule.end_round(optimizer, named, inputs, delta, lr * steps)
    return param.detach().tolist(), result, delta


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def assert_close(actual, expected, tol=1e-12):
    actual = actual.tolist() if isinstance(actual, torch.Tensor) else actual
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got == pytest.approx(want, abs=tol, rel=tol)


def update(delta, arrays=None, lr_sum=0.1, steps=2, examples=10):
    return ClientUpdate(delta={"w": t(delta)}, num_steps=steps, lr_sum=lr_sum, num_examples=examples,
                        arrays={k: {"w": t(v)} for k, v in (arrays or {}).items()})


# ------------------------------------------------------------------ SGD family: local steps


def sgd_reference(client, x, lr, steps, wd, mu=0.0, correction=(0.0, 0.0, 0.0)):
    """x <- x - lr (g + wd x + mu (x - x0) + correction), coordinate by coordinate."""
    x0 = list(x)
    for _ in range(steps):
        g = grad(client, x)
        x = [xj - lr * (gj + wd * xj + mu * (xj - aj) + cj)
             for xj, gj, aj, cj in zip(x, g, x0, correction)]
    return x


def test_fedavg_local_sgd_with_l2_weight_decay():
    cfg = AlgorithmConfig(name="fedavg", lr=0.1, weight_decay=1e-3)
    x, result, _ = run_rule(cfg, 0, X0, lr=0.1, steps=4)
    assert_close(x, sgd_reference(0, X0, 0.1, 4, wd=1e-3))
    assert result.arrays == {} and result.client_state == {}


def test_fedprox_local_sgd_with_proximal_term():
    cfg = AlgorithmConfig(name="fedprox", lr=0.1, weight_decay=1e-3, mu=0.5)
    x, _, _ = run_rule(cfg, 1, X0, lr=0.05, steps=5)
    assert_close(x, sgd_reference(1, X0, 0.05, 5, wd=1e-3, mu=0.5))
    x_avg, _, _ = run_rule(AlgorithmConfig(name="fedavg", weight_decay=1e-3), 1, X0, lr=0.05, steps=5)
    assert x != pytest.approx(x_avg)  # the proximal term acts


def test_scaffold_local_steps_and_control_variate_option_two():
    c, c_i = [0.2, -0.1, 0.05], [-0.3, 0.4, 0.1]
    cfg = AlgorithmConfig(name="scaffold", lr=0.1, weight_decay=1e-3)
    lr, K = 0.1, 3
    x, result, _ = run_rule(cfg, 0, X0, lr=lr, steps=K, received={"c": {"w": t(c)}},
                            client_state={"c_i": {"w": t(c_i)}})
    # y <- y - lr (g + c - c_i)  (Karimireddy et al. 2020, Alg. 1 line 10; g includes the L2 term)
    y = sgd_reference(0, X0, lr, K, wd=1e-3, correction=[cg - cl for cg, cl in zip(c, c_i)])
    assert_close(x, y)
    # c_i+ = c_i - c + (x - y) / (K lr)  (option II), Delta c_i = c_i+ - c_i
    c_i_new = [cl - cg + (x0 - yj) / (K * lr) for cl, cg, x0, yj in zip(c_i, c, X0, y)]
    assert_close(result.client_state["c_i"]["w"], c_i_new)
    assert_close(result.arrays["delta_c"]["w"], [n - o for n, o in zip(c_i_new, c_i)])


def test_scaffold_first_participation_starts_from_zero_c_i():
    c = [0.2, -0.1, 0.05]
    cfg = AlgorithmConfig(name="scaffold", lr=0.1, weight_decay=0.0)
    x, result, _ = run_rule(cfg, 1, X0, lr=0.1, steps=2, received={"c": {"w": t(c)}})
    y = sgd_reference(1, X0, 0.1, 2, wd=0.0, correction=c)  # c - 0
    assert_close(x, y)
    assert_close(result.client_state["c_i"]["w"], [-cg + (x0 - yj) / 0.2 for cg, x0, yj in zip(c, X0, y)])
    # round 1: no c broadcast either -> plain SGD, c_i+ = (x - y) / (K lr)
    x1, result1, _ = run_rule(cfg, 1, X0, lr=0.1, steps=2)
    assert_close(x1, sgd_reference(1, X0, 0.1, 2, wd=0.0))


def test_sgd_rules_reset_their_round_state():
    """One warm optimizer serves many clients: a FedProx anchor or a SCAFFOLD correction never
    leaks into the next round."""
    cfg = AlgorithmConfig(name="scaffold", lr=0.1)
    rule = ALGORITHMS["scaffold"].local(cfg)
    param = torch.nn.Parameter(t(X0))
    named = [("w", param)]
    opt = rule.make_optimizer(named)
    rule.begin_round(opt, named, RoundInputs({"c": {"w": t([1.0, 1.0, 1.0])}}, {}, 0))
    rule.begin_round(opt, named, RoundInputs({}, {}, 0))  # next client: no c, no c_i
    param.grad = torch.zeros(3, dtype=torch.float64)
    opt.step()
    assert_close(param.detach(), [x * (1 - 0.1 * cfg.weight_decay) for x in X0])


# ------------------------------------------------------------------ adaptive local optimizers


def adam_reference(client, x, lr, steps, betas, eps, wd, decoupled):
    """Kingma & Ba's Adam (bias-corrected) from m = v = 0; L2 (Adam) or decoupled (AdamW) wd."""
    b1, b2 = betas
    m, v = [0.0] * len(x), [0.0] * len(x)
    for k in range(1, steps + 1):
        g = grad(client, x)
        if decoupled:
            x = [xj * (1 - lr * wd) for xj in x]
        else:
            g = [gj + wd * xj for gj, xj in zip(g, x)]
        m = [b1 * mj + (1 - b1) * gj for mj, gj in zip(m, g)]
        v = [b2 * vj + (1 - b2) * gj * gj for vj, gj in zip(v, g)]
        x = [xj - lr * (mj / (1 - b1 ** k)) / (math.sqrt(vj / (1 - b2 ** k)) + eps)
             for xj, mj, vj in zip(x, m, v)]
    return x


@pytest.mark.parametrize("name, decoupled", [("localadam", False), ("localadamw", True)])
def test_local_adam_and_adamw_fresh_every_round(name, decoupled):
    cfg = AlgorithmConfig(name=name, lr=0.01, weight_decay=0.05, betas=[0.8, 0.9], eps=1e-6)
    rule = ALGORITHMS[name].local(cfg)
    param = torch.nn.Parameter(t(X0))
    named = [("w", param)]
    opt = rule.make_optimizer(named)
    a, b = t(A[0]), t(B[0])
    expected = adam_reference(0, X0, 0.01, 4, (0.8, 0.9), 1e-6, 0.05, decoupled)
    for _ in range(2):  # the second round starts over: same x^r, same result
        with torch.no_grad():
            param.copy_(t(X0))
        rule.begin_round(opt, named, RoundInputs({}, {}, 0))
        for _ in range(4):
            param.grad = (a * param - b).detach()
            opt.step()
        assert_close(param.detach(), expected, tol=1e-10)


def lada_reference(client, x, lr, steps, betas, eps, wd, rho, v_bar=None, offset=None):
    """FedLADA's local round: m = 0, v = v_hat = v_bar (eps^2 at first); per step g += wd x,
    m, v as Adam, v_hat = max(v_hat, v), x -= lr ((1 - rho) m / sqrt(v_hat) + rho g_a).
    Returns (x, v_hat)."""
    b1, b2 = betas
    n = len(x)
    m = [0.0] * n
    v = list(v_bar) if v_bar is not None else [eps * eps] * n
    v_hat = list(v)
    g_a = list(offset) if offset is not None else [0.0] * n
    for _ in range(steps):
        g = [gj + wd * xj for gj, xj in zip(grad(client, x), x)]
        m = [b1 * mj + (1 - b1) * gj for mj, gj in zip(m, g)]
        v = [b2 * vj + (1 - b2) * gj * gj for vj, gj in zip(v, g)]
        v_hat = [max(h, vj) for h, vj in zip(v_hat, v)]
        x = [xj - lr * ((1 - rho) * mj / math.sqrt(h) + rho * ga)
             for xj, mj, h, ga in zip(x, m, v_hat, g_a)]
    return x, v_hat


def test_fedlada_local_round_matches_its_formula():
    cfg = AlgorithmConfig(name="fedlada", lr=0.01, weight_decay=1e-3, rho=0.3, betas=[0.9, 0.99])
    v_bar, offset = [0.04, 0.5, 1e-3], [0.1, -0.2, 0.3]
    x, result, _ = run_rule(cfg, 1, X0, lr=0.01, steps=5, received={"v_bar": {"w": t(v_bar)},
                                                                  "delta_g": {"w": t(offset)}})
    ref_x, ref_v_hat = lada_reference(1, X0, 0.01, 5, (0.9, 0.99), 1e-8, 1e-3, 0.3, v_bar, offset)
    assert_close(x, ref_x)
    assert_close(result.arrays["v"]["w"], ref_v_hat)
    # round 1 (nothing broadcast yet): v_hat starts at eps^2, no offset
    x1, result1, _ = run_rule(cfg, 0, X0, lr=0.01, steps=3)
    ref_x1, ref_v1 = lada_reference(0, X0, 0.01, 3, (0.9, 0.99), 1e-8, 1e-3, 0.3)
    assert_close(x1, ref_x1)
    assert_close(result1.arrays["v"]["w"], ref_v1)


def test_fedlada_two_clients_two_rounds_end_to_end():
    """Client rounds, server aggregation (x mean, g_a = -mean Delta / (K lr), v = mean v_hat) and a
    second round that uses them, against the written-out algorithm."""
    cfg = AlgorithmConfig(name="fedlada", lr=0.02, weight_decay=0.0, rho=0.5)
    server = ALGORITHMS["fedlada"].server(cfg, ["w"], num_clients=2)
    lr, K = 0.02, 3
    x = {"w": t(X0)}
    ref_x, ref_v, ref_ga = list(X0), None, None
    for _ in range(2):
        received = server.broadcast()
        updates, ref_locals = [], []
        for client in (0, 1):
            _, result, delta = run_rule(cfg, client, x["w"].tolist(), lr, K, received=received)
            updates.append(ClientUpdate(delta, K, lr * K, 10, result.arrays))
            ref_locals.append(lada_reference(client, ref_x, lr, K, (0.9, 0.999), 1e-8, 0.0, 0.5,
                                             ref_v, ref_ga))
        x = server.aggregate(x, updates)
        ref_xs = [xi for xi, _ in ref_locals]
        ref_ga = [sum(x0 - xi[j] for xi in ref_xs) / (2 * K * lr) for j, x0 in enumerate(ref_x)]
        ref_v = [sum(vi[j] for _, vi in ref_locals) / 2 for j in range(3)]
        ref_x = [sum(xi[j] for xi in ref_xs) / 2 for j in range(3)]
        assert_close(x["w"], ref_x, tol=1e-10)
        assert_close(server.delta_g["w"], ref_ga, tol=1e-9)
        assert_close(server.v_bar["w"], ref_v, tol=1e-12)


def fedact_reference_step(x, g, v_bar, delta_g, lr, betas, eps, wd, rho, tau, signal, global_step):
    """One step (k = 1) of the seed's Algorithm 1 with alpha = 1/tau, gamma = tau."""
    b1, b2 = betas
    t_ = global_step + 1
    u_loc = [((1 - b1) * gj / (1 - b1)) / (math.sqrt((b2 * vb + (1 - b2) * gj * gj) / (1 - b2 ** t_)) + eps)
             for gj, vb in zip(g, v_bar)]
    u = [(1 - rho) * ul + rho * dg for ul, dg in zip(u_loc, delta_g)]
    s = [(ul if signal == "local" else uj) * gj for ul, uj, gj in zip(u_loc, u, g)]
    top = sorted(range(len(s)), key=lambda j: -s[j])[:math.floor(tau * len(s))]
    phi = [1 / tau if j in top else tau for j in range(len(s))]
    return [(1 - lr * wd) * xj - lr * pj * uj for xj, pj, uj in zip(x, phi, u)]


@pytest.mark.parametrize("name, signal", [("fedact_local", "local"), ("fedact", "corrected")])
def test_fedact_local_and_fedact_through_the_registry(name, signal):
    cfg = AlgorithmConfig(name=name, trust_signal=signal, lr=0.01, tau=0.5)
    x0, v_bar = [0.5, -0.4, 0.3, 0.1], [0.01, 0.2, 5.0, 0.3]
    # Delta_G chosen so that the local and the corrected scores pick different top-2 coordinates
    delta_g = [-3.0, 0.0, 0.0, 4.0]
    a, b = [1.0, 2.0, 0.5, 1.5], [0.2, 0.1, -0.3, 0.4]
    g = [aj * xj - bj for aj, bj, xj in zip(a, b, x0)]
    param = torch.nn.Parameter(t(x0))
    named = [("w", param)]
    rule = ALGORITHMS[name].local(cfg)
    opt = rule.make_optimizer(named)
    rule.begin_round(opt, named, RoundInputs({"v_bar": {"w": t(v_bar)}, "delta_g": {"w": t(delta_g)}},
                                             {}, global_step=6))
    param.grad = t(g)
    opt.step()
    expected = fedact_reference_step(x0, g, v_bar, delta_g, 0.01, (0.9, 0.999), 1e-8, 0.01, 0.5, 0.5,
                                     signal, 6)
    assert_close(param.detach(), expected, tol=1e-12)
    other = fedact_reference_step(x0, g, v_bar, delta_g, 0.01, (0.9, 0.999), 1e-8, 0.01, 0.5, 0.5,
                                  "corrected" if signal == "local" else "local", 6)
    assert expected != pytest.approx(other)  # the two scores really select differently here


# ------------------------------------------------------------------ server rules


def test_mean_server_with_server_lr():
    cfg = AlgorithmConfig(name="fedavg", server_lr=0.5)
    server = ALGORITHMS["fedavg"].server(cfg, ["w"], num_clients=4)
    new = server.aggregate({"w": t([1.0, 2.0])}, [update([0.2, -0.4]), update([0.4, 0.0])])
    assert_close(new["w"], [1.0 + 0.5 * 0.3, 2.0 + 0.5 * -0.2])
    assert server.broadcast() == {} and server.reply_keys == ()


def test_scaffold_server_c_uses_all_clients_n():
    """x <- x + server_lr mean Delta y;  c <- c + (1/N) sum_{i in S} Delta c_i, with N = 5, S = 2."""
    cfg = AlgorithmConfig(name="scaffold", server_lr=1.0)
    server = ALGORITHMS["scaffold"].server(cfg, ["w"], num_clients=5)
    assert server.reply_keys == ("delta_c",) and server.broadcast() == {}  # c = 0 before round 1
    x = {"w": t([1.0, -1.0])}
    rounds = [
        [update([0.1, 0.2], {"delta_c": [1.0, -2.0]}), update([0.3, -0.2], {"delta_c": [0.5, 0.5]})],
        [update([-0.1, 0.0], {"delta_c": [2.0, 1.0]}), update([0.1, 0.4], {"delta_c": [-1.0, 3.0]}),
         update([0.3, 0.2], {"delta_c": [0.0, 1.0]})],
    ]
    c = [0.0, 0.0]
    ref_x = [1.0, -1.0]
    for ups in rounds:
        x = server.aggregate(x, ups)
        S = len(ups)
        ref_x = [ref_x[j] + sum(u.delta["w"][j].item() for u in ups) / S for j in range(2)]
        c = [c[j] + sum(u.arrays["delta_c"]["w"][j].item() for u in ups) / 5 for j in range(2)]
        assert_close(x["w"], ref_x)
        assert_close(server.broadcast()["c"]["w"], c)
    assert_close(c, [(1.5 + 1.0) / 5, (-1.5 + 5.0) / 5])


def test_scaffold_server_needs_n():
    with pytest.raises(ValueError, match="number of clients"):
        ALGORITHMS["scaffold"].server(AlgorithmConfig(name="scaffold"), ["w"])


def test_fedadam_server_moments_over_three_rounds():
    """Reddi et al. 2021, Alg. 2 (Adam): m = b1 m + (1-b1) d, v = b2 v + (1-b2) d^2,
    x += eta m / (sqrt(v) + tau), m_{-1} = 0, v_{-1} = tau^2, no bias correction; buffers take
    the plain mean."""
    cfg = AlgorithmConfig(name="fedadam", server_lr=0.01, server_betas=[0.9, 0.98], server_eps=1e-3)
    server = ALGORITHMS["fedadam"].server(cfg, ["w"], num_clients=10)
    x = {"w": t([0.5, -0.5, 0.0]), "bn": t([1.0])}
    deltas = [([[0.2, -0.1, 0.0], [0.4, 0.1, 0.002]]), ([[0.1, 0.1, -0.05], [-0.1, 0.3, 0.01]]),
              ([[0.0, -0.2, 0.3], [0.2, 0.2, 0.1]])]
    m, v, ref = [0.0] * 3, [1e-6] * 3, [0.5, -0.5, 0.0]
    for r, (d1, d2) in enumerate(deltas):
        ups = [ClientUpdate({"w": t(d1), "bn": t([0.2])}, 2, 0.2, 10),
               ClientUpdate({"w": t(d2), "bn": t([0.4])}, 2, 0.2, 10)]
        x = server.aggregate(x, ups)
        d = [(p + q) / 2 for p, q in zip(d1, d2)]
        m = [0.9 * mj + 0.1 * dj for mj, dj in zip(m, d)]
        v = [0.98 * vj + 0.02 * dj * dj for vj, dj in zip(v, d)]
        ref = [xj + 0.01 * mj / (math.sqrt(vj) + 1e-3) for xj, mj, vj in zip(ref, m, v)]
        assert_close(x["w"], ref)
        assert x["bn"].item() == pytest.approx(1.0 + 0.3 * (r + 1))
    assert server.broadcast() == {}


# ------------------------------------------------------------------ optimizers' own contracts


def test_optimizers_validate_arguments():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="mu"):
        LocalSGD(p, mu=-1)
    with pytest.raises(ValueError, match="eps"):
        FedLADAAdam(p, eps=0.0)
    with pytest.raises(ValueError, match="rho"):
        FedLADAAdam(p, rho=1.5)
    with pytest.raises(ValueError, match="shape"):
        LocalSGD(p).begin_round(correction=[torch.zeros(3)])


def test_optimizers_work_without_begin_round():
    """Outside a federated loop: LocalSGD is SGD with L2 decay; FedLADAAdam has no offset."""
    p = torch.nn.Parameter(t([1.0, -1.0]))
    opt = LocalSGD([p], lr=0.1, weight_decay=0.1, mu=10.0)  # no anchor -> no proximal term
    p.grad = t([0.5, 0.5])
    opt.step()
    assert_close(p.detach(), [1.0 - 0.1 * (0.5 + 0.1), -1.0 - 0.1 * (0.5 - 0.1)])
    q = torch.nn.Parameter(t([1.0]))
    lada = FedLADAAdam([q], lr=0.1, betas=(0.5, 0.5), eps=1e-8, rho=0.5)
    q.grad = t([2.0])
    lada.step()  # m = 1, v = v_hat = 0.5 eps^2 + 2 -> x -= 0.1 * 0.5 * 1 / sqrt(v_hat)
    assert_close(q.detach(), [1.0 - 0.05 / math.sqrt(0.5e-16 + 2.0)])


def test_local_sgd_keeps_no_empty_state_entries():
    """LocalSGD holds state only for the round's anchor and correction: steps and a begin_round
    that switches both off leave no (empty) entry per parameter, so state_dict() stays empty."""
    p, q = torch.nn.Parameter(t([1.0, -1.0])), torch.nn.Parameter(t([2.0]))
    opt = LocalSGD([p, q], lr=0.1, mu=1.0)
    p.grad, q.grad = t([0.5, 0.5]), t([1.0])
    opt.step()
    opt.begin_round()
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
    opt.begin_round(anchor=[t([0.0, 0.0]), t([0.0])])
    assert set(opt.state[p]) == {"anchor"}
    opt.begin_round(anchor=None)
    opt.step()
    assert len(opt.state) == 0


@pytest.mark.parametrize("kind", ["sparse", "complex"])
def test_fedlada_refuses_sparse_and_complex_gradients_before_changing_state(kind):
    """The error names the optimizer and the cause, and comes before any moment changes (the
    first parameter's m and v, updated before the second's gradient was looked at, stay put)."""
    dtype = torch.complex64 if kind == "complex" else torch.float32
    p = torch.nn.Parameter(t([1.0, -1.0]))
    q = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    opt = FedLADAAdam([p, q], lr=0.1)
    opt.begin_round()
    p.grad = t([0.5, 0.5])
    q.grad = torch.ones(3, dtype=dtype).to_sparse() if kind == "sparse" else torch.ones(3, dtype=dtype)
    before = {key: value.clone() for key, value in opt.state[p].items()}
    with pytest.raises(RuntimeError, match=f"FedLADAAdam does not support {kind}"):
        opt.step()
    assert all(torch.equal(opt.state[p][key], value) for key, value in before.items())
    assert torch.equal(p.detach(), t([1.0, -1.0]))


# ------------------------------------------------------------------ SCAFFOLD's c_i in Context.state


def test_scaffold_c_i_lives_in_each_clients_context_state():
    """Through the ClientApp's train work (``train_content``) with real Flower records: c_i is zero
    on a client's first round, survives in that client's ``Context.state`` to its next round, and
    never crosses to another client although one warm trainer serves both."""
    from flwr.app import ConfigRecord, Context, RecordDict

    from fedact_app.client_work import CLIENT_STATE_PREFIX, load_client_state, train_content
    from fedact_app.config import compose
    from fedact_app.tasks.vision.models import build_model
    from fedact_app.wire import packed_record, unpacked

    overrides = "algorithm=scaffold num_clients=3 local_steps=3 batch_size=16 device=cpu"
    cfg = compose(overrides)
    x0 = {k: v.detach().clone() for k, v in build_model(cfg.model, cfg.dataset).state_dict().items()}
    trainable = [n for n, p in build_model(cfg.model, cfg.dataset).named_parameters()]
    lr, K = 0.05, 3

    def context(partition_id):
        return Context(run_id=1, node_id=100 + partition_id, state=RecordDict(),
                       node_config={"partition-id": partition_id, "num-partitions": 3},
                       run_config={"overrides": overrides})

    def content(server_round, c=None):
        records = {"model": packed_record(x0), "config": ConfigRecord(
            {"server-round": server_round, "local-steps": K, "lr": lr, "global-step": 0})}
        if c is not None:
            records["c"] = packed_record(c)
        return RecordDict(records)

    def arrays(reply, key):
        return unpacked(reply[key])

    c1 = {n: torch.full_like(x0[n], 0.01) for n in trainable}
    a, other = context(0), context(0)  # two clients that happen to hold the same partition
    assert load_client_state(a) == {}

    # Round 1 of client a: c_i = 0, so c_i+ = -c - Delta / (K lr) and Delta c_i = c_i+.
    reply1 = train_content(content(1, c1), a)
    delta1, delta_c1 = arrays(reply1, "delta"), arrays(reply1, "delta_c")
    stored1 = load_client_state(a)["c_i"]
    for n in trainable:
        torch.testing.assert_close(stored1[n], -c1[n] - delta1[n] / (K * lr))
        torch.testing.assert_close(delta_c1[n], stored1[n])
    assert list(a.state.array_records) == [CLIENT_STATE_PREFIX + "c_i"]

    # Round 2 of client a, and the same round as the first of client `other`.
    c2 = {n: torch.full_like(x0[n], -0.02) for n in trainable}
    reply2 = train_content(content(2, c2), a)
    reply_other = train_content(content(2, c2), other)
    stored2 = load_client_state(a)["c_i"]
    for n in trainable:
        expected = stored1[n] - c2[n] - arrays(reply2, "delta")[n] / (K * lr)
        torch.testing.assert_close(stored2[n], expected)
        torch.testing.assert_close(arrays(reply2, "delta_c")[n], expected - stored1[n])
        torch.testing.assert_close(load_client_state(other)["c_i"][n],
                                   -c2[n] - arrays(reply_other, "delta")[n] / (K * lr))
    # Same data, same x^r, same c: only c_i differs, and it moved the trajectory.
    weight = trainable[0]
    assert not torch.allclose(arrays(reply2, "delta")[weight], arrays(reply_other, "delta")[weight])
