"""How a ServerApp tells a local engine (``fedact_app.cli.engine.LocalEngine``) that it has ended
with its results written and none of its clients still working: it logs :func:`done_line` with a
new random token, then writes the token into a file named after the run id in the folder
``$FEDACT_ENGINE_DONE_DIR`` names. The engine's next run may then start while Flower shuts this one
down, and a lone run's launcher, once that line has reached it through the log stream (so that it
holds all that the ServerApp logged before), stops without waiting for that shutdown; the token
keeps a line that anything else printed from counting. Outside an engine's runs the variable is
not set and nothing is logged or written."""

from __future__ import annotations

import os
import secrets
from logging import INFO
from pathlib import Path

DONE_DIR_ENV = "FEDACT_ENGINE_DONE_DIR"


def done_line(run_id: int, token: str) -> str:
    """The log line :func:`mark_done` writes before the run's file, which holds ``token``."""
    return f"ServerApp of run {int(run_id)} ended: results written, no client working ({token})"


def mark_done(run_id: int) -> None:
    """Log :func:`done_line`, then write the run's file (a folder that cannot be written to only
    costs the overlap and the early stop)."""
    folder = os.environ.get(DONE_DIR_ENV)
    if folder:
        from flwr.common import log  # (the engine imports this module, and is kept free of Flower's imports)

        token = secrets.token_hex(8)
        log(INFO, "%s", done_line(run_id, token))
        path = Path(folder) / str(int(run_id))
        try:  # written whole, then named: a reader never finds the file without its token
            path.with_suffix(".partial").write_text(token)
            os.replace(path.with_suffix(".partial"), path)
        except OSError:
            pass
