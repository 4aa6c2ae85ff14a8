"""Names and ranges, written once: the methods (and the algorithm config keys each reads), the tasks
with their datasets and models, the trust enums, the ranges of the optimizers' hyperparameters,
and the server's aggregation rules with trimmed_mean's trim count. No torch here: the config check
(``fedact_app.config``) and the launcher's early check import this module, and a second matters
there.

``fedact_app.algorithms.ALGORITHMS`` pairs each method name with its client and server rules;
``fedact_app.tasks.base.build_task`` imports a task's class from ``TASKS`` when it is used.
``tests/test_registry.py`` checks that ``conf/``, the model builders, the Llama presets and the
rules agree with the lists here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------- tasks, datasets, models

TASKS = {  # name -> "module:class", imported on use (vision runs never import transformers)
    "vision": "fedact_app.tasks.vision:VisionTask",
    "lm_pretrain": "fedact_app.tasks.language:PretrainTask",
    "sft": "fedact_app.tasks.language:SFTTask",
    "dpo": "fedact_app.tasks.language:DPOTask",
}
VISION_DATASETS = ("digits", "synthetic", "cifar10", "cifar100", "tiny_imagenet", "fashion_mnist")
VISION_MODELS = ("cnn_small", "vit_tiny", "swin_lite", "resnet18")
LLAMA_MODELS = ("llama_60m", "llama_130m", "llama_250m", "llama_tiny")  # fedact_app.tasks.llama.PRESETS
LORA_MODELS = ("lora_causal_lm",)  # a causal LM (model.base) with LoRA adapters (fedact_app.tasks.lora)
TASK_CHOICES = {  # task -> (its datasets, its models): the combinations a config may name
    "vision": (VISION_DATASETS, VISION_MODELS),
    "lm_pretrain": (("c4", "text"), LLAMA_MODELS),
    "sft": (("alpaca_gpt4",), LORA_MODELS),
    "dpo": (("hh_rlhf",), LORA_MODELS),
}
DATASETS = tuple(dict.fromkeys(d for datasets, _ in TASK_CHOICES.values() for d in datasets))
MODELS = tuple(dict.fromkeys(m for _, models in TASK_CHOICES.values() for m in models))
BUILTIN_DATASETS = ("digits", "synthetic")  # made in the process: no files, dataset.path does not apply
FILE_DATASETS = tuple(d for d in DATASETS if d not in BUILTIN_DATASETS)  # may be read from dataset.path / data-path

# ---------------------------------------------------------------- the methods

TRUST_SCOPES = ("global", "tensor")  # one top-k over all coordinates | a top-k per tensor
TRUST_SIGNALS = ("corrected", "local", "none")  # s = u * g | s = u_loc * g | phi = 1 (FedAdamW)
WEIGHTINGS = ("uniform", "examples")  # the server's weights w_i

# ---------------------------------------------------------------- the server's aggregation

AGGREGATIONS = ("mean", "trimmed_mean", "median")  # how the server combines replies (fedact_app.aggregation)
TRIM_FRACTION = 0.2  # trimmed_mean's default trim (Flower's FedTrimmedAvg default beta)
# the round-relative bounds on a reply (fedact_app.replies): its v's norm, its update's norm, at
# most this many times the round's lower median (docs/ROBUSTNESS.md has how the update bound was chosen)
MAX_MOMENT_RATIO = 1e6
MAX_UPDATE_RATIO = 10.0
# the dtypes a reply's floating arrays may travel in (reply_dtype; fedact_app.wire): float16 would
# overflow second moments above 65504
REPLY_DTYPES = ("float32", "bfloat16")


def trim_count(size: int, trim_fraction: float) -> int:
    """k = ceil(trim_fraction * size), the values trimmed_mean drops at each end of a coordinate
    (it needs size > 2k). The product is rounded to 9 decimals first: 0.3 * 10 is
    3.0000000000000004 in floating point, and k must be 3."""
    return math.ceil(round(trim_fraction * size, 9))


@dataclass(frozen=True)
class MethodSpec:
    """The algorithm config keys a method reads and the values it fixes. Config validation rejects
    a key the method does not read unless it is left at its schema default, so no setting is
    ignored silently."""

    uses: frozenset[str]
    required: Mapping[str, Any] = field(default_factory=dict)


_COMMON = frozenset({"lr", "lr_min", "weight_decay", "server_lr", "weighting"})
_ADAM = frozenset({"betas", "eps"})
_TRUST = frozenset({"rho", "tau", "alpha", "gamma", "trust_scope", "trust_signal", "scale_matched",
                    "fused", "compile"})
_FEDACT = _COMMON | _ADAM | _TRUST

METHODS: dict[str, MethodSpec] = {
    "fedavg": MethodSpec(_COMMON),
    "fedprox": MethodSpec(_COMMON | {"mu"}),
    "scaffold": MethodSpec(_COMMON),
    "fedadam": MethodSpec(_COMMON | {"server_betas", "server_eps"}),
    "localadam": MethodSpec(_COMMON | _ADAM),
    "localadamw": MethodSpec(_COMMON | _ADAM),
    "fedlada": MethodSpec(_COMMON | _ADAM | {"rho"}),
    # FedAdamW reads (and validates) the trust keys too, but with phi = 1 they change nothing.
    "fedadamw": MethodSpec(_FEDACT, {"trust_signal": "none"}),
    "fedact_local": MethodSpec(_FEDACT, {"trust_signal": "local"}),
    "fedact": MethodSpec(_FEDACT, {"trust_signal": "corrected"}),
}
# the methods whose client optimizer is FedACTAdamW
FEDACT_FAMILY = tuple(name for name, spec in METHODS.items() if spec.uses == _FEDACT)

# ---------------------------------------------------------------- hyperparameter ranges


def _nonnegative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def _betas(value: Any) -> bool:
    return (isinstance(value, (tuple, list)) and len(value) == 2
            and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in value))


RANGES: dict[str, tuple[Any, str]] = {  # name -> (predicate, what is allowed)
    "lr": (_nonnegative, ">= 0"),
    "eps": (_nonnegative, ">= 0"),
    "weight_decay": (_nonnegative, ">= 0"),
    "mu": (_nonnegative, ">= 0"),
    "betas": (_betas, "two values (beta1, beta2), each in [0, 1)"),
    "rho": (lambda v: isinstance(v, (int, float)) and 0 <= v <= 1, "in [0, 1]"),
    "tau": (lambda v: isinstance(v, (int, float)) and 0 < v <= 1, "in (0, 1]"),
    "gamma": (_nonnegative, ">= 0"),
    "trust_scope": (lambda v: v in TRUST_SCOPES, "one of " + ", ".join(TRUST_SCOPES)),
    "trust_signal": (lambda v: v in TRUST_SIGNALS, "one of " + ", ".join(TRUST_SIGNALS)),
}


def hyperparameter_errors(**values: Any) -> list[tuple[str, Any, str]]:
    """(name, value, allowed) for each value outside ``RANGES`` (NaN fails every range), and for
    an ``alpha`` below ``gamma`` when both are given; [] when all are allowed. The optimizers
    raise on the first (torch's convention: lr = 0 and eps = 0 are allowed there); the config
    check adds a run's own stricter rules (lr > 0, eps > 0, finite values)."""
    errors = [(name, value, RANGES[name][1]) for name, value in values.items()
              if name in RANGES and not RANGES[name][0](value)]
    alpha, gamma = values.get("alpha"), values.get("gamma")
    if alpha is not None and gamma is not None and not (isinstance(alpha, (int, float)) and alpha >= gamma):
        errors.append(("alpha", alpha, f">= gamma ({gamma})"))
    unknown = set(values) - set(RANGES) - {"alpha"}
    if unknown:
        raise KeyError(f"no range for {sorted(unknown)}; known: {sorted(RANGES)} and alpha")
    return errors


def require_hyperparameters(**values: Any) -> None:
    """An optimizer's constructor check: ValueError naming the first value outside its range
    (``hyperparameter_errors``) and what is allowed."""
    for name, value, allowed in hyperparameter_errors(**values):
        raise ValueError(f"Invalid {name}: {value!r}; expected {name} {allowed}")
