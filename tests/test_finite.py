"""NaN/inf detection (fedact_app.finite), against entries built to catch a sum-only check."""

import pytest
import torch

from fedact_app.finite import all_finite, describe_names, non_finite


@pytest.mark.parametrize("values, dtype, finite", [
    ([1.0, -2.0, 0.0], torch.float32, True),
    ([1.0, float("inf")], torch.float32, False),
    ([float("-inf"), 1.0], torch.float32, False),
    ([float("inf"), float("-inf")], torch.float32, False),  # the sum is NaN
    ([1.0, float("nan")], torch.float32, False),
    ([3e38, 3e38, -1.0], torch.float32, True),  # finite entries whose float32 sum overflows
    ([1.7e308, 1.7e308], torch.float64, True),
    ([60000.0, 60000.0], torch.float16, True),  # beyond float16's largest value, 65504, when summed
    ([60000.0, float("nan")], torch.bfloat16, False),
    ([], torch.float32, True),
])
def test_all_finite_checks_every_entry(values, dtype, finite):
    assert all_finite(torch.tensor(values, dtype=dtype)) is finite


def test_non_finite_names_the_floating_tensors_holding_nan_or_inf():
    tensors = {"b": torch.tensor([1.0, float("inf")]), "a": torch.tensor([float("nan")]),
               "ok": torch.ones(3), "count": torch.tensor(7)}
    assert non_finite(tensors) == ["a", "b"]
    assert describe_names([str(i) for i in range(7)]) == "['0', '1', '2', '3', '4'] and 2 more"
