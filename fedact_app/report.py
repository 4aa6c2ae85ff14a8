"""Run folders -> records, groups and mean ± std over seeds: what scripts/plot.py and
scripts/table.py draw and tabulate. Plain Python (no Flower, no matplotlib).

A *run folder* is any folder holding ``metrics.jsonl`` and ``config.yaml`` (fedact_app.results);
a path given here is a run folder itself, a sweep folder (scripts/sweep.py) or any folder with run
folders at any depth below it. A run counts as completed when it has ``summary.json`` and no sweep
``summary.jsonl`` above it lists its job with another status; only completed runs are loaded (the
others are skipped with a warning). Runs of one method whose algorithm settings or training
settings (``TRAINING_KEYS``: clients, participation, local steps, batch, precision, wire dtypes)
differ (an ablation sweep over rho, tau, local_steps, ...) are told apart by those
settings, e.g. ``FedACT (rho=0.3)``, ``FedACT (local_steps=5)``. Runs of the same method,
settings, setting and seed are one run: the newest folder (by name, which starts with its start
time) is kept.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

# Config name -> display name, in the paper's table order (FedACT is the paper's \method).
METHODS = {
    "fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "fedadam": "FedAdam",
    "localadam": "LocalAdam", "localadamw": "LocalAdamW", "fedlada": "FedLADA",
    "fedadamw": "FedAdamW", "fedact_local": "FedACT-Local", "fedact": "FedACT",
}
MODELS = {"vit_tiny": "ViT-Tiny", "swin_lite": "Swin-Lite", "resnet18": "ResNet-18",
          "cnn_small": "CNN-Small", "llama_60m": "Llama-60M", "llama_130m": "Llama-130M",
          "llama_250m": "Llama-250M", "llama_tiny": "Llama-tiny", "lora_causal_lm": "LoRA"}
DATASETS = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "tiny_imagenet": "Tiny-ImageNet",
            "fashion_mnist": "Fashion-MNIST", "digits": "Digits", "synthetic": "Synthetic",
            "c4": "C4-en", "text": "Text", "alpaca_gpt4": "Alpaca-GPT4", "hh_rlhf": "HH-RLHF"}
VALUE_KINDS = ("final", "best")
# Top-level run settings that change what a method reaches: runs that differ in one are rows of
# their own, never seeds of one row (nor duplicates of each other). Not num_rounds: a resumed run
# that raised it continues the earlier one (the newest is kept). Older run folders lack the keys
# added later, which then had these values:
TRAINING_KEYS = {"num_clients": None, "fraction_train": None, "min_train_nodes": None, "local_steps": None,
                 "batch_size": None, "precision": "fp32", "wire_dtype": "float32",
                 "reply_dtype": "float32"}

Warn = Callable[[str], None]


class ReportError(ValueError):
    """A path holds no run folders, or a run folder's file is malformed (the message names it)."""


def print_warning(message: str) -> None:
    """The default ``warn``: one line on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _order(names: dict[str, str], key: str) -> tuple[int, str]:
    """Sort key: the known names in their listed order, then unknown ones alphabetically."""
    return (list(names).index(key) if key in names else len(names), key)


@dataclass(frozen=True)
class Setting:
    """What a run trains on: model, dataset and partition (alpha only for Dirichlet)."""

    model: str
    dataset: str
    partition: str
    alpha: Optional[float]

    @property
    def heterogeneity(self) -> str:
        """``Dir-0.6`` or ``IID``, as the paper's column headers (a language task's name for its
        round-robin shards)."""
        if self.partition == "dirichlet":
            return f"Dir-{self.alpha:g}"
        return "IID" if self.partition == "iid" else self.partition

    @property
    def title(self) -> str:
        """``CIFAR-100 / ViT-Tiny / Dir-0.1``."""
        return " / ".join((DATASETS.get(self.dataset, self.dataset),
                           MODELS.get(self.model, self.model), self.heterogeneity))

    @property
    def slug(self) -> str:
        """``cifar100_vit_tiny_dir0.1``, for file names."""
        return f"{self.dataset}_{self.model}_{self.heterogeneity.lower().replace('-', '')}"

    def sort_key(self) -> tuple:
        """Model, then dataset (each in the paper's order), then IID before Dir-α, α descending."""
        return (_order(MODELS, self.model), _order(DATASETS, self.dataset),
                self.partition == "dirichlet", -(self.alpha or 0.0))


@dataclass(frozen=True)
class Run:
    """One run folder: its method, setting, seed and metrics rows (one per round)."""

    path: Path
    algorithm: str
    setting: Setting
    seed: int
    rows: tuple[dict, ...]
    hyperparameters: tuple[tuple[str, str], ...] = ()  # the algorithm config but its name and TRAINING_KEYS, sorted
    variant: str = ""  # the hyperparameters that tell this run from others of its method

    @property
    def method(self) -> str:
        """The paper's display name, e.g. ``FedAdamW``, with its variant: ``FedACT (rho=0.3)``."""
        name = method_name(self.algorithm)
        return f"{name} ({self.variant})" if self.variant else name

    def series(self, metric: str) -> dict[int, float]:
        """round -> value, over the rows that have ``metric``; a null (metrics.jsonl's way of
        writing NaN or inf, fedact_app.results.json_line) reads as NaN, so a run whose last
        value diverged has a NaN final value rather than an earlier round's."""
        return {row["round"]: math.nan if row[metric] is None else float(row[metric])
                for row in self.rows if metric in row}

    def value(self, column: str, kind: str) -> Optional[float]:
        """``final`` (last round that has it) or ``best`` (max, or min for a loss or perplexity)
        value of a metrics column; None when no round has it."""
        values = list(self.series(column).values())
        if not values:
            return None
        if kind == "final":
            return values[-1]
        values = [v for v in values if not math.isnan(v)] or [math.nan]  # best of the defined values
        return min(values) if lower_is_better(column) else max(values)


def lower_is_better(column: str) -> bool:
    """Losses, perplexities and NLLs fall as training goes well; everything else rises."""
    return column.endswith(("loss", "perplexity", "nll"))


def in_percent(column: str) -> bool:
    """Accuracies are shown in %, as the paper's tables do."""
    return column.endswith("accuracy")


def method_name(algorithm: str) -> str:
    """Config name -> the paper's display name (unknown names are shown as they are)."""
    return METHODS.get(algorithm, algorithm)


def method_sort_key(method: str) -> tuple[int, str]:
    """Display names in the paper's table order (variants by their text), unknown ones last."""
    return _order(dict.fromkeys(METHODS.values()), method.split(" (")[0])[0], method


# ------------------------------------------------------------------ finding and loading


def _is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run folder (metrics.jsonl and config.yaml in it)."""
    return (path / "metrics.jsonl").is_file() and (path / "config.yaml").is_file()


def find_run_dirs(path: Path) -> list[Path]:
    """The run folders at or below ``path``, sorted; ReportError when there are none."""
    if not path.exists():
        raise ReportError(f"{path}: no such file or folder")
    if _is_run_dir(path):
        return [path]
    found = sorted(p.parent for p in path.rglob("metrics.jsonl") if _is_run_dir(p.parent))
    if not found:
        raise ReportError(f"{path}: no run folders in it (a run folder holds metrics.jsonl and "
                          "config.yaml)")
    return found


def sweep_statuses(path: Path, warn: Warn) -> dict[Path, str]:
    """Run folder -> status, from every sweep ``summary.jsonl`` at or below ``path`` (folders found
    relative to the sweep folder, so a moved sweep still matches); warns for each job that did not
    complete."""
    statuses = {}
    for summary in sorted(path.rglob("summary.jsonl")) if path.is_dir() else []:
        for row in _read_jsonl(summary):
            if row.get("status") != "completed":
                warn(f"{summary.parent}: job {row.get('job')} ({row.get('overrides', '')}) "
                     f"is {row.get('status')}: skipped")
            if row.get("run_dir"):
                run_dir = summary.parent / str(row.get("job")) / Path(row["run_dir"]).name
                statuses[run_dir.resolve()] = row.get("status")
    return statuses


def _read_jsonl(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file; ReportError naming the file and line otherwise."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(f"{path}, line {number}: not JSON ({err})") from None
        if not isinstance(row, dict):
            raise ReportError(f"{path}, line {number}: not a JSON object")
        rows.append(row)
    return rows


def _config_value(config: dict, dotted: str, path: Path):
    """``config[a][b]`` for ``dotted`` = ``a.b``; ReportError naming ``path`` when it is missing."""
    value = config
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ReportError(f"{path}: no {dotted}")
        value = value[key]
    return value


def load_run(path: Path) -> Run:
    """One run folder as a Run; ReportError naming the file when config.yaml or metrics.jsonl is
    malformed."""
    config_path = path / "config.yaml"
    try:
        config = yaml.safe_load(config_path.read_text())
    except yaml.YAMLError as err:
        raise ReportError(f"{config_path}: not YAML ({err})") from None
    if not isinstance(config, dict):
        raise ReportError(f"{config_path}: not a YAML mapping")
    task = config.get("task", "vision")
    partition = _config_value(config, "partition.name", config_path) if task == "vision" else task
    setting = Setting(
        model=_config_value(config, "model.name", config_path),
        dataset=_config_value(config, "dataset.name", config_path),
        partition=partition,
        alpha=float(_config_value(config, "partition.alpha", config_path))
        if partition == "dirichlet" else None)
    rows = _read_jsonl(path / "metrics.jsonl")
    if any("round" not in row for row in rows):
        raise ReportError(f"{path / 'metrics.jsonl'}: a row without 'round'")
    algorithm = _config_value(config, "algorithm", config_path)
    hyperparameters = tuple(sorted([(key, str(value)) for key, value in algorithm.items() if key != "name"]
                                   + [(key, str(config.get(key, default))) for key, default in TRAINING_KEYS.items()
                                      if key in config or default is not None]))
    return Run(path=path, algorithm=_config_value(config, "algorithm.name", config_path),
               setting=setting, seed=int(_config_value(config, "seed", config_path)),
               rows=tuple(sorted(rows, key=lambda row: row["round"])), hyperparameters=hyperparameters)


def run_columns(runs: Iterable[Run]) -> list[str]:
    """The metrics.jsonl columns that at least one of ``runs`` has (without ``round``), sorted."""
    return sorted({key for run in runs for row in run.rows for key in row} - {"round"})


def with_variants(runs: Sequence[Run]) -> list[Run]:
    """``runs`` with each one's ``variant``: the settings (algorithm and ``TRAINING_KEYS``) that
    differ between the runs of its method (none when they all agree)."""
    by_algorithm: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_algorithm[run.algorithm].append(run)
    varying = {algorithm: sorted({key for run in group for key, value in run.hyperparameters
                                  if any(dict(other.hyperparameters).get(key) != value for other in group)})
               for algorithm, group in by_algorithm.items()}
    return [dataclasses.replace(run, variant=", ".join(
        f"{key}={dict(run.hyperparameters).get(key, '-')}" for key in varying[run.algorithm]))
        for run in runs]


def load_runs(paths: Iterable[Path], warn: Warn = print_warning) -> list[Run]:
    """The completed runs at or below ``paths`` (see the module docstring), one per method,
    setting and seed; ReportError when a path has no run folders or none completed."""
    runs: dict[tuple, Run] = {}
    for path in map(Path, paths):
        statuses = sweep_statuses(path, warn)
        completed = []
        for run_dir in find_run_dirs(path):
            if statuses.get(run_dir.resolve(), "completed") != "completed":
                continue  # sweep_statuses warned
            if (run_dir / "summary.json").is_file():
                completed.append(load_run(run_dir))
            else:
                warn(f"{run_dir}: no summary.json (the run did not finish): skipped")
        if not completed:
            raise ReportError(f"{path}: no completed runs in it")
        for run in completed:
            key = (run.algorithm, run.hyperparameters, run.setting, run.seed)
            if key in runs:
                older, newer = sorted((runs[key], run), key=lambda r: r.path.name)
                warn(f"{older.path}: same method, settings and seed as {newer.path}: skipped")
                run = newer
            runs[key] = run
    return sorted(with_variants(list(runs.values())),
                  key=lambda r: (r.setting.sort_key(), method_sort_key(r.method), r.seed))


# ------------------------------------------------------------------ grouping and statistics


def group_runs(runs: Iterable[Run]) -> dict[Setting, dict[str, list[Run]]]:
    """setting -> method -> its runs (one per seed), settings and methods in the paper's order."""
    groups: dict[Setting, dict[str, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        groups[run.setting][run.method].append(run)
    return {setting: {method: groups[setting][method]
                      for method in sorted(groups[setting], key=method_sort_key)}
            for setting in sorted(groups, key=Setting.sort_key)}


def mean_std(values: Sequence[float]) -> tuple[float, Optional[float]]:
    """Mean and sample standard deviation (ddof=1); the std is None for a single value."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else None


@dataclass(frozen=True)
class Curve:
    """One method's metric over rounds, averaged over seeds: ``std`` is NaN where a round has a
    single value; ``seeds`` counts the runs that have the metric at all."""

    rounds: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    seeds: int


def seed_curve(runs: Sequence[Run], metric: str) -> Optional[Curve]:
    """The mean ± std over ``runs`` of ``metric`` at each round some run has it; None when none has."""
    series = [s for s in (run.series(metric) for run in runs) if s]
    if not series:
        return None
    rounds = sorted(set().union(*series))
    stats = [mean_std([s[r] for s in series if r in s]) for r in rounds]
    return Curve(rounds=tuple(rounds), mean=tuple(m for m, _ in stats),
                 std=tuple(math.nan if s is None else s for _, s in stats), seeds=len(series))


def curves(runs: Iterable[Run], metric: str) -> dict[Setting, dict[str, Curve]]:
    """setting -> method -> Curve of ``metric``; methods without the metric are left out, and so
    are settings where no method has it."""
    result = {}
    for setting, methods in group_runs(runs).items():
        by_method = {method: seed_curve(group, metric) for method, group in methods.items()}
        by_method = {method: curve for method, curve in by_method.items() if curve is not None}
        if by_method:
            result[setting] = by_method
    return result


def value_cells(runs: Iterable[Run], column: str, kind: str) -> dict[str, dict[Setting, tuple[float, Optional[float]]]]:
    """method -> setting -> (mean, std) over the runs (seeds) of the ``final`` or ``best`` value of
    a metrics column (accuracies in %); methods in the paper's order."""
    if kind not in VALUE_KINDS:
        raise ReportError(f"the value must be one of {', '.join(VALUE_KINDS)}, not {kind!r}")
    scale = 100.0 if in_percent(column) else 1.0
    cells: dict[str, dict[Setting, tuple[float, Optional[float]]]] = defaultdict(dict)
    for setting, methods in group_runs(runs).items():
        for method, group in methods.items():
            values = [scale * v for v in (run.value(column, kind) for run in group)
                      if v is not None and not math.isnan(v)]
            if values:
                cells[method][setting] = mean_std(values)
    return {method: cells[method] for method in sorted(cells, key=method_sort_key)}
