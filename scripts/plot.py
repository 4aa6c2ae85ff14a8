"""Plots of run folders: one figure per metric and setting (dataset / model / partition), one line per
method, PNG and PDF.

    python3 scripts/plot.py sweeps/20260101-120000 --out figures
    python3 scripts/plot.py outputs/ sweeps/a sweeps/b --out figures --metric test_accuracy train_loss

Each path is a run folder, a sweep folder (scripts/sweep.py) or any folder with run folders below
it; only completed runs are drawn (fedact_app.report). With several seeds a line is their mean at
each round and the shaded band ± their sample standard deviation. A method that does not log a
metric (the SGD family has no trust score) is left out of that metric's figures; a figure without
any data is skipped with a note. Files: ``<out>/<metric>_<dataset>_<model>_<dir0.1|iid>.{png,pdf}``.
Default metrics: test accuracy, direction consistency, positive score ratio, top-p score mass; any
metrics.jsonl column can be given to ``--metric``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

APP_DIR = Path(__file__).resolve().parents[1]
if str(APP_DIR) not in sys.path:
    sys.path.insert(0, str(APP_DIR))

from fedact_app.report import (  # noqa: E402
    METHODS, Curve, ReportError, Run, Setting, curves, group_runs, load_runs, run_columns)

METRIC_LABELS = {
    "test_accuracy": "Test accuracy",
    "direction_consistency": "Direction consistency",
    "positive_ratio": "Positive score ratio",
    "top_p_mass": "Top-p positive score mass",
}
FONT_SIZE = 11
FORMATS = ("png", "pdf")


def figure_colors(labels: list[str]) -> dict[str, str]:
    """A colour per line: a method's fixed colour (the same in every figure); a variant such as
    "FedACT (scale_matched=True)" takes the first palette colour no other line of the figure has."""
    palette = [matplotlib.colors.to_hex(c) for c in plt.get_cmap("tab10").colors]
    fixed = {name: palette[i % len(palette)] for i, name in enumerate(METHODS.values())}
    colors = {label: fixed[label] for label in labels if label in fixed}
    spare = (c for c in palette + palette if c not in colors.values())
    return {label: colors[label] if label in colors else next(spare) for label in labels}


def draw_figure(setting: Setting, metric: str, by_method: dict[str, Curve], stem: Path) -> list[Path]:
    """One figure: a line (and a ±std band where there are several seeds) per method; written as
    ``stem.png`` and ``stem.pdf``."""
    colors = figure_colors(list(by_method))
    fig, ax = plt.subplots(figsize=(5.5, 4.0))
    for method, curve in by_method.items():
        color = colors[method]
        label = method if curve.seeds == 1 else f"{method} ({curve.seeds} seeds)"
        ax.plot(curve.rounds, curve.mean, label=label, color=color, linewidth=1.6)
        if curve.seeds > 1:
            low = [m - s if not math.isnan(s) else m for m, s in zip(curve.mean, curve.std)]
            high = [m + s if not math.isnan(s) else m for m, s in zip(curve.mean, curve.std)]
            ax.fill_between(curve.rounds, low, high, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("Communication round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(METRIC_LABELS.get(metric, metric))
    ax.set_title(setting.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    paths = [stem.with_name(f"{stem.name}.{fmt}") for fmt in FORMATS]
    for path in paths:
        fig.savefig(path, dpi=150)
    plt.close(fig)
    return paths


def plot_runs(runs: list[Run], metrics: list[str], out_dir: Path) -> dict[str, dict[Setting, dict[str, Curve]]]:
    """Draw every (metric, setting) figure that has data into ``out_dir``; print each file written
    and a note for each figure skipped. Returns metric -> setting -> method -> the plotted Curve."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plotted = {}
    with plt.rc_context({"font.size": FONT_SIZE, "legend.fontsize": FONT_SIZE - 1}):
        for metric in metrics:
            plotted[metric] = curves(runs, metric)
            for setting in group_runs(runs):
                if setting not in plotted[metric]:
                    print(f"note: no {metric} in the runs of {setting.title}: figure skipped")
                    continue
                for path in draw_figure(setting, metric, plotted[metric][setting],
                                        out_dir / f"{metric}_{setting.slug}"):
                    print(path)
    return plotted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="run folders, sweep folders or folders with runs")
    parser.add_argument("--out", type=Path, required=True, help="folder for the PNG and PDF files")
    parser.add_argument("--metric", nargs="+", default=None, dest="metrics",
                        help=f"metrics.jsonl columns to plot (default: {' '.join(METRIC_LABELS)})")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.paths)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.metrics and (absent := [m for m in args.metrics if m not in run_columns(runs)]):
        print(f"error: no run has the column {', '.join(absent)}; the runs' columns: "
              f"{', '.join(run_columns(runs))}", file=sys.stderr)
        return 2
    plot_runs(runs, args.metrics or list(METRIC_LABELS), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
