"""A run's folder: resolved config, one metrics line per round, a log line per round, a summary.

Layout of ``<output_dir>/<run name>/``::

    config.yaml      the resolved configuration
    metrics.jsonl    one JSON object per round (round 0 = the initial model)
    summary.json     final and best test accuracy (language tasks: perplexity or preference
                     accuracy; with dataset.holdout_fraction > 0 the validation accuracy, and the
                     test columns are NaN), rounds, wall time
    model.safetensors  the final global model state (a model holding NaN/inf fails the run instead)
    checkpoints/     round-<r>.safetensors, the newest keep_checkpoints (fedact_app.checkpoint)
    tensorboard/     every numeric column of metrics.jsonl as TensorBoard scalars (when the
                     tensorboard package is installed and ``tensorboard: true``)
    client_state/    <partition>.safetensors, state clients keep across rounds (SCAFFOLD c_i)

A resumed run (``resume=...``) gets a new folder whose metrics.jsonl starts with the rows of the
run it continues.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from logging import INFO, WARNING
from collections.abc import Sequence
from pathlib import Path

from flwr.common import log
from safetensors.torch import save_file

from fedact_app.algorithms import TensorDict
from fedact_app.finite import describe_names, non_finite
from fedact_app.config import Config, to_yaml


def run_name(cfg: Config) -> str:
    """``<time>_<algorithm>_<dataset>_<model>_<partition>_s<seed>``, e.g. ..._dir0.1_s42."""
    partition = f"dir{cfg.partition.alpha:g}" if cfg.partition.name == "dirichlet" else cfg.partition.name
    if cfg.task != "vision":  # language data is sharded round-robin, not by partition
        partition = cfg.task
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"{stamp}_{cfg.algorithm.name}_{cfg.dataset.name}_{cfg.model.name}_{partition}_s{cfg.seed}"


def create_run_dir(cfg: Config) -> Path:
    """A new, unique folder under the absolute ``output_dir``."""
    base = Path(cfg.output_dir).expanduser().resolve()
    path = base / run_name(cfg)
    suffix = 1
    while path.exists():
        suffix += 1
        path = base / f"{run_name(cfg)}-{suffix}"
    path.mkdir(parents=True)
    return path


def _format_row(row: dict, num_rounds: int, elapsed: float) -> str:
    parts = [f"round {row['round']:>{len(str(num_rounds))}}/{num_rounds}"]
    if "train_loss" in row:
        parts.append(f"train loss {row['train_loss']:.4f}")
    if "test_accuracy" in row:
        parts.append(f"test acc {row['test_accuracy']:.4f} loss {row['test_loss']:.4f}")
    elif "val_accuracy" in row:
        parts.append(f"val acc {row['val_accuracy']:.4f} loss {row['val_loss']:.4f}")
    elif "test_preference_accuracy" in row:
        parts.append(f"test pref acc {row['test_preference_accuracy']:.4f} loss {row['test_loss']:.4f}")
    elif "test_perplexity" in row:
        parts.append(f"test ppl {row['test_perplexity']:.3f} loss {row['test_loss']:.4f}")
    if "direction_consistency" in row:
        parts.append(f"DC {row['direction_consistency']:.3f}")
    if "lr" in row:
        parts.append(f"lr {row['lr']:.2e}")
    if "seconds" in row:
        parts.append(f"{row['seconds']:.1f} s")
        if row["round"]:
            eta = elapsed / row["round"] * (num_rounds - row["round"])
            parts.append(f"elapsed {elapsed:.0f} s, eta {eta:.0f} s")
    if row.get("rejected"):
        parts.append(f"rejected {row['rejected']}")
    if row.get("missing"):
        parts.append(f"no reply {row['missing']}")
    return " | ".join(parts)


# language tasks' main metric when there is no test_accuracy: (key, the better of two values)
MAIN_METRICS = (("test_preference_accuracy", max), ("test_perplexity", min))


def main_metric_summary(rows: Sequence[dict]) -> dict[str, float]:
    """``initial_``/``final_``/``best_<metric>`` of the first of MAIN_METRICS the rows report
    (best = highest preference accuracy, lowest perplexity); {} when none."""
    for key, better in MAIN_METRICS:
        values = [r[key] for r in rows if key in r]
        if values:
            return {f"initial_{key}": values[0], f"final_{key}": values[-1], f"best_{key}": better(values)}
    return {}


def tensorboard_writer(run_dir: Path, enabled: bool):
    """A ``SummaryWriter`` on ``<run_dir>/tensorboard``, or None when off or tensorboard is missing."""
    if not enabled:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log(INFO, "tensorboard is not installed: no TensorBoard scalars (pip install tensorboard)")
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


LOST_REPLIES = ("replies_rejected", "replies_failed", "replies_missing", "rounds_without_update")


def reply_totals(rows: Sequence[dict]) -> dict[str, int]:
    """The run's accepted client replies and those lost, summed over its rounds (``rejected``
    includes ``failed``, the error replies; ``missing``: sampled nodes that never replied), and
    the rounds in which no reply was usable (the model did not change)."""
    rounds = [r for r in rows if r.get("round", 0) >= 1 and "clients" in r]
    return {"replies_accepted": sum(int(r["clients"]) for r in rounds),
            "replies_rejected": sum(int(r.get("rejected", 0)) for r in rounds),
            "replies_failed": sum(int(r.get("failed", 0)) for r in rounds),
            "replies_missing": sum(int(r.get("missing", 0)) for r in rounds),
            "rounds_without_update": sum(1 for r in rounds if int(r["clients"]) == 0)}


def json_line(row: dict) -> str:
    """``row`` as strict JSON: a non-finite float (a diverged loss) is written as null, since
    JSON has no NaN or Infinity and Python's bare ``NaN`` breaks other readers."""
    return json.dumps({key: None if isinstance(value, float) and not math.isfinite(value) else value
                       for key, value in row.items()}, allow_nan=False)


class RunRecorder:
    """Writes one run's folder; ``record_round`` is called once per round by the strategy loop."""

    def __init__(self, run_dir: Path, cfg: Config, earlier_rows: Sequence[dict] = ()) -> None:
        """``earlier_rows``: the rows of the run this one resumes (fedact_app.checkpoint), written first."""
        self.run_dir = run_dir
        self.num_rounds = cfg.num_rounds
        self.rows: list[dict] = []
        self.started = time.perf_counter()
        self.started_at = time.time()  # Unix time, for tools that split a run's wall time (scripts/bench_run.py)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.metrics_path = run_dir / "metrics.jsonl"
        self.metrics_path.write_text("")
        self.tensorboard = tensorboard_writer(run_dir, cfg.tensorboard)
        for row in earlier_rows:
            self._store(row)
        log(INFO, "FedACT run folder: %s", run_dir)

    def _store(self, row: dict) -> dict:
        row = {"round": row["round"], **{k: v for k, v in row.items() if k != "round"}}
        self.rows.append(row)
        with self.metrics_path.open("a") as f:
            f.write(json_line(row) + "\n")
        if self.tensorboard is not None:
            for key, value in row.items():
                if key != "round" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, row["round"])
            self.tensorboard.flush()
        return row

    def record_round(self, row: dict) -> None:
        row = self._store(row)
        log(INFO, "%s", _format_row(row, self.num_rounds, time.perf_counter() - self.started))

    def finish(self, state: TensorDict, startup: dict[str, float | None] | None = None) -> dict:
        """Write the final model and ``summary.json``; return the summary. ``startup``: the Unix
        times of the run's start-up phases, written as they are (fedact_app.server_app.run_app).

        A ``state`` holding NaN or inf raises RuntimeError and writes neither file: the ServerApp
        raising marks the Flower run failed, where it would otherwise end 'completed' with a
        diverged or poisoned model."""
        if poisoned := non_finite(state):
            raise RuntimeError(f"The final global model holds non-finite values (NaN or inf) in "
                               f"{describe_names(poisoned)}: the run diverged or a client's update poisoned "
                               f"it. No model.safetensors or summary.json written to {self.run_dir} "
                               f"(metrics.jsonl has every round)")
        save_file({name: t.contiguous() for name, t in state.items()}, str(self.run_dir / "model.safetensors"))
        evaluated = [r for r in self.rows if "test_accuracy" in r]
        summary = {
            "rounds": self.rows[-1]["round"] if self.rows else 0,
            "seconds": time.perf_counter() - self.started,
            "started_at": self.started_at,
            "finished_at": time.time(),
            "initial_test_accuracy": evaluated[0]["test_accuracy"] if evaluated else math.nan,
            "final_test_accuracy": evaluated[-1]["test_accuracy"] if evaluated else math.nan,
            "best_test_accuracy": max((r["test_accuracy"] for r in evaluated), default=math.nan),
            **reply_totals(self.rows),
            "run_dir": str(self.run_dir),
        }
        if startup is not None:
            summary["startup"] = startup
        if validated := [r["val_accuracy"] for r in self.rows if "val_accuracy" in r]:  # holdout_fraction > 0
            summary.update(initial_val_accuracy=validated[0], final_val_accuracy=validated[-1],
                           best_val_accuracy=max(validated))
        elif not evaluated:  # language tasks: their main metric instead (docs/LANGUAGE.md)
            summary.update(main_metric_summary(self.rows))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.close()
        key = next((k for k, _ in (("val_accuracy", max), *MAIN_METRICS) if f"final_{k}" in summary),
                   "test_accuracy")
        log(INFO, "Done: final %s %.4f (best %.4f, initial %.4f) in %.0f s -> %s", key.replace("_", " "),
            summary[f"final_{key}"], summary[f"best_{key}"], summary[f"initial_{key}"], summary["seconds"],
            self.run_dir)
        if lost := {k: v for k, v in summary.items() if k in LOST_REPLIES and v}:
            log(WARNING, "Not every sampled client contributed: %s (per round in metrics.jsonl; the "
                "reasons are logged as 'node ... failed' / 'rejected reply')",
                ", ".join(f"{k} {v}" for k, v in lost.items()))
        return summary
