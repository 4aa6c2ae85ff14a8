"""Which clients take part in a round: a function of the run's seed, the round and the clients'
own identities, never of Flower's node ids.

Flower gives the nodes of a simulation new random node ids at every launch, and a deployment's
ids are whatever its SuperLink handed out; sampling over node ids would make the client sequence
a fresh permutation each time, so that neither one seed repeats a run nor two methods at one
seed see the same clients. So each node first tells the server who it is (the ClientApp's query
handler, ``IDENTITY_RECORD``), and the server samples over those identities:

    a benchmark partition   ``partition-id = i``      -> key (0, i, "")
    a node with its own data ``client-name = name``   -> key (1, 0, name)
                             (``client-name`` from the node config, default its ``data-path``)
    a node that could not say (its query failed)     -> key (2, node id, "")

Round r's sample draws from the sorted keys with a generator seeded by (purpose, seed, r) alone,
so it does not depend on earlier rounds (a resumed run samples what a straight run does) nor on
whether evaluation is sampled too. Plain Python: no Flower, no torch.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import TypeVar

IDENTITY_RECORD = "identity"  # ConfigRecord of a query reply: "partition-id" or "client-name"
PARTITION_ID = "partition-id"
CLIENT_NAME = "client-name"

ClientKey = tuple[int, int, str]
T = TypeVar("T")


def client_key(identity: Mapping[str, object]) -> ClientKey:
    """The sort key of a client's identity record (module docstring); ValueError for a record
    that holds neither a non-negative integer ``partition-id`` nor a non-empty ``client-name``."""
    partition = identity.get(PARTITION_ID)
    if isinstance(partition, int) and not isinstance(partition, bool) and partition >= 0:
        return (0, partition, "")
    name = identity.get(CLIENT_NAME)
    if isinstance(name, str) and name:
        return (1, 0, name)
    raise ValueError(f"an identity needs a {PARTITION_ID!r} >= 0 or a non-empty {CLIENT_NAME!r}; "
                     f"got {dict(identity)!r}")


def unidentified_key(node_id: int) -> ClientKey:
    """The key of a node whose identity query failed: after every identified client."""
    return (2, node_id, "")


def describe(key: ClientKey) -> str:
    """A key as the log names it."""
    kind, number, name = key
    return (f"{PARTITION_ID}={number}", f"{CLIENT_NAME}={name!r}", f"unidentified node {number}")[kind]


def column_value(key: ClientKey) -> int | str:
    """A key as metrics.jsonl's ``sampled_clients`` lists it: the partition id, the client name,
    or ``"node <id>"`` for an unidentified node."""
    kind, number, name = key
    return (number, name, f"node {number}")[kind]


def sample_count(available: int, fraction: float, minimum: int) -> int:
    """max(fraction * available, minimum) clients, at most ``available``."""
    return min(available, max(int(available * fraction), minimum))


def sample_clients(clients: Iterable[T], count: int, *, seed: int, server_round: int,
                   purpose: str) -> list[T]:
    """``count`` of ``clients`` (sortable: keys, or (key, node id) pairs) drawn without
    replacement from their sorted order by a generator seeded by ``purpose`` ("train" or
    "evaluate"), ``seed`` and ``server_round`` alone."""
    rng = random.Random(f"fedact/{purpose}/{seed}/{server_round}")
    return rng.sample(sorted(clients), count)
