"""Host tooling: what runs on the machine that starts Flower, never inside a ClientApp or ServerApp
(nothing under ``fedact_app`` outside this package imports it, but for :mod:`.procs`, which a
SuperNode's warm worker, ``fedact_app.node_worker``, uses to tell whether its SuperNode still runs
and for the malloc settings of the workers it starts, and ``fedact_app.timeline`` to tell when the
ServerApp's process started).

- :mod:`.launch` - ``python3 -m fedact_app.cli.launch``: the app on a private simulation SuperLink.
- :mod:`.engine` - one private SuperLink (:mod:`.superlink`) and one Ray cluster
  (:mod:`.ray_cluster`; one per run when runs compute side by side) serving many runs: the
  launcher's one run, a sweep's, a study's.
- :mod:`.flwr` - the ``flwr`` CLI and the Control API as the engine and
  ``scripts/deploy/local_cluster.py`` drive them: console scripts, a ``FLWR_HOME`` with one
  connection, run configs as TOML, JSON answers, submitting a run and following it to the end.
- :mod:`.resources` - each simulated client's GPU share when ``--num-gpus`` is not given.
- :mod:`.procs` - process trees (``/proc``): what is alive, what a process spawned, signals.
"""
