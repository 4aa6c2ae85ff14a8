"""The server's combination rules (fedact_app.aggregation) against plain loops written here: per
coordinate, sort the clients' values in Python and take the middle or the trimmed mean; and every
method's server rule fed through them (fedact_app.algorithms)."""

import math
import statistics

import pytest
import torch

from fedact_app.aggregation import (SORTING_NETWORK_MAX, Aggregation, client_weights, coordinate_median,
                                    sorted_values, trimmed_mean, weighted_mean)
from fedact_app.algorithms import ALGORITHMS, ClientUpdate
from fedact_app.config import AlgorithmConfig, ConfigError, compose
from fedact_app.registry import trim_count


def per_coordinate(tensors, reduce):
    """``reduce`` (a function of a list of floats) applied coordinate by coordinate, in float64."""
    flat = [t.double().flatten().tolist() for t in tensors]
    out = [reduce([values[j] for values in flat]) for j in range(len(flat[0]))]
    return torch.tensor(out, dtype=torch.float64).reshape(tensors[0].shape)


def loop_median(values):
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def loop_trimmed_mean(fraction):
    def reduce(values):
        values = sorted(values)
        k = math.ceil(round(fraction * len(values), 9))
        kept = values[k:len(values) - k]
        return sum(kept) / len(kept)
    return reduce


def clients(count, shape=(4, 3), seed=0, ties=False):
    gen = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: many coordinates hold equal values at the trim's edge
        return [torch.randint(-2, 3, shape, generator=gen).double() for _ in range(count)]
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(count)]


# ---------------------------------------------------------------- the rules on tensors


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 10, 33, 34])  # 33, 34: torch.sort instead of the network
@pytest.mark.parametrize("ties", [False, True])
def test_median_is_the_middle_value_or_the_mean_of_the_two_middle_ones(count, ties):
    tensors = clients(count, ties=ties, seed=count)
    torch.testing.assert_close(coordinate_median(tensors), per_coordinate(tensors, loop_median), rtol=0, atol=0)
    assert torch.equal(per_coordinate(tensors, loop_median), per_coordinate(tensors, statistics.median))


@pytest.mark.parametrize("count, fraction, dropped", [(3, 0.2, 1), (5, 0.1, 1), (5, 0.2, 1), (5, 0.4, 2),
                                                      (10, 0.1, 1), (10, 0.2, 2), (10, 0.3, 3), (7, 0.25, 2),
                                                      (40, 0.2, 8)])
@pytest.mark.parametrize("ties", [False, True])
def test_trimmed_mean_drops_ceil_fraction_times_count_at_each_end(count, fraction, dropped, ties):
    assert trim_count(count, fraction) == dropped  # 0.3 x 10 = 3.0000000000000004 in floats: still 3
    tensors = clients(count, ties=ties, seed=count)
    torch.testing.assert_close(trimmed_mean(tensors, fraction), per_coordinate(tensors, loop_trimmed_mean(fraction)),
                               rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("count, fraction", [(1, 0.2), (2, 0.2), (2, 0.1), (4, 0.4), (5, 0.45)])
def test_trimmed_mean_refuses_fewer_replies_than_its_trim_needs(count, fraction):
    k = trim_count(count, fraction)
    with pytest.raises(ValueError, match=rf"drops ceil\({fraction:g} x {count}\) = {k} of {count} replies "
                                         rf"at each end .* needs more than {2 * k}"):
        trimmed_mean(clients(count), fraction)


@pytest.mark.parametrize("count", [2, 7, SORTING_NETWORK_MAX, SORTING_NETWORK_MAX + 1])
def test_sorted_values_sorts_every_coordinate_exactly(count):
    tensors = clients(count - 1, ties=True, seed=count) + clients(1, seed=count)  # ties and distinct values
    result = [t.flatten().tolist() for t in sorted_values(tensors)]
    flat = [t.flatten().tolist() for t in tensors]
    for j in range(len(flat[0])):
        assert [values[j] for values in result] == sorted(values[j] for values in flat)


def test_one_huge_client_moves_the_mean_but_not_the_robust_rules():
    honest = [torch.full((3,), v, dtype=torch.float64) for v in (1.0, 1.1, 0.9, 1.05)]
    forged = honest + [torch.full((3,), 1e4, dtype=torch.float64)]
    assert float(weighted_mean(forged, [0.2] * 5)[0]) > 1000
    assert float(coordinate_median(forged)[0]) == 1.05
    assert float(trimmed_mean(forged, 0.2)[0]) == pytest.approx((1.0 + 1.1 + 1.05) / 3)


def test_client_weights():
    assert client_weights([1, 3], "uniform") == [0.5, 0.5]
    assert client_weights([1, 3], "examples") == [0.25, 0.75]
    with pytest.raises(ValueError, match="weighting"):
        client_weights([1, 3], "median")


def test_combine_dicts_rounds_integer_entries_for_every_rule():
    arrays = [{"n": torch.tensor([1, 2])}, {"n": torch.tensor([2, 4])}]
    assert Aggregation().combine_dicts(arrays, [0.5, 0.5])["n"].tolist() == [2, 3]  # round(1.5)=2, round(3)=3
    arrays.append({"n": torch.tensor([4, 9])})
    assert Aggregation("median").combine_dicts(arrays, [1 / 3] * 3)["n"].tolist() == [2, 4]
    combined = Aggregation("trimmed_mean", 0.2).combine_dicts(arrays, [1 / 3] * 3)["n"]
    assert combined.dtype == torch.int64 and combined.tolist() == [2, 4]


def test_the_mean_with_divisors_is_the_weighted_sum_of_the_quotients_and_robust_rules_are_unweighted():
    tensors, divisors = clients(3), [0.5, -2.0, 4.0]
    expected = sum(w / d * t for w, d, t in zip([0.2, 0.3, 0.5], divisors, tensors))
    torch.testing.assert_close(Aggregation().combine(tensors, [0.2, 0.3, 0.5], divisors), expected)
    quotients = [t / d for t, d in zip(tensors, divisors)]
    torch.testing.assert_close(Aggregation("median").combine(tensors, [1 / 3] * 3, divisors),
                               per_coordinate(quotients, loop_median), rtol=0, atol=0)
    with pytest.raises(ValueError, match="aggregation=median is unweighted"):
        Aggregation("median").combine(tensors, [0.2, 0.3, 0.5])


@pytest.mark.parametrize("rule, fraction", [("max", 0.2), ("mean", 0.5), ("trimmed_mean", 0.0)])
def test_a_bad_rule_or_trim_is_refused(rule, fraction):
    with pytest.raises(ValueError, match="Invalid"):
        Aggregation(rule, fraction)


# ---------------------------------------------------------------- every method's server rule


def update(delta, arrays, lr_sum=0.5):
    return ClientUpdate(delta=delta, num_steps=5, lr_sum=lr_sum, num_examples=10, arrays=arrays)


@pytest.mark.parametrize("rule, reduce", [("median", loop_median), ("trimmed_mean", loop_trimmed_mean(0.2))])
def test_fedact_combines_delta_v_and_delta_g_by_the_rule(rule, reduce):
    """x^{r+1} = x^r + server_lr agg(Delta_i); Delta_G = -agg(Delta_i / lr_sum_i); v_bar = agg(v_i)."""
    deltas, vs = clients(5, seed=1), [t.abs() for t in clients(5, seed=2)]
    lr_sums = [0.5, 0.5, 0.25, 1.0, 0.5]
    updates = [update({"w": d, "n": torch.tensor(i)}, {"v": {"w": v}}, s)
               for i, (d, v, s) in enumerate(zip(deltas, vs, lr_sums))]
    server = ALGORITHMS["fedact"].server(AlgorithmConfig(name="fedact", server_lr=0.5), ["w"],
                                         aggregation=Aggregation(rule))
    x = {"w": torch.zeros(4, 3, dtype=torch.float64), "n": torch.tensor(7)}
    new_x = server.aggregate(x, updates)
    torch.testing.assert_close(new_x["w"], 0.5 * per_coordinate(deltas, reduce), rtol=1e-15, atol=1e-15)
    assert new_x["n"].item() == 7 + 2  # the buffer: agg(0..4) = 2, no server_lr
    corrections = [-d / s for d, s in zip(deltas, lr_sums)]
    torch.testing.assert_close(server.delta_g["w"], per_coordinate(corrections, reduce), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(server.v_bar["w"], per_coordinate(vs, reduce), rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("rule, reduce", [("median", loop_median), ("trimmed_mean", loop_trimmed_mean(0.2))])
def test_scaffold_and_fedadam_combine_their_arrays_by_the_rule(rule, reduce):
    deltas, controls = clients(4, seed=3), clients(4, seed=4)
    scaffold = ALGORITHMS["scaffold"].server(AlgorithmConfig(name="scaffold"), ["w"], num_clients=8,
                                             aggregation=Aggregation(rule))
    x = {"w": torch.zeros(4, 3, dtype=torch.float64)}
    new_x = scaffold.aggregate(x, [update({"w": d}, {"delta_c": {"w": c}}) for d, c in zip(deltas, controls)])
    torch.testing.assert_close(new_x["w"], per_coordinate(deltas, reduce), rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(scaffold.c["w"], 4 / 8 * per_coordinate(controls, reduce), rtol=1e-15, atol=1e-15)
    cfg = compose(["algorithm=fedadam"]).algorithm
    fedadam = ALGORITHMS["fedadam"].server(cfg, ["w"], aggregation=Aggregation(rule))
    new_x = fedadam.aggregate(x, [update({"w": d}, {}) for d in deltas])
    d = per_coordinate(deltas, reduce)
    b1, b2 = cfg.server_betas
    m, v = (1 - b1) * d, b2 * cfg.server_eps ** 2 + (1 - b2) * d ** 2
    torch.testing.assert_close(new_x["w"], cfg.server_lr * m / (v.sqrt() + cfg.server_eps), rtol=1e-12, atol=1e-15)


def test_a_rule_with_too_few_updates_for_its_trim_refuses_them():
    server = ALGORITHMS["fedavg"].server(AlgorithmConfig(name="fedavg"), ["w"],
                                         aggregation=Aggregation("trimmed_mean", 0.2))
    with pytest.raises(ValueError, match="needs more than 2"):
        server.aggregate({"w": torch.zeros(2)}, [update({"w": torch.ones(2)}, {})] * 2)


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize("overrides, key, allowed", [
    ("aggregation=max", "aggregation", "one of mean, trimmed_mean, median"),
    ("aggregation=trimmed_mean trim_fraction=0.5", "trim_fraction", "in (0, 0.5)"),
    ("aggregation=trimmed_mean trim_fraction=0", "trim_fraction", "in (0, 0.5)"),
    # 5 clients a round (10 x 0.5): ceil(0.45 x 5) = 3 at each end leaves none
    ("aggregation=trimmed_mean trim_fraction=0.45", "trim_fraction", "in (0, 0.4] for the 5 clients a round samples"),
    # 2 clients a round can never be trimmed
    ("aggregation=trimmed_mean num_clients=4", "aggregation", "mean or median when a round samples fewer than 3"),
    ("aggregation=median algorithm.weighting=examples", "algorithm.weighting", "uniform with aggregation=median"),
    ("aggregation=median trim_fraction=0.3", "trim_fraction", "only the default 0.2 with aggregation=median"),
    ("trim_fraction=0.3", "trim_fraction", "only the default 0.2 with aggregation=mean"),
])
def test_an_aggregation_the_sample_can_never_allow_fails_at_config_time(overrides, key, allowed):
    with pytest.raises(ConfigError) as err:
        compose(overrides.split())
    assert str(err.value).startswith(f"Invalid config value {key}=") and allowed in str(err.value)


def test_robust_aggregations_compose():
    cfg = compose(["aggregation=trimmed_mean", "trim_fraction=0.3", "num_clients=10", "fraction_train=1.0"])
    assert (cfg.aggregation, cfg.trim_fraction) == ("trimmed_mean", 0.3)
    assert compose(["aggregation=median", "num_clients=2", "min_train_nodes=1"]).aggregation == "median"
