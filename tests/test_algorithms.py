"""Server rules of FedACT / FedAdamW against hand-computed values and a plain loop over
the seed's server rule (Algorithm 1, lines 22-24) (x += server_lr * mean Delta; Delta_G = -mean(Delta / sum eta); v_bar = mean v)."""

import pytest
import torch

from fedact_app.algorithms import ALGORITHMS, ClientUpdate, FedACTServer
from fedact_app.config import AlgorithmConfig, ConfigError, compose


def update(delta, v, steps=2, lr_sum=0.2, examples=10):
    return ClientUpdate(delta=delta, num_steps=steps, lr_sum=lr_sum, num_examples=examples,
                        arrays={"v": v})


def test_two_clients_hand_computed():
    # x = [1, 2]; client deltas [0.2, -0.4] (lr_sum 0.2) and [0.4, 0.0] (lr_sum 0.4).
    x = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    u1 = update({"w": torch.tensor([0.2, -0.4], dtype=torch.float64)},
                {"w": torch.tensor([1.0, 3.0], dtype=torch.float64)}, lr_sum=0.2)
    u2 = update({"w": torch.tensor([0.4, 0.0], dtype=torch.float64)},
                {"w": torch.tensor([3.0, 5.0], dtype=torch.float64)}, lr_sum=0.4)
    rule = FedACTServer(AlgorithmConfig(name="fedact", server_lr=1.0), ["w"])
    assert rule.broadcast() == {}  # round 1: v_bar = 0, Delta_G = 0 (absent)
    new_x = rule.aggregate(x, [u1, u2])
    torch.testing.assert_close(new_x["w"], torch.tensor([1.3, 1.8], dtype=torch.float64))
    # Delta_G = -((0.2/0.2 + 0.4/0.4)/2, (-0.4/0.2 + 0/0.4)/2) = -(1.0, -1.0)
    torch.testing.assert_close(rule.delta_g["w"], torch.tensor([-1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(rule.v_bar["w"], torch.tensor([2.0, 4.0], dtype=torch.float64))
    assert set(rule.broadcast()) == {"v_bar", "delta_g"}
    assert x["w"].tolist() == [1.0, 2.0]  # the input state is not modified in place


def test_equal_steps_matches_seed_formula():
    # With equal K and eta, Delta_G = -1/(S K eta) sum_i Delta_i (seed: Algorithm 1, line 22).
    torch.manual_seed(0)
    S, K, eta = 3, 5, 0.01
    deltas = [torch.randn(4, 3, dtype=torch.float64) for _ in range(S)]
    updates = [update({"w": d}, {"w": torch.rand(4, 3, dtype=torch.float64)}, steps=K, lr_sum=K * eta)
               for d in deltas]
    rule = FedACTServer(AlgorithmConfig(name="fedadamw", trust_signal="none", server_lr=0.5), ["w"])
    x = {"w": torch.randn(4, 3, dtype=torch.float64)}
    new_x = rule.aggregate(x, updates)
    expected_g = -sum(deltas) / (S * K * eta)
    torch.testing.assert_close(rule.delta_g["w"], expected_g)
    torch.testing.assert_close(new_x["w"], x["w"] + 0.5 * sum(deltas) / S)


def test_example_weighting_plain_loop():
    torch.manual_seed(1)
    examples = [10, 30, 60]
    lr_sums = [0.1, 0.2, 0.3]
    deltas = [torch.randn(5, dtype=torch.float64) for _ in examples]
    vs = [torch.rand(5, dtype=torch.float64) for _ in examples]
    updates = [update({"w": d}, {"w": v}, lr_sum=s, examples=n)
               for d, v, s, n in zip(deltas, vs, lr_sums, examples)]
    rule = FedACTServer(AlgorithmConfig(name="fedact", weighting="examples"), ["w"])
    x = {"w": torch.zeros(5, dtype=torch.float64)}
    new_x = rule.aggregate(x, updates)
    for j in range(5):
        total = sum(examples)
        mean_d = sum(n / total * d[j].item() for n, d in zip(examples, deltas))
        g = -sum(n / total * d[j].item() / s for n, d, s in zip(examples, deltas, lr_sums))
        v = sum(n / total * vv[j].item() for n, vv in zip(examples, vs))
        assert new_x["w"][j].item() == pytest.approx(mean_d, abs=1e-12)
        assert rule.delta_g["w"][j].item() == pytest.approx(g, abs=1e-12)
        assert rule.v_bar["w"][j].item() == pytest.approx(v, abs=1e-12)


def test_buffers_are_averaged_without_server_lr_and_stay_out_of_correction():
    x = {"w": torch.tensor([1.0]), "bn.running_mean": torch.tensor([0.0]),
         "bn.num_batches_tracked": torch.tensor(4)}
    u1 = update({"w": torch.tensor([1.0]), "bn.running_mean": torch.tensor([1.0]),
                 "bn.num_batches_tracked": torch.tensor(2)}, {"w": torch.tensor([1.0])})
    u2 = update({"w": torch.tensor([3.0]), "bn.running_mean": torch.tensor([2.0]),
                 "bn.num_batches_tracked": torch.tensor(3)}, {"w": torch.tensor([1.0])})
    rule = FedACTServer(AlgorithmConfig(name="fedact", server_lr=0.5), ["w"])
    new_x = rule.aggregate(x, [u1, u2])
    assert new_x["w"].item() == pytest.approx(2.0)  # 1 + 0.5 * 2
    assert new_x["bn.running_mean"].item() == pytest.approx(1.5)  # plain mean, no server_lr
    assert new_x["bn.num_batches_tracked"].dtype == torch.int64
    assert new_x["bn.num_batches_tracked"].item() == 6  # 4 + round(2.5) (round half to even)
    assert set(rule.delta_g) == {"w"} and set(rule.v_bar) == {"w"}


def test_registry_fixes_trust_signal():
    with pytest.raises(ValueError, match="algorithm.trust_signal"):
        AlgorithmConfig(name="fedadamw", trust_signal="corrected")
    with pytest.raises(ValueError, match="algorithm.trust_signal"):
        AlgorithmConfig(name="fedact_local", trust_signal="corrected")
    assert compose("algorithm=fedact_local").algorithm.trust_signal == "local"


METHODS = ["fedavg", "fedprox", "scaffold", "fedadam", "localadam", "localadamw", "fedlada",
           "fedadamw", "fedact_local", "fedact"]

# The seed's Appendix C vision table (tab:hyperparams_resnet_vit_swin): local lr, global lr, rho,
# (beta1, beta2), weight decay. FedAdam's betas are its server Adam's (its local optimizer is SGD).
SEED_TABLE = {
    "fedavg": (0.1, 1.0, None, None, 1e-3),
    "scaffold": (0.1, 1.0, None, None, 1e-3),
    "fedprox": (0.1, 1.0, None, None, 1e-3),
    "fedadam": (0.1, 0.01, None, [0.9, 0.98], 1e-3),
    "localadam": (3e-4, 1.0, None, [0.9, 0.999], 1e-3),
    "fedlada": (3e-4, 1.0, 0.5, [0.9, 0.999], 1e-3),
    "localadamw": (3e-4, 1.0, None, [0.9, 0.999], 0.01),
    "fedadamw": (3e-4, 1.0, 0.5, [0.9, 0.999], 0.01),
    "fedact_local": (3e-4, 1.0, 0.5, [0.9, 0.999], 0.01),  # as FedACT (not in the table)
    "fedact": (3e-4, 1.0, 0.5, [0.9, 0.999], 0.01),
}


def test_methods_with_a_trust_score_to_sample():
    """The clients' trust-score diagnostics exist for the adaptive methods only."""
    assert {name for name, a in ALGORITHMS.items() if a.samples_trust_scores} == {
        "fedact", "fedact_local", "fedadamw", "localadam", "localadamw", "fedlada"}


def test_registry_has_the_ten_methods_of_the_seed():
    assert sorted(ALGORITHMS) == sorted(METHODS)


@pytest.mark.parametrize("name", METHODS)
def test_algorithm_yaml_has_the_seed_defaults(name):
    algo = compose(f"algorithm={name}").algorithm
    lr, server_lr, rho, betas, wd = SEED_TABLE[name]
    assert (algo.name, algo.lr, algo.server_lr, algo.weight_decay) == (name, lr, server_lr, wd)
    if rho is not None:
        assert algo.rho == rho
    if betas is not None:
        assert (algo.server_betas if name == "fedadam" else algo.betas) == betas
    assert "lr" in ALGORITHMS[name].uses and "weighting" in ALGORITHMS[name].uses


def test_method_specific_defaults():
    assert compose("algorithm=fedprox").algorithm.mu == 0.01
    assert compose("algorithm=fedadam").algorithm.server_eps == 1e-3


@pytest.mark.parametrize("override, key", [
    ("algorithm=fedavg algorithm.rho=0.3", "algorithm.rho"),
    ("algorithm=fedavg algorithm.mu=0.1", "algorithm.mu"),
    ("algorithm=fedadam algorithm.betas=[0.5,0.5]", "algorithm.betas"),
    ("algorithm=localadam algorithm.tau=0.3", "algorithm.tau"),
    ("algorithm=fedlada algorithm.trust_scope=tensor", "algorithm.trust_scope"),
    ("algorithm=fedact algorithm.server_eps=0.1", "algorithm.server_eps"),
    ("algorithm=scaffold algorithm.eps=1e-6", "algorithm.eps"),
    ("algorithm=localadamw algorithm.fused=true", "algorithm.fused"),
])
def test_a_key_the_method_does_not_read_is_rejected(override, key):
    with pytest.raises(ConfigError) as err:
        compose(override)
    assert key in str(err.value) and "does not use" in str(err.value)


@pytest.mark.parametrize("override, key", [
    ("algorithm=fedprox algorithm.mu=-0.1", "algorithm.mu"),
    ("algorithm=fedadam algorithm.server_eps=0", "algorithm.server_eps"),
    ("algorithm=fedadam algorithm.server_betas=[0.9,1.0]", "algorithm.server_betas"),
    ("algorithm=fedadam algorithm.server_betas=[0.9]", "algorithm.server_betas"),
    ("algorithm=fedlada algorithm.eps=0", "algorithm.eps"),
])
def test_new_keys_are_range_checked(override, key):
    with pytest.raises(ConfigError) as err:
        compose(override)
    assert key in str(err.value) and "allowed" in str(err.value)


def test_keys_a_method_reads_can_be_changed():
    algo = compose("algorithm=fedadam algorithm.server_betas=[0.8,0.99] algorithm.lr=0.05").algorithm
    assert algo.server_betas == [0.8, 0.99] and algo.lr == 0.05
    assert compose("algorithm=fedprox algorithm.mu=0.1").algorithm.mu == 0.1
    assert compose("algorithm=fedlada algorithm.rho=0.2").algorithm.rho == 0.2


@pytest.mark.parametrize("name", ["fedact", "fedact_local", "fedadamw"])
@pytest.mark.parametrize("fused", [None, False, True])
def test_the_fedact_family_passes_its_speed_settings_to_the_optimizer(name, fused):
    override = f"algorithm={name}" + ("" if fused is None else f" algorithm.fused={str(fused).lower()}")
    cfg = compose(override + " algorithm.compile=true").algorithm
    optimizer = ALGORITHMS[name].local(cfg).make_optimizer([("w", torch.zeros(3, requires_grad=True))])
    assert optimizer.param_groups[0]["fused"] is fused and optimizer.param_groups[0]["compile"] is True
