"""Typed run configuration and the one ``compose()`` entry point.

The dataclasses below are the schema: they are registered in Hydra's ConfigStore and every YAML
file under ``conf/`` is merged into them, so an unknown key or a value of the wrong type fails at
composition with Hydra's message naming the key. Range checks live in each dataclass's
``__post_init__`` and run when ``compose()`` turns the DictConfig into these objects, before any
training starts. The ServerApp, every ClientApp and the scripts call the same ``compose()``.
"""

from __future__ import annotations

import math
import re
import shlex
import threading
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf

from fedact_app.registry import (AGGREGATIONS, BUILTIN_DATASETS, DATASETS, FEDACT_FAMILY, LORA_MODELS,
                                 MAX_MOMENT_RATIO, MAX_UPDATE_RATIO, METHODS, MODELS, REPLY_DTYPES, TASK_CHOICES,
                                 TASKS, TRIM_FRACTION, WEIGHTINGS, hyperparameter_errors, trim_count)
from fedact_app.sampling import sample_count

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

PARTITIONS = ("iid", "dirichlet")
DEVICES = ("auto", "cuda", "cpu")
PRECISIONS = ("fp32", "bf16")
WIRE_DTYPES = ("float32", "bfloat16", "float16")
COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")


class ConfigError(ValueError):
    """A configuration value is out of its allowed range."""


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"Invalid config value {key}={value!r}: allowed {allowed}")


def _require_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    _require(value in choices, key, value, "one of " + ", ".join(choices))


def _require_finite(section: Any, prefix: str) -> None:
    """Every float field of the dataclass ``section``, and every float in its list fields, must be
    finite: inf passes range checks such as ``> 0`` and nan makes every comparison false, and
    either value only makes every round fail. Nested sections check themselves."""
    for f in fields(section):
        value = getattr(section, f.name)
        items = value if isinstance(value, list) else [value]
        _require(all(math.isfinite(v) for v in items if isinstance(v, float)), f"{prefix}{f.name}", value,
                 "finite numbers" if isinstance(value, list) else "a finite number")


@dataclass
class DatasetConfig:
    """What data is trained on (``conf/dataset/*.yaml``)."""

    name: str = "digits"
    hub_path: Optional[str] = None  # Hugging Face hub id, e.g. uoft-cs/cifar10
    path: Optional[str] = None  # local parquet file/folder or image folder; replaces hub_path
    image_column: str = "image"
    label_column: str = "label"
    train_split: str = "train"
    test_split: str = "test"
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    augment: bool = True  # train only: random crop (pad image_size // 8) + horizontal flip
    num_train: int = 2000  # synthetic only
    num_test: int = 500  # synthetic only
    hub_config: Optional[str] = None  # language: the hub dataset's config name (c4: en)
    validation_fraction: float = 0.05  # language, local data: every round(1/f)-th document/record held out
    # vision: this fraction of the training split (seed-fixed rows, removed before partitioning) is
    # the server's evaluation set instead of the test split, its metrics named val_*; 0 = off
    # (tuning scores on it: scripts/tune.py)
    holdout_fraction: float = 0.0

    def __post_init__(self) -> None:
        _require_finite(self, "dataset.")
        _require_choice("dataset.name", self.name, DATASETS)
        _require(0 < self.validation_fraction < 1, "dataset.validation_fraction", self.validation_fraction,
                 "in (0, 1)")
        _require(0 <= self.holdout_fraction < 1, "dataset.holdout_fraction", self.holdout_fraction,
                 "in [0, 1) (0 = off)")
        _require(self.name != "text" or bool(self.path), "dataset.path", self.path,
                 "a local .txt file or folder of *.txt files for dataset=text")
        file_datasets = ", ".join(d for d in DATASETS if d not in BUILTIN_DATASETS)
        _require(self.path is None or self.name not in BUILTIN_DATASETS, "dataset.path", self.path,
                 f"null for dataset={self.name}, which is built in and reads no files; to train on "
                 f"your files choose the dataset they hold (one of {file_datasets}) with dataset.path")
        _require(self.num_classes >= 2, "dataset.num_classes", self.num_classes, ">= 2")
        _require(self.image_size >= 1, "dataset.image_size", self.image_size, ">= 1")
        _require(self.channels in (1, 3), "dataset.channels", self.channels, "1 or 3")
        for key, stats in (("dataset.mean", self.mean), ("dataset.std", self.std)):
            _require(len(stats) == self.channels, key, stats, f"{self.channels} values (one per channel)")
        _require(all(s > 0 for s in self.std), "dataset.std", self.std, "values > 0")
        _require(self.num_train >= 1, "dataset.num_train", self.num_train, ">= 1")
        _require(self.num_test >= 1, "dataset.num_test", self.num_test, ">= 1")


@dataclass
class LoraModelConfig:
    """LoRA adapters of ``model=lora_causal_lm`` (fedact_app.tasks.lora): update (alpha/rank) B A."""

    rank: int = 8
    alpha: float = 16.0  # the seed's "scaling factor"
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])

    def __post_init__(self) -> None:
        _require_finite(self, "model.lora.")
        _require(self.rank >= 1, "model.lora.rank", self.rank, ">= 1")
        _require(self.alpha > 0, "model.lora.alpha", self.alpha, "> 0")
        _require(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "in [0, 1)")
        _require(len(self.target_modules) >= 1, "model.lora.target_modules", self.target_modules,
                 "at least one module name")


@dataclass
class ModelConfig:
    """What is trained (``conf/model/*.yaml``); ``kwargs`` go to the model's builder in models.py
    (vision). Language models: ``tokenizer`` (null: the base's own, or ``t5-base`` / ``bytes`` for
    the Llama presets), ``base`` and ``lora`` (``lora_causal_lm`` only)."""

    name: str = "cnn_small"
    kwargs: dict[str, Any] = field(default_factory=dict)
    tokenizer: Optional[str] = None  # language: "bytes", a trained BPE .json, a hub name or local folder
    base: Optional[str] = None  # lora_causal_lm: hub name, local folder or a Llama preset (llama_tiny)
    lora: LoraModelConfig = field(default_factory=LoraModelConfig)

    def __post_init__(self) -> None:
        _require_choice("model.name", self.name, MODELS)
        _require(self.name not in LORA_MODELS or bool(self.base), "model.base", self.base,
                 f"a hub name, local folder or Llama preset for model={self.name}")


@dataclass
class LanguageConfig:
    """Settings of the language tasks (``task=lm_pretrain|sft|dpo``; docs/LANGUAGE.md)."""

    seq_len: int = 1024  # lm_pretrain: tokens per packed training/validation sequence
    max_length: int = 512  # sft/dpo: tokens per sequence (prompt + response), cut on the right
    max_prompt_length: int = 256  # dpo: prompt tokens kept (its last ones) when a pair is too long
    eval_batches: int = 16  # held-out batches (of batch_size sequences or pairs) the server evaluates
    dpo_beta: float = 0.1  # dpo: implicit reward r = beta (log pi - log ref)

    def __post_init__(self) -> None:
        _require_finite(self, "language.")
        _require(self.seq_len >= 2, "language.seq_len", self.seq_len, ">= 2")
        _require(self.max_length >= 2, "language.max_length", self.max_length, ">= 2")
        _require(self.max_prompt_length >= 1, "language.max_prompt_length", self.max_prompt_length, ">= 1")
        _require(self.eval_batches >= 1, "language.eval_batches", self.eval_batches, ">= 1")
        _require(self.dpo_beta > 0, "language.dpo_beta", self.dpo_beta, "> 0")


@dataclass
class PartitionConfig:
    """How the training set is split over clients (``conf/partition/*.yaml``)."""

    name: str = "iid"
    alpha: float = 0.6  # Dirichlet concentration (dirichlet only)
    min_partition_size: int = 0  # dirichlet: resample until every client has at least this many

    def __post_init__(self) -> None:
        _require_finite(self, "partition.")
        _require_choice("partition.name", self.name, PARTITIONS)
        _require(self.alpha > 0, "partition.alpha", self.alpha, "> 0")
        _require(self.min_partition_size >= 0, "partition.min_partition_size", self.min_partition_size, ">= 0")


@dataclass
class AlgorithmConfig:
    """The federated method and its hyperparameters (``conf/algorithm/*.yaml``).

    ``lr`` (the local learning rate) decays over rounds by a cosine to ``lr_min`` and is constant
    inside a round. ``alpha``/``gamma`` null mean the seed's defaults 1/tau and tau. Each method
    reads only some keys (``fedact_app.registry.METHODS[name].uses``; docs/METHODS.md lists them); a key it does not
    read must stay at the default below, so nothing set by a user is ignored silently.
    """

    name: str = "fedact"
    lr: float = 3e-4
    lr_min: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    rho: float = 0.5
    tau: float = 0.5
    alpha: Optional[float] = None
    gamma: Optional[float] = None
    trust_scope: str = "global"
    trust_signal: str = "corrected"
    scale_matched: bool = False
    mu: float = 0.0  # FedProx proximal coefficient (mu/2)||x - x^r||^2
    server_lr: float = 1.0
    server_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # FedAdam server Adam
    server_eps: float = 1e-3  # FedAdam adaptivity tau (Reddi et al. 2021)
    weighting: str = "uniform"
    compile: bool = False  # FedACT family: torch.compile the optimizer's fused passes (fedact_app/optim/kernels.py)
    fused: Optional[bool] = None  # FedACT family: torch's fused AdamW/SGD kernels; None: on for CPU and CUDA (fedact_app/optim/kernels.py)

    def __post_init__(self) -> None:
        _require_finite(self, "algorithm.")
        _require_choice("algorithm.name", self.name, tuple(METHODS))
        method = METHODS[self.name]
        for key, value in method.required.items():
            _require(getattr(self, key) == value, f"algorithm.{key}", getattr(self, key),
                     f"{value!r} for algorithm {self.name} (choose another algorithm instead)")
        self._require_unused_at_default(method.uses)
        # a run's own rules, stricter than the optimizers' ranges (fedact_app.registry.RANGES):
        # lr = 0 trains nothing, and every method that reads eps divides by it (Adam's
        # m / (sqrt(v) + eps), where v = 0 for a coordinate without gradient; FedLADA's v_hat
        # floor eps^2); the others keep the default
        _require(self.lr > 0, "algorithm.lr", self.lr, "> 0")
        _require(0 <= self.lr_min <= self.lr, "algorithm.lr_min", self.lr_min, f"in [0, lr={self.lr}]")
        _require(self.eps > 0, "algorithm.eps", self.eps, "> 0")
        self._require_ranges(betas=self.betas, weight_decay=self.weight_decay, rho=self.rho, tau=self.tau)
        self._require_ranges(gamma=self.tau if self.gamma is None else self.gamma,
                             alpha=1.0 / self.tau if self.alpha is None else self.alpha,
                             trust_scope=self.trust_scope, trust_signal=self.trust_signal, mu=self.mu)
        _require(self.server_lr > 0, "algorithm.server_lr", self.server_lr, "> 0")
        _require(len(self.server_betas) == 2, "algorithm.server_betas", self.server_betas,
                 "two values [beta1, beta2]")
        _require(all(0 <= b < 1 for b in self.server_betas), "algorithm.server_betas",
                 self.server_betas, "each in [0, 1)")
        _require(self.server_eps > 0, "algorithm.server_eps", self.server_eps, "> 0")
        _require_choice("algorithm.weighting", self.weighting, WEIGHTINGS)

    @staticmethod
    def _require_ranges(**values: Any) -> None:
        """The optimizers' own ranges (``fedact_app.registry.hyperparameter_errors``)."""
        for name, value, allowed in hyperparameter_errors(**values):
            _require(False, f"algorithm.{name}", value, allowed)

    def _require_unused_at_default(self, uses: frozenset[str]) -> None:
        """A key the method does not read must keep its schema default (else it would be ignored)."""
        for f in fields(self):
            if f.name == "name" or f.name in uses:
                continue
            default = f.default if f.default is not MISSING else f.default_factory()
            _require(getattr(self, f.name) == default, f"algorithm.{f.name}", getattr(self, f.name),
                     f"only the default {default!r}: algorithm {self.name} does not use "
                     f"{f.name} (it uses {', '.join(sorted(uses))})")


@dataclass
class DebugConfig:
    """Fault injection for testing failure handling (off by default): the ClientApp of every
    partition in ``fail_partitions`` raises ``InjectedFault`` in each round of ``fail_rounds``;
    with ``hang_seconds > 0`` it instead sleeps that many seconds before training (a hung or very
    slow client: tests of ``round_timeout``), then trains and replies as usual."""

    fail_partitions: list[int] = field(default_factory=list)
    fail_rounds: list[int] = field(default_factory=list)
    hang_seconds: float = 0.0

    def __post_init__(self) -> None:
        _require_finite(self, "debug.")
        _require(self.hang_seconds >= 0, "debug.hang_seconds", self.hang_seconds,
                 ">= 0 (0 = raise instead of hanging)")


@dataclass
class DiagnosticsConfig:
    """The seed's mechanism diagnostics (Appendix A; fedact_app.diagnostics) in metrics.jsonl.

    Direction consistency and ||Delta_G|| are computed on the server every round. Clients compute
    the positive score ratio, the top-p score mass and the amplified fraction every
    ``trust_every``-th local step (0 = off); they never change training."""

    trust_every: int = 10
    top_p: float = 0.01

    def __post_init__(self) -> None:
        _require_finite(self, "diagnostics.")
        _require(self.trust_every >= 0, "diagnostics.trust_every", self.trust_every, ">= 0 (0 = off)")
        _require(0 < self.top_p <= 1, "diagnostics.top_p", self.top_p, "in (0, 1]")


@dataclass
class Config:
    """A whole run (``conf/config.yaml`` plus the groups)."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    language: LanguageConfig = field(default_factory=LanguageConfig)
    task: str = "vision"  # what is trained (fedact_app.registry.TASKS)
    num_rounds: int = 5
    num_clients: int = 10
    fraction_train: float = 0.5
    min_train_nodes: int = 2
    fraction_evaluate: float = 0.0  # federated evaluation on clients' local test data; 0 = off
    local_steps: int = 10
    batch_size: int = 32
    seed: int = 42
    device: str = "auto"
    precision: str = "fp32"  # bf16: forward/backward under torch.autocast(bfloat16); weights stay fp32
    channels_last: bool = False  # CNNs: model and batches in channels_last memory format
    compile_model: str = "none"  # vision: torch.compile mode of the clients' training forward/backward; none = eager
    # a machine's training messages of a round trained at once by one process (fedact_app.client_batch); FedACT family
    client_batch: bool = False
    client_batch_wait: float = 0.5  # seconds without a new message after which that process trains the ones it has
    wire_dtype: str = "float32"  # dtype of the server's broadcast arrays (v_bar, Delta_G, c) on the wire
    reply_dtype: str = "float32"  # dtype of the clients' reply arrays (delta, v, c's change) on the wire
    eval_every: int = 1  # centralized test-set evaluation every n rounds (and at the last)
    eval_batch_size: int = 500
    round_timeout: float = 3600.0  # seconds the server waits for a round's replies
    max_empty_rounds: int = 3  # stop the run after this many consecutive rounds with no usable reply
    max_update_norm: Optional[float] = None  # reject replies whose delta's L2 norm exceeds it; null = off
    # reject a second moment whose norm is this x above or below the round's (and v_bar's) lower median; 0 = off
    max_moment_ratio: float = MAX_MOMENT_RATIO
    max_update_ratio: float = MAX_UPDATE_RATIO  # reject an update whose norm exceeds this x the round's median; 0 = off
    aggregation: str = "mean"  # how the server combines replies: mean | trimmed_mean | median (fedact_app.aggregation)
    trim_fraction: float = TRIM_FRACTION  # trimmed_mean: drop ceil(trim_fraction x S) replies at each end
    server_device: str = "auto"  # ServerApp checks, aggregation: auto (cpu if device=cpu, else a GPU) | cpu | cuda
    checkpoint_every: int = 0  # write a checkpoint every n rounds; 0 = only after the last round
    keep_checkpoints: int = 2  # the newest checkpoints kept in <run folder>/checkpoints
    resume: Optional[str] = None  # continue from a checkpoint file, or a run folder's newest one
    output_dir: str = "outputs"
    tensorboard: bool = True  # TensorBoard scalars in <run folder>/tensorboard when tensorboard is installed
    data_dir: Optional[str] = None  # Hugging Face datasets cache; default: HF_DATASETS_CACHE

    def __post_init__(self) -> None:
        _require_finite(self, "")
        for key in ("num_rounds", "num_clients", "min_train_nodes", "local_steps", "batch_size",
                    "eval_every", "eval_batch_size", "max_empty_rounds"):
            _require(getattr(self, key) >= 1, key, getattr(self, key), ">= 1")
        _require(0 < self.fraction_train <= 1, "fraction_train", self.fraction_train, "in (0, 1]")
        _require(0 <= self.fraction_evaluate <= 1, "fraction_evaluate", self.fraction_evaluate, "in [0, 1]")
        _require(self.min_train_nodes <= self.num_clients, "min_train_nodes", self.min_train_nodes,
                 f"<= num_clients ({self.num_clients})")
        _require(self.round_timeout > 0, "round_timeout", self.round_timeout, "> 0")
        _require_choice("task", self.task, tuple(TASKS))
        self._require_task_combination()
        _require_choice("device", self.device, DEVICES)
        _require_choice("server_device", self.server_device, DEVICES)
        _require_choice("precision", self.precision, PRECISIONS)
        _require_choice("compile_model", self.compile_model, COMPILE_MODES)
        _require(self.task == "vision" or self.compile_model == "none", "compile_model", self.compile_model,
                 f"none for task={self.task} (the compiled training step is for task=vision; language "
                 "batches vary in length and DPO switches the adapters off inside the loss)")
        self._require_client_batch()
        _require_choice("wire_dtype", self.wire_dtype, WIRE_DTYPES)
        _require_choice("reply_dtype", self.reply_dtype, REPLY_DTYPES)
        _require(self.reply_dtype == "float32" or self.algorithm.name != "scaffold", "reply_dtype", self.reply_dtype,
                 "float32 for algorithm=scaffold: its server's c must stay the mean of the clients' c_i, which each "
                 "client keeps unrounded, and rounded changes of c_i would drift apart from them round by round")
        _require(self.max_update_norm is None or self.max_update_norm > 0, "max_update_norm",
                 self.max_update_norm, "> 0, or null (no bound)")
        _require(self.max_moment_ratio == 0 or self.max_moment_ratio >= 1, "max_moment_ratio",
                 self.max_moment_ratio, ">= 1, or 0 (no check)")
        _require(self.max_update_ratio == 0 or self.max_update_ratio >= 1, "max_update_ratio",
                 self.max_update_ratio, ">= 1, or 0 (no check)")
        self._require_aggregation()
        _require(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every,
                 ">= 0 (0 = only at the end)")
        _require(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints, ">= 1")
        _require(self.resume is None or self.resume.strip() != "", "resume", self.resume,
                 "a checkpoint file or run folder, or null")
        debug = self.debug
        _require(all(0 <= p < self.num_clients for p in debug.fail_partitions), "debug.fail_partitions",
                 debug.fail_partitions, f"partition ids in [0, num_clients={self.num_clients})")
        _require(all(1 <= r <= self.num_rounds for r in debug.fail_rounds), "debug.fail_rounds",
                 debug.fail_rounds, f"rounds in [1, num_rounds={self.num_rounds}]")
        _require(bool(debug.fail_partitions) == bool(debug.fail_rounds), "debug.fail_rounds",
                 debug.fail_rounds, "non-empty exactly when debug.fail_partitions is")

    def _require_aggregation(self) -> None:
        """The aggregation rule, its trim and its weights must make sense for the round's sample
        of S clients (fedact_app.aggregation): trimmed_mean drops k = ceil(trim_fraction x S) at
        each end and needs S > 2k; the robust rules are unweighted; trim_fraction is read by
        trimmed_mean only (another rule would ignore it)."""
        _require_choice("aggregation", self.aggregation, AGGREGATIONS)
        _require(0 < self.trim_fraction < 0.5, "trim_fraction", self.trim_fraction, "in (0, 0.5)")
        if self.aggregation != "trimmed_mean":
            _require(self.trim_fraction == TRIM_FRACTION, "trim_fraction", self.trim_fraction,
                     f"only the default {TRIM_FRACTION} with aggregation={self.aggregation} (trimmed_mean reads it)")
            if self.aggregation == "mean":
                return
        _require(self.algorithm.weighting == "uniform", "algorithm.weighting", self.algorithm.weighting,
                 f"uniform with aggregation={self.aggregation}, which is unweighted (weighting=examples "
                 "is for aggregation=mean)")
        if self.aggregation != "trimmed_mean":
            return
        sampled = sample_count(self.num_clients, self.fraction_train, self.min_train_nodes)
        _require(sampled >= 3, "aggregation", self.aggregation,
                 f"mean or median when a round samples fewer than 3 clients (this config samples {sampled}: "
                 f"fraction_train x num_clients, at least min_train_nodes); trimmed_mean drops one at "
                 f"each end at least")
        largest = (sampled - 1) // 2 / sampled  # the largest fraction with 2 ceil(f S) < S
        trimmed = trim_count(sampled, self.trim_fraction)
        _require(sampled > 2 * trimmed, "trim_fraction", self.trim_fraction,
                 f"in (0, {largest:g}] for the {sampled} clients a round samples (ceil({self.trim_fraction:g} x "
                 f"{sampled}) = {trimmed} dropped at each end would leave none)")

    def _require_client_batch(self) -> None:
        """``client_batch`` trains what ``ClientBatch`` can: the FedACT family's vision clients,
        contiguous."""
        _require(self.client_batch_wait > 0, "client_batch_wait", self.client_batch_wait, "> 0")
        if not self.client_batch:
            return
        _require(self.client_batch_wait <= self.round_timeout, "client_batch_wait", self.client_batch_wait,
                 f"<= round_timeout ({self.round_timeout:g}) with client_batch=true")
        _require(self.algorithm.name in FEDACT_FAMILY, "client_batch", self.client_batch,
                 f"false for algorithm={self.algorithm.name}: the clients trained at once are those of the FedACT "
                 f"family ({', '.join(FEDACT_FAMILY)})")
        _require(self.task == "vision", "client_batch", self.client_batch,
                 f"false for task={self.task}: the clients trained at once are vision clients")
        _require(not self.channels_last, "client_batch", self.client_batch,
                 "false with channels_last=true: the clients trained at once take contiguous batches")
        _require(self.debug.hang_seconds == 0, "client_batch", self.client_batch,
                 "false with debug.hang_seconds > 0: a client made to hang would hang its whole batch")

    def _require_task_combination(self) -> None:
        """The dataset and the model must be ones of the task (TASK_CHOICES)."""
        combinations = "; ".join(f"task={task}: dataset in {{{', '.join(d)}}}, model in {{{', '.join(m)}}}"
                                 for task, (d, m) in TASK_CHOICES.items())
        datasets, models = TASK_CHOICES[self.task]
        for key, value, allowed in (("dataset.name", self.dataset.name, datasets),
                                    ("model.name", self.model.name, models)):
            _require(value in allowed, key, value,
                     f"one of {', '.join(allowed)} for task={self.task} (the combinations: {combinations})")
        _require(self.task == "vision" or self.dataset.holdout_fraction == 0, "dataset.holdout_fraction",
                 self.dataset.holdout_fraction, f"0 for task={self.task} (a vision key; language tasks hold "
                 "out dataset.validation_fraction)")
        language = self.language
        if self.task == "dpo":
            _require(language.max_prompt_length < language.max_length, "language.max_prompt_length",
                     language.max_prompt_length, f"< language.max_length ({language.max_length}) for task=dpo")


ConfigStore.instance().store(name="schema", node=Config)


# Hydra keeps the composing config folder in one process-wide object (GlobalHydra), which a second
# thread composing at the same time finds taken ("GlobalHydra is already initialized").
_HYDRA_LOCK = threading.Lock()


def compose(overrides: str | list[str] = (), conf_dir: Path = CONF_DIR) -> Config:
    """Compose ``conf/config.yaml`` with Hydra overrides and return the validated ``Config``.

    ``overrides`` is a list of Hydra overrides or one string of them as written on a command line
    (the Flower run config's ``overrides`` value), e.g. ``"dataset=cifar100 partition.alpha=0.1"``.
    ``conf_dir``: another app folder's ``conf/`` (the launcher checks the app it submits).
    """
    return to_config(compose_unchecked(overrides, conf_dir))


def compose_unchecked(overrides: str | list[str] = (), conf_dir: Path = CONF_DIR) -> DictConfig:
    """The Hydra composition of :func:`compose`, before :func:`to_config` checks it: Hydra's own
    errors (an unknown group option, a value of the wrong type) raise here, and ConfigError for
    an override of a key the schema lacks; the schema's ranges, and keys added with ``+``, are
    :func:`to_config`'s to check. Threads may compose at the same time (one at a time inside)."""
    if isinstance(overrides, str):
        overrides = shlex.split(overrides)
    with _HYDRA_LOCK, initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base=None):
        try:
            return hydra_compose(config_name="config", overrides=list(overrides))
        except ConfigCompositionException as err:
            if unknown := _unknown_schema_key(err):
                raise ConfigError(unknown) from None
            raise


def _unknown_schema_key(err: ConfigCompositionException) -> str | None:
    """The message for Hydra's "Could not override 'KEY'. To append to your config use +KEY=..."
    where KEY leaves the schema (an unknown field of a typed group): the first unknown part and
    the keys allowed there, as :func:`to_config` says it of a key added with ``+``, which it
    refuses. None for other errors, for Hydra's own keys (``hydra.``), for a group override
    (``model@x``, ``dataset/x``), and where KEY lies in a free-form dict (``model.kwargs``),
    where Hydra's ``+KEY`` is right."""
    found = re.match(r"Could not override '([^'@/]+)'\.\nTo append to your config use \+", str(err))
    if not found or found.group(1).split(".")[0] == "hydra":
        return None
    schema: Any = Config
    parts = found.group(1).split(".")
    for depth, part in enumerate(parts):
        known = [f.name for f in fields(schema)]
        if part not in known:
            return _unknown_key_message(".".join(parts[:depth + 1]), known)
        schema = typing.get_type_hints(schema)[part]
        if not is_dataclass(schema):
            return None
    return None


def _unknown_key_message(key: str, allowed: Iterable[str]) -> str:
    return f"Unknown config key {key}: allowed keys there: {', '.join(sorted(allowed))}"


def to_config(cfg: Any) -> Config:
    """Turn a composed DictConfig into the validated ``Config`` (runs every range check). A key
    the schema does not have fails here: Hydra lets ``+key=value`` add one to a typed config, and
    the conversion would drop it without a word."""
    if unknown := _unknown_keys(cfg):
        raise ConfigError(f"{_unknown_key_message(unknown[0], _allowed_keys(cfg, unknown[0]))} (added with "
                          "'+'? the run would ignore it)")
    return OmegaConf.to_object(cfg)


def _unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` that its schema dataclass does not define, depth first; free-form
    dict fields (``model.kwargs``) are not looked into."""
    known = {f.name for f in fields(OmegaConf.get_type(node))}
    unknown = []
    for key in node:
        child = node[key]
        if key not in known:
            unknown.append(f"{prefix}{key}")
        elif isinstance(child, DictConfig) and is_dataclass(OmegaConf.get_type(child)):
            unknown += _unknown_keys(child, f"{prefix}{key}.")
    return unknown


def _allowed_keys(cfg: DictConfig, dotted: str) -> list[str]:
    parent = OmegaConf.select(cfg, dotted.rpartition(".")[0]) if "." in dotted else cfg
    return sorted(f.name for f in fields(OmegaConf.get_type(parent)))


def to_yaml(cfg: Config) -> str:
    """The resolved configuration as YAML, as written into every run folder."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
