"""The paper's tables from run folders: Markdown and LaTeX (booktabs).

    python3 scripts/table.py sweeps/20260101-120000
    python3 scripts/table.py sweeps/a sweeps/b outputs/ --metric best --out tables
    python3 scripts/table.py sweeps/llama --column test_perplexity      # language runs

``--column`` picks the metrics.jsonl column (default ``test_accuracy``, in %; a loss or
perplexity column is better when lower, and its best cell is the lowest).

Rows are methods in the paper's order (FedAvg, FedProx, SCAFFOLD, FedAdam, LocalAdam, LocalAdamW,
FedLADA, FedAdamW, FedACT-Local, FedACT; those present); columns are grouped by model, then dataset,
then partition (``Dir-0.6`` ..., ``IID``). A cell is the test accuracy in % (``final``: last
evaluated round, default; ``best``: max over rounds), ``mean ± std`` (sample std) over seeds when
there are several, ``–`` when the method has no run there; the best cell of each column is bold
(every tied one). Only completed runs count: runs without summary.json and jobs a sweep summary
lists with another status are skipped with a warning (fedact_app.report). Writes ``<out>/table.md``
and ``<out>/table.tex`` (needs \\usepackage{booktabs,multirow,graphicx}) and prints the Markdown.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Callable, Optional

APP_DIR = Path(__file__).resolve().parents[1]
if str(APP_DIR) not in sys.path:
    sys.path.insert(0, str(APP_DIR))

from fedact_app.report import (  # noqa: E402
    DATASETS, MODELS, VALUE_KINDS, ReportError, Setting, in_percent, load_runs, lower_is_better, run_columns,
    value_cells)

Cells = dict[str, dict[Setting, tuple[float, Optional[float]]]]
CAPTIONS = {"final": "at the last evaluated round", "best": "best over rounds"}


@dataclass(frozen=True)
class Style:
    """How one output format writes a cell."""

    bold: Callable[[str], str]
    plus_minus: str
    missing: str
    escape: Callable[[str], str] = str


def tex_escape(text: str) -> str:
    """Escape the LaTeX special characters a name may hold."""
    for char in "\\&%$#_{}":
        text = text.replace(char, "\\" + char)
    return text


MARKDOWN = Style(bold=lambda s: f"**{s}**", plus_minus=" ± ", missing="–")
LATEX = Style(bold=lambda s: f"\\textbf{{{s}}}", plus_minus=" $\\pm$ ", missing="--", escape=tex_escape)


def table_columns(cells: Cells) -> list[Setting]:
    """Every setting some method has a cell for: model, then dataset, then partition."""
    return sorted({setting for row in cells.values() for setting in row}, key=Setting.sort_key)


def column_best(cells: Cells, column: Setting, lower: bool) -> float:
    """The best mean of a column (the lowest when ``lower``), rounded to the 2 decimals shown (so
    ties are the shown ties)."""
    means = [round(row[column][0], 2) for row in cells.values() if column in row]
    return min(means) if lower else max(means)


def format_cell(cell: Optional[tuple[float, Optional[float]]], best: float, style: Style) -> str:
    """``12.34`` or ``12.34 ± 0.56``, bold when its rounded mean is the column's best."""
    if cell is None:
        return style.missing
    mean, std = cell
    text = f"{mean:.2f}" if std is None else f"{mean:.2f}{style.plus_minus}{std:.2f}"
    return style.bold(text) if round(mean, 2) == best else text


def body_rows(cells: Cells, columns: list[Setting], style: Style, lower: bool) -> list[list[str]]:
    """One row of cell texts per method, the method's name first."""
    best = {column: column_best(cells, column, lower) for column in columns}
    return [[style.escape(method)] + [format_cell(row.get(c), best[c], style) for c in columns]
            for method, row in cells.items()]


def caption(column: str, kind: str) -> str:
    """The table's caption text (plain; LaTeX escapes its % and _ itself)."""
    what = column.replace("_", " ").capitalize() + (" (%)" if in_percent(column) else "")
    better = ", lower is better" if lower_is_better(column) else ""
    return f"{what} {CAPTIONS[kind]}{better}, mean ± std over seeds where there are several."


def markdown_table(cells: Cells, column: str, kind: str) -> str:
    """The table in Markdown: one header row naming model / dataset / partition per column."""
    columns = table_columns(cells)
    header = ["Method"] + [f"{MODELS.get(c.model, c.model)} / {DATASETS.get(c.dataset, c.dataset)}"
                           f" / {c.heterogeneity}" for c in columns]
    lines = [caption(column, kind), "", "| " + " | ".join(header) + " |",
             "|---|" + "---:|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in body_rows(cells, columns, MARKDOWN, lower_is_better(column))]
    return "\n".join(lines) + "\n"


def header_groups(columns: list[Setting], level: Callable[[Setting], tuple]) -> list[tuple[str, int, int]]:
    """Consecutive columns sharing ``level`` (a tuple ending in the label): (label, first, last),
    counted from 2 as LaTeX columns are (column 1 holds the method)."""
    groups, start = [], 2
    for key, members in groupby(columns, key=level):
        span = len(list(members))
        groups.append((key[-1], start, start + span - 1))
        start += span
    return groups


def latex_header(columns: list[Setting]) -> list[str]:
    """The model and dataset rows (\\multicolumn, \\cmidrule under each) and the partition row."""
    by_model = header_groups(columns, lambda c: (MODELS.get(c.model, c.model),))
    by_dataset = header_groups(columns, lambda c: (c.model, DATASETS.get(c.dataset, c.dataset)))
    lines = []
    for prefix, groups in (("\\multirow{3}{*}{\\textbf{Method}}", by_model), ("", by_dataset)):
        titles = [f"\\multicolumn{{{last - first + 1}}}{{c}}{{\\textbf{{{tex_escape(label)}}}}}"
                  for label, first, last in groups]
        lines.append(f"  {prefix} & " + " & ".join(titles) + " \\\\")
        lines.append("  " + " ".join(f"\\cmidrule(lr){{{first}-{last}}}" for _, first, last in groups))
    lines.append("  & " + " & ".join(c.heterogeneity for c in columns) + " \\\\")
    return lines


def latex_table(cells: Cells, column: str, kind: str) -> str:
    """The table as a LaTeX table* with booktabs rules and the paper's three header rows."""
    columns = table_columns(cells)
    tex_caption = tex_escape(caption(column, kind)).replace("±", "$\\pm$")
    lines = ["% \\usepackage{booktabs,multirow,graphicx}", "\\begin{table*}[!ht]", "  \\centering",
             f"  \\caption{{{tex_caption}}}",
             "  \\label{tab:results}", "  \\resizebox{1.0\\linewidth}{!}{",
             f"\\begin{{tabular}}{{l{'c' * len(columns)}}}", "  \\toprule"]
    lines += latex_header(columns)
    lines.append("  \\midrule")
    lines += ["  " + " & ".join(row) + " \\\\"
              for row in body_rows(cells, columns, LATEX, lower_is_better(column))]
    lines += ["  \\bottomrule", "\\end{tabular}", "  }", "\\end{table*}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="sweep folders, run folders or folders with runs")
    parser.add_argument("--metric", choices=VALUE_KINDS, default="final",
                        help="final: last evaluated round (default); best: max (min for a loss) over rounds")
    parser.add_argument("--column", default="test_accuracy",
                        help="the metrics.jsonl column (default test_accuracy; e.g. test_perplexity)")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for table.md and table.tex")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.paths)
        cells = value_cells(runs, args.column, args.metric)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not cells:
        print(f"error: no run has {args.column}; the runs' columns: {', '.join(run_columns(runs))}",
              file=sys.stderr)
        return 2
    markdown = markdown_table(cells, args.column, args.metric)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(markdown)
    (args.out / "table.tex").write_text(latex_table(cells, args.column, args.metric))
    print(markdown)
    print(args.out / "table.md")
    print(args.out / "table.tex")
    return 0


if __name__ == "__main__":
    sys.exit(main())
