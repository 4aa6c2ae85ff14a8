"""The registry is the one list of names and ranges: conf/, the model builders, the Llama presets,
the rules and the tasks agree with it, and importing the config check imports no torch."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedact_app import registry
from fedact_app.registry import hyperparameter_errors

CONF = Path(__file__).resolve().parents[1] / "conf"


def conf_names(group: str) -> set[str]:
    return {yaml.safe_load(path.read_text())["name"] for path in (CONF / group).glob("*.yaml")}


def test_conf_groups_name_exactly_the_registrys_methods_datasets_and_models():
    assert conf_names("algorithm") == set(registry.METHODS)
    assert conf_names("dataset") == set(registry.DATASETS)
    assert conf_names("model") == set(registry.MODELS)


def test_builders_presets_rules_and_tasks_agree_with_the_registry():
    from fedact_app.algorithms import ALGORITHMS, RULES
    from fedact_app.tasks.vision.models import MODELS as VISION_BUILDERS
    from fedact_app.tasks.llama import PRESETS

    assert set(VISION_BUILDERS) == set(registry.VISION_MODELS)
    assert set(PRESETS) == set(registry.LLAMA_MODELS)
    assert set(RULES) == set(registry.METHODS) == set(ALGORITHMS)
    for name, path in registry.TASKS.items():
        module, _, cls = path.partition(":")
        assert isinstance(getattr(importlib.import_module(module), cls), type), name
    assert set(registry.FILE_DATASETS) | set(registry.BUILTIN_DATASETS) == set(registry.DATASETS)
    from fedact_app.algorithms import FedACTLocal
    assert set(registry.FEDACT_FAMILY) == {n for n, a in ALGORITHMS.items() if a.local is FedACTLocal} == {
        "fedact", "fedadamw", "fedact_local"}


def test_importing_the_config_check_imports_no_torch():
    code = "import sys, fedact_app.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("values, expected", [
    ({"lr": 0.0, "eps": 0.0, "weight_decay": 0.0, "mu": 0.0}, []),  # torch's convention: zeros allowed
    ({"lr": -1e-3}, [("lr", -1e-3, ">= 0")]),
    ({"lr": float("nan")}, ["lr"]),
    ({"betas": (0.9, 1.0)}, ["betas"]),
    ({"betas": (0.9,)}, ["betas"]),
    ({"rho": 1.0, "tau": 1.0}, []),
    ({"rho": 1.01, "tau": 0.0}, ["rho", "tau"]),
    ({"gamma": -0.1}, ["gamma"]),
    ({"alpha": 0.4, "gamma": 0.5}, [("alpha", 0.4, ">= gamma (0.5)")]),
    ({"alpha": 0.5, "gamma": 0.5}, []),
    ({"trust_scope": "layer", "trust_signal": "none"}, ["trust_scope"]),
])
def test_hyperparameter_ranges(values, expected):
    errors = hyperparameter_errors(**values)
    if expected and isinstance(expected[0], str):
        assert [name for name, _, _ in errors] == expected
    else:
        assert errors == expected


def test_a_hyperparameter_without_a_range_is_a_programming_error():
    with pytest.raises(KeyError, match="no range for"):
        hyperparameter_errors(learning_rate=0.1)
