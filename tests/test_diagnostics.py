"""The seed's Appendix A diagnostics against plain computations written here from its formulas,
the optimizers' direction read-outs against the steps they took, and the equality of training
with the diagnostics on and off."""

import math
import time

import pytest
import torch
from flwr.app import Message, MessageType, Metadata, MetricRecord, RecordDict

from fedact_app.algorithms import ALGORITHMS
from fedact_app.baselines import FedLADAAdam
from fedact_app.client_trainer import ClientTrainer
from fedact_app.config import compose
from fedact_app import diagnostics
from fedact_app.diagnostics import (TrustProbe, adam_direction, direction_consistency, global_norm,
                                    mean_client_statistics, trust_score_statistics)
from fedact_app.optim import FedACTAdamW
from fedact_app.strategy import AlgorithmStrategy
from fedact_app.wire import packed_record


# ---------------------------------------------------------------------- plain oracles


def plain_cos(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0


def plain_dc(clients: list[list[float]]) -> float:
    """DC^r = (1/S) sum_i cos(Delta_i, (1/S) sum_j Delta_j)."""
    S = len(clients)
    mean = [sum(c[j] for c in clients) / S for j in range(len(clients[0]))]
    return sum(plain_cos(c, mean) for c in clients) / S


def plain_scores_stats(s: list[float], p: float) -> tuple[float, float]:
    """PosRatio and TopMass_p: Top_p = the ceil(p d) largest entries; [a]_+ = max(a, 0)."""
    d = len(s)
    ratio = sum(1 for x in s if x > 0) / d
    positive_total = sum(max(x, 0.0) for x in s)
    top = sorted(s, reverse=True)[:math.ceil(round(p * d, 9))]
    mass = sum(max(x, 0.0) for x in top) / positive_total if positive_total > 0 else 0.0
    return ratio, mass


# ---------------------------------------------------------------------- direction consistency


def test_direction_consistency_matches_the_formula():
    gen = torch.Generator().manual_seed(0)
    deltas = [{"a": torch.randn(3, 2, generator=gen), "b": torch.randn(4, generator=gen),
               "buffer": torch.randn(5, generator=gen)} for _ in range(4)]
    flat = [d["a"].reshape(-1).tolist() + d["b"].tolist() for d in deltas]  # "buffer" is not trainable
    assert direction_consistency(deltas, ["a", "b"]) == pytest.approx(plain_dc(flat), rel=1e-12)


def test_direction_consistency_special_cases():
    same = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([2.0, 4.0])}]
    assert direction_consistency(same, ["w"]) == pytest.approx(1.0)
    opposite = [{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([-1.0, 0.0])}]
    assert direction_consistency(opposite, ["w"]) == 0.0  # the mean is 0: cosines count as 0
    with_zero = [{"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([0.0, 3.0])}]
    assert direction_consistency(with_zero, ["w"]) == pytest.approx(plain_dc([[0.0, 0.0], [0.0, 3.0]]))
    assert direction_consistency(with_zero, ["w"]) == pytest.approx(0.5)


@pytest.mark.parametrize("chunk", [1, 3, 1 << 16])
def test_direction_consistency_and_global_norm_over_chunks(monkeypatch, chunk):
    # chunk 1 and 3 split every tensor (sizes 6, 7, 1) into blocks, with a short last block
    monkeypatch.setattr(diagnostics, "_FLOAT64_CHUNK", chunk)
    gen = torch.Generator().manual_seed(1)
    deltas = [{"a": torch.randn(2, 3, generator=gen) + 0.5, "b": torch.randn(7, generator=gen),
               "c": torch.randn(1, generator=gen, dtype=torch.float64)} for _ in range(3)]
    flat = [d["a"].reshape(-1).tolist() + d["b"].tolist() + d["c"].tolist() for d in deltas]
    assert direction_consistency(deltas, ["a", "b", "c"]) == pytest.approx(plain_dc(flat), rel=1e-12)
    assert global_norm(deltas[0]) == pytest.approx(math.sqrt(sum(x * x for x in flat[0])), rel=1e-12)
    assert global_norm({"empty": torch.zeros(0)}) == 0.0


# ---------------------------------------------------------------------- trust-score statistics


@pytest.mark.parametrize("p", [0.01, 0.07, 0.25, 1.0])
def test_score_statistics_match_the_formulas(p):
    gen = torch.Generator().manual_seed(1)
    scores = [torch.randn(10, 7, generator=gen), torch.randn(30, generator=gen)]  # d = 100
    flat = scores[0].reshape(-1).tolist() + scores[1].tolist()
    ratio, mass = trust_score_statistics(scores, p)
    expected_ratio, expected_mass = plain_scores_stats(flat, p)
    assert ratio == expected_ratio
    assert mass == pytest.approx(expected_mass, rel=1e-6)


def test_score_statistics_edge_cases():
    assert trust_score_statistics([torch.tensor([-1.0, 0.0, -2.0])], 0.5) == (0.0, 0.0)  # no positive mass
    ratio, mass = trust_score_statistics([torch.tensor([3.0, 1.0, -1.0, 0.0])], 0.25)  # top 1 of 4
    assert (ratio, mass) == (0.5, pytest.approx(0.75))
    ratio, mass = trust_score_statistics([torch.tensor([2.0, 2.0, 2.0, 2.0])], 0.5)  # ties: mass is exact
    assert (ratio, mass) == (1.0, pytest.approx(0.5))
    half = [torch.tensor([3.0, 1.0, -1.0, 0.0], dtype=torch.bfloat16)]  # bf16 parameters' scores
    assert trust_score_statistics(half, 0.25) == (0.5, pytest.approx(0.75))


# ---------------------------------------------------------------------- direction read-outs


def two_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 4, generator=gen, dtype=torch.float64)),
            torch.nn.Parameter(torch.randn(7, generator=gen, dtype=torch.float64))]


def set_grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


@pytest.mark.parametrize("rho", [0.0, 0.5])
def test_fedact_direction_is_the_formula_of_algorithm_1(rho):
    """u = (1-rho) m_hat/(sqrt(v_hat)+eps) + rho Delta_G with m_hat over the local k and v_hat over
    the global t, written out here over 2 local steps, for every trust signal."""
    b1, b2, eps = 0.9, 0.99, 1e-8
    for signal in ("corrected", "local", "none"):
        params = two_params()
        gen = torch.Generator().manual_seed(5)
        v_bar = [torch.rand(p.shape, generator=gen, dtype=p.dtype) for p in params]
        delta_g = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
        opt = FedACTAdamW(params, lr=1e-2, betas=(b1, b2), eps=eps, rho=rho, trust_signal=signal)
        opt.begin_round(v_bar=v_bar, delta_g=delta_g, global_step=20)
        m = [torch.zeros_like(p) for p in params]
        v = [t.clone() for t in v_bar]
        for k in (1, 2):
            set_grads(params, seed=10 + k)
            grads = [p.grad.clone() for p in params]
            opt.step()
            for i, g in enumerate(grads):
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
        for i, (u, g) in enumerate(opt.last_step_direction()):
            m_hat, v_hat = m[i] / (1 - b1 ** 2), v[i] / (1 - b2 ** 22)
            expected = (1 - rho) * m_hat / (v_hat.sqrt() + eps) + rho * delta_g[i]
            torch.testing.assert_close(u, expected, rtol=1e-12, atol=1e-12)
            assert g is params[i].grad


def test_fedadamw_step_moves_along_the_read_out_direction():
    """phi = 1 and no weight decay: x_new = x - lr u exactly, so the read-out is the step's u."""
    params = two_params()
    opt = FedACTAdamW(params, lr=0.1, weight_decay=0.0, trust_signal="none")
    opt.begin_round(v_bar=[torch.full_like(p, 0.5) for p in params],
                    delta_g=[torch.ones_like(p) for p in params], global_step=3)
    set_grads(params, seed=2)
    before = [p.detach().clone() for p in params]
    opt.step()
    for x0, p, (u, _) in zip(before, params, opt.last_step_direction()):
        torch.testing.assert_close(p.detach(), x0 - 0.1 * u, rtol=1e-12, atol=1e-12)


def test_last_step_direction_needs_a_step():
    opt = FedACTAdamW(two_params())
    opt.begin_round()
    with pytest.raises(RuntimeError, match="needs a step"):
        opt.last_step_direction()


@pytest.mark.parametrize("optimizer_class", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_direction_is_the_step_torch_took(optimizer_class):
    params = two_params()
    opt = optimizer_class(params, lr=0.05, weight_decay=0.0)
    for step in range(3):
        set_grads(params, seed=step)
        before = [p.detach().clone() for p in params]
        opt.step()
    for x0, p, (u, g) in zip(before, params, adam_direction(opt)):
        torch.testing.assert_close(p.detach(), x0 - 0.05 * u, rtol=1e-10, atol=1e-12)
        assert g is p.grad


def test_fedlada_direction_is_the_step_it_took():
    params = two_params()
    opt = FedLADAAdam(params, lr=0.05, weight_decay=0.0, rho=0.3)
    opt.begin_round(v_bar=[torch.full_like(p, 0.2) for p in params],
                    offset=[torch.ones_like(p) for p in params])
    set_grads(params, seed=4)
    before = [p.detach().clone() for p in params]
    opt.step()
    for x0, p, (u, _) in zip(before, params, opt.last_step_direction()):
        torch.testing.assert_close(p.detach(), x0 - 0.05 * u, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------- amplified fraction


def measured_amplified_fraction(opt_kwargs) -> tuple[float, float]:
    """(optimizer's amplified_fraction, the share of phi_j > 1 recovered from the step itself:
    without weight decay x_new - x = -lr phi u, so phi = (x - x_new) / (lr u))."""
    params = two_params()  # d = 27
    opt = FedACTAdamW(params, lr=0.1, weight_decay=0.0, **opt_kwargs)
    opt.begin_round(v_bar=[torch.full_like(p, 0.5) for p in params],
                    delta_g=[torch.ones_like(p) for p in params], global_step=3)
    set_grads(params, seed=7)
    before = [p.detach().clone() for p in params]
    opt.step()
    phis = [((x0 - p.detach()) / (0.1 * u)).reshape(-1) for x0, p, (u, _) in
            zip(before, params, opt.last_step_direction())]
    phi = torch.cat(phis)
    return opt.amplified_fraction(), float((phi > 1 + 1e-9).double().mean())


@pytest.mark.parametrize("opt_kwargs, expected", [
    (dict(), 13 / 27),                                           # floor(0.5 * 27) = 13 get alpha = 2
    (dict(trust_scope="tensor"), (10 + 3) / 27),                 # floor(0.5 * 20) + floor(0.5 * 7)
    (dict(tau=0.3, trust_scope="tensor"), (6 + 2) / 27),
    (dict(trust_signal="local"), 13 / 27),
    (dict(trust_signal="none"), 0.0),                            # phi = 1: FedAdamW
    (dict(alpha=1.0, gamma=1.0), 0.0),                           # alpha = gamma = 1: nothing amplified
    (dict(alpha=1.5, gamma=1.2), 1.0),                           # both > 1: every coordinate
    (dict(scale_matched=True), 13 / 27),                         # alpha / mean = 2 / 1.2407 > 1
    (dict(tau=0.2, alpha=1.1, gamma=0.9, scale_matched=True), 5 / 27),
])
def test_amplified_fraction(opt_kwargs, expected):
    reported, measured = measured_amplified_fraction(opt_kwargs)
    assert reported == pytest.approx(expected)
    assert measured == pytest.approx(expected)


# ---------------------------------------------------------------------- the probe and the rules


def test_probe_samples_every_nth_step_and_averages():
    calls = []

    def direction():
        calls.append(len(calls))
        value = float(len(calls))  # sample n: scores [n, -n]: ratio 0.5, mass 1
        return [(torch.tensor([value, -value]), torch.ones(2))]

    probe = TrustProbe(3, 0.5, direction, amplified=lambda: 0.25 * len(calls))
    for k in range(1, 8):
        probe.after_step(k)
    assert len(calls) == 2  # steps 3 and 6
    assert probe.summary() == {"positive-ratio": 0.5, "top-p-mass": 1.0, "amplified-fraction": 0.375}
    off = TrustProbe(0, 0.5, direction, amplified=lambda: 1.0)
    for k in range(1, 8):
        off.after_step(k)
    assert off.summary() == {} and len(calls) == 2


def test_methods_without_a_direction_report_nothing():
    probe = TrustProbe(1, 0.01, lambda: None, lambda: None)
    probe.after_step(1)
    assert probe.summary() == {}
    assert mean_client_statistics([{"train-loss": 1.0}, {}]) == {}
    assert mean_client_statistics([{"positive-ratio": 0.2}, {"positive-ratio": 0.4, "top-p-mass": 0.9}]) \
        == {"positive_ratio": pytest.approx(0.3), "top_p_mass": 0.9}


@pytest.mark.parametrize("algorithm, has_direction, has_amplified", [
    ("fedact", True, True), ("fedact_local", True, True), ("fedadamw", True, True),
    ("localadam", True, False), ("localadamw", True, False), ("fedlada", True, False),
    ("fedavg", False, False), ("fedprox", False, False), ("scaffold", False, False), ("fedadam", False, False),
])
def test_which_methods_define_which_statistics(algorithm, has_direction, has_amplified):
    cfg = compose([f"algorithm={algorithm}"]).algorithm
    rule = ALGORITHMS[algorithm].local(cfg)
    model = torch.nn.Linear(3, 2)
    named = list(model.named_parameters())
    opt = rule.make_optimizer(named)
    model(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    assert (rule.last_step_direction(opt) is not None) == has_direction
    assert (rule.amplified_fraction(opt) is not None) == has_amplified


# ---------------------------------------------------------------------- training is unchanged


def test_training_is_identical_with_diagnostics_on_and_off():
    """A real client round (digits, cnn_small, FedACT) with statistics at every step and with
    them off: the same delta and v, bit for bit."""
    results, state, received = {}, None, None
    for every in (1, 0):
        trainer = ClientTrainer(compose(["device=cpu", "num_clients=2", f"diagnostics.trust_every={every}"]))
        if state is None:  # the same x^r, v_bar and Delta_G for both
            state = {n: t.clone() for n, t in trainer.model.state_dict().items()}
            gen = torch.Generator().manual_seed(3)
            names = [n for n, _ in trainer.named_params]
            received = {"v_bar": {n: torch.rand(state[n].shape, generator=gen) * 1e-3 for n in names},
                        "delta_g": {n: torch.randn(state[n].shape, generator=gen) * 1e-2 for n in names}}
        results[every] = trainer.train_round(state, received, partition_id=0, num_partitions=2,
                                             server_round=2, lr=1e-3, local_steps=4, global_step=4)
    on, off = results[1], results[0]
    assert all(torch.equal(on.update.delta[n], off.update.delta[n]) for n in on.update.delta)
    assert all(torch.equal(on.update.arrays["v"][n], off.update.arrays["v"][n]) for n in on.update.arrays["v"])
    assert on.loss == off.loss
    assert set(on.diagnostics) == {"positive-ratio", "top-p-mass", "amplified-fraction"}
    assert 0 < on.diagnostics["positive-ratio"] < 1 and 0 < on.diagnostics["top-p-mass"] <= 1
    assert off.diagnostics == {}


# ---------------------------------------------------------------------- the server's round metrics


def reply(node: int, delta: dict, stats: dict) -> Message:
    content = RecordDict({
        "delta": packed_record(delta),
        "v": packed_record({"w": torch.full((3,), 0.1)}),
        "metrics": MetricRecord({"num-examples": 10, "num-steps": 5, "lr-sum": 0.5, "train-loss": 1.0,
                                 "partition-id": node, **stats}),
    })
    metadata = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0,
                        reply_to_message_id=f"q{node}", group_id="1", created_at=time.time(), ttl=60.0,
                        message_type=MessageType.TRAIN)
    return Message(metadata=metadata, content=content)


def test_round_metrics_carry_dc_delta_g_norm_and_the_clients_statistics():
    strategy = AlgorithmStrategy(ALGORITHMS["fedact"].server(compose([]).algorithm, ["w"]), trainable=["w"],
                                 local_steps=5, lr_schedule=lambda r: 0.1, fraction_train=1.0,
                                 min_train_nodes=1)
    strategy.state = {"w": torch.zeros(3), "bn.n": torch.tensor(0)}
    strategy.messages_sent = 2
    d1, d2 = [1.0, 2.0, 0.0], [0.0, 1.0, 1.0]
    replies = [reply(1, {"w": torch.tensor(d1), "bn.n": torch.tensor(1)},
                     {"positive-ratio": 0.6, "top-p-mass": 0.2, "amplified-fraction": 0.5,
                      "train-seconds": 1.25}),
               reply(2, {"w": torch.tensor(d2), "bn.n": torch.tensor(1)},
                     {"positive-ratio": 0.8, "top-p-mass": 0.4, "amplified-fraction": 0.5,
                      "train-seconds": 2.5})]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics["direction_consistency"] == pytest.approx(plain_dc([d1, d2]), rel=1e-6)
    # Delta_G = -mean(Delta_i / 0.5) = -(d1 + d2)
    assert metrics["delta_g_norm"] == pytest.approx(math.sqrt(1 + 9 + 1), rel=1e-6)
    assert metrics["positive_ratio"] == pytest.approx(0.7)
    assert metrics["top_p_mass"] == pytest.approx(0.3)
    assert metrics["amplified_fraction"] == pytest.approx(0.5)
    assert (metrics["client_train_seconds"], metrics["client_train_seconds_max"]) == (3.75, 2.5)
