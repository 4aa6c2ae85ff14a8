"""How a ServerApp tells a local engine (``fedact_app.cli.engine.LocalEngine``) that it has ended
with its results written and none of its clients still working: it logs :func:`done_line`, then
writes an empty file named after the run id in the folder ``$FEDACT_ENGINE_DONE_DIR`` names. The
engine's next run may then start while Flower shuts this one down, and a lone run's launcher,
once the line has reached it through the log stream (so that it holds the ServerApp's whole log),
stops without waiting for that shutdown. Outside an engine's runs the variable is not set and
nothing is logged or written."""

from __future__ import annotations

import os
from logging import INFO
from pathlib import Path

DONE_DIR_ENV = "FEDACT_ENGINE_DONE_DIR"


def done_line(run_id: int) -> str:
    """The log line :func:`mark_done` writes before the run's file."""
    return f"ServerApp of run {int(run_id)} ended: results written, no client working"


def mark_done(run_id: int) -> None:
    """Log :func:`done_line`, then write the run's file (a folder that cannot be written to only
    costs the overlap and the early stop)."""
    folder = os.environ.get(DONE_DIR_ENV)
    if folder:
        from flwr.common import log  # (the engine imports this module, and is kept free of Flower's imports)

        log(INFO, "%s", done_line(run_id))
        try:
            (Path(folder) / str(int(run_id))).touch()
        except OSError:
            pass
