"""What a SuperNode's node config says to the ClientApp: who the client is, where its own data
lives, and whether its messages go to a warm worker. Plain Python: no torch, no Flower.

Keys (``flower-supernode --node-config "key=value ..."``; simulation sets the partition itself):

    partition-id, num-partitions   a benchmark partition i of n (``fedact_app.tasks``)
    data-path                      this node's own dataset, an absolute path (instead of a partition)
    client-name                    a data-path node's name for the server's sampling (default: its data-path)
    warm-worker                    false/0/off: every message cold in the ClientApp process
                                   (default on in a deployment: ``fedact_app.node_worker``)
    warm-worker-idle               seconds a warm worker waits for its next message before it ends
"""

from __future__ import annotations

from collections.abc import Mapping

from fedact_app.sampling import CLIENT_NAME, PARTITION_ID

DATA_PATH_KEY = "data-path"
WARM_WORKER_KEY = "warm-worker"
WARM_WORKER_IDLE_KEY = "warm-worker-idle"
DEFAULT_WORKER_IDLE = 600.0  # seconds: a node not sampled for many rounds keeps its worker
_SWITCH = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


def client_identity(node_config: Mapping[str, object]) -> dict:
    """Who this client is, for the server's sampling (fedact_app.sampling): its ``partition-id``,
    or for a node with its own ``data-path`` its ``client-name`` (node config; default: the
    data-path, so give each such node its own ``client-name`` where paths repeat)."""
    if DATA_PATH_KEY in node_config:
        return {CLIENT_NAME: str(node_config.get(CLIENT_NAME, node_config[DATA_PATH_KEY]))}
    if PARTITION_ID not in node_config:
        raise ValueError("This SuperNode has no partition: start it with --node-config "
                         f"\"partition-id=<i> num-partitions=<n>\" or \"{DATA_PATH_KEY}='/abs/path'\". "
                         f"Node config seen: {dict(node_config)}")
    return {PARTITION_ID: int(node_config[PARTITION_ID])}  # type: ignore[call-overload]


def switch(value: object, name: str) -> bool:
    """A yes/no setting given as a bool, 0/1 or one of true/false/on/off/yes/no (any case)."""
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() in _SWITCH:
        return _SWITCH[str(value).strip().lower()]
    raise ValueError(f"{name}={value!r}: expected true/false (or 1/0, on/off, yes/no)")


def worker_idle_timeout(node_config: Mapping[str, object]) -> float:
    """``warm-worker-idle`` in seconds (> 0), default ``DEFAULT_WORKER_IDLE``."""
    raw = node_config.get(WARM_WORKER_IDLE_KEY, DEFAULT_WORKER_IDLE)
    try:
        seconds = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"{WARM_WORKER_IDLE_KEY}={raw!r}: expected a number of seconds > 0")
    return seconds
