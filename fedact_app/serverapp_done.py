"""How a ServerApp tells a local engine (``fedact_app.cli.engine.LocalEngine``) that it has ended
with none of its clients still working, so that the engine's next run can start while Flower
shuts this one down: an empty file named after the run id in the folder ``$FEDACT_ENGINE_DONE_DIR``
names. Outside an engine's runs the variable is not set and nothing is written."""

from __future__ import annotations

import os
from pathlib import Path

DONE_DIR_ENV = "FEDACT_ENGINE_DONE_DIR"


def mark_done(run_id: int) -> None:
    """Write the run's file (a folder that cannot be written to only costs the overlap)."""
    folder = os.environ.get(DONE_DIR_ENV)
    if folder:
        try:
            (Path(folder) / str(int(run_id))).touch()
        except OSError:
            pass
