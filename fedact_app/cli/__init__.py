"""Host tooling: what runs on the machine that starts Flower, never inside a ClientApp or ServerApp
(nothing under ``fedact_app`` outside this package imports it).

- :mod:`.launch` - ``python3 -m fedact_app.cli.launch``: the app on a private simulation SuperLink.
- :mod:`.flwr` - the ``flwr`` CLI as both the launcher and ``scripts/deploy/local_cluster.py`` drive
  it: its console scripts, a ``FLWR_HOME`` with one connection, run configs as TOML, its JSON
  answers, submitting a run and following it to the end.
- :mod:`.procs` - process trees (``/proc``): what is alive, what a process spawned, signals.
"""
