"""A warm worker per SuperNode: a deployment's ClientApp messages served by one long-lived process.

Flower 1.41 starts a fresh ``flwr-clientapp`` process for every message a SuperNode receives, so
each would pay Python's start, the imports of torch and timm, the task (data, model, optimizer)
and a CUDA context. Instead, the ClientApp (``fedact_app.client_app``) imports only Flower and
:mod:`.forward`, which hands the message and its ``Context`` to the node's worker (:mod:`.serve`)
over a Unix socket in a private folder (:mod:`.channel`) and returns the worker's reply and the
``Context`` its work left, as a cold ClientApp would have computed them.

One worker serves one SuperNode process, one run and one run and node configuration; it ends
when its SuperNode is gone, after ``warm-worker-idle`` seconds without a message (node config,
default 600), or on SIGTERM (``python -m fedact_app.node_worker stop``). ``python -m
fedact_app.node_worker list`` shows the user's workers on the machine. Off with the node config
``warm-worker=false`` or ``FEDACT_WARM_WORKER=0`` in the SuperNode's environment.
"""
