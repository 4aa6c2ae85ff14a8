"""The floor of a Flower 1.41 run for a PyTorch app: the FedACT app's federation and messages,
no compute. ``scripts/bench_run.py`` runs it next to the app to show what Flower itself costs.

The ServerApp does what the FedACT ServerApp does around its compute: it waits for its
``num-nodes`` SuperNodes, asks each once who it is in round 1 (a QUERY message, as the strategy
identifies its clients), and for ``num-rounds`` rounds sends ``clients-per-round`` nodes a training message
carrying a record of float32 values for each of ``shapes-out`` (the global model and the method's
broadcast arrays) and collects their replies with the app's own reply loop
(``fedact_app.strategy.exchange``). A ClientApp answers at once with a record for each of
``shapes-back`` (the model delta and the method's reply arrays). No model, data, training,
aggregation, evaluation or EVALUATE messages: what is left is Flower's processes, Ray, the message
path, the serialisation of messages of the app's size, and the imports of flwr and NumPy (the
ServerApp also imports torch and the parts of ``fedact_app`` its reply loop needs; not the task's:
timm, Hydra, data).
The ServerApp writes each round's seconds to ``output`` and, when every message had its reply,
tells a local engine it has ended (``fedact_app.serverapp_done``), as the app does. It runs where
``fedact_app`` is installed (``pip install -e .``): the app's package comes from there, not from
this folder's FAB.

Flower's simulation hands a pushed message to the ClientApps when its dispatch loop next polls
(every 0.1 s, ``vce_api.add_messages_to_queue``). Rounds that compute nothing lock to that loop
and wait nearly the whole period; a round that computes starts at a random point of it.
``phase-jitter`` > 0 waits a seeded uniform random time up to that many seconds before each
round, outside the round's clock, so that the rounds measure the wait a computing round has.

The app packs each record into one array per dtype and a layout array naming its tensors
(``fedact_app.wire.packed_record``), so ``scripts/bench_run.py`` gives the floor one shape per
record, the record's values flat, and the floor packs each as the app does a record of float32
tensors: a layout array and the values (a model's integer buffers travel as float32 here).
Flower 1.41 moves a message as content-addressed objects, one per array (and its 5 MiB chunks),
so equal arrays of a message are one object. The arrays are zeros, so those of one shape are one
object: a message holds fewer objects than the app's, whose model, Delta_G, v_bar and replies
differ from each other and from message to message. ``distinct-arrays = true`` gives every
array its own content (uniform random values seeded by the round, the node and the record), so
that a message is as many objects as the app's (exactly as many on ``cnn_small`` and ViT-Tiny,
whose tensors are all float32 and trainable) and, as the app's, shares none with another node's
message: every 5 MiB chunk differs.
"""

from __future__ import annotations

import functools
import json
import random
import time
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()
TIMEOUT = 600.0  # seconds the ServerApp waits for its nodes, and a round for its replies


@functools.lru_cache(maxsize=4)
def records(shapes_json: str, salt: tuple[int, ...] | None = None) -> dict[str, ArrayRecord]:
    """One ArrayRecord per shape, as ``fedact_app.wire`` packs the app's records: a float32 array
    of that shape and a ``layout`` array of UTF-8 JSON naming it; the arrays zeros, or with
    ``salt`` each of its own content (module docstring)."""
    out = {}
    for i, shape in enumerate(json.loads(shapes_json)):
        values = np.zeros(shape, np.float32) if salt is None else \
            np.random.default_rng([*salt, i]).random(shape, dtype=np.float32)
        layout = np.frombuffer(json.dumps([["values", "float32", shape]]).encode(), np.uint8)
        out[str(i)] = ArrayRecord({"layout": Array(layout.copy()), "float32": Array(values.reshape(-1))})
    return out


@server.main()
def main(grid: Grid, context: Context) -> None:
    # the app's own reply loop and end signal (torch): imported here, so a ClientApp of this
    # module imports Flower and NumPy alone, as a ClientApp that hands its work to a warm
    # worker does (fedact_app.client_app)
    from fedact_app.serverapp_done import mark_done
    from fedact_app.strategy import exchange

    config = context.run_config
    rounds, per_round, num_nodes = (int(config[key]) for key in ("num-rounds", "clients-per-round", "num-nodes"))
    deadline = time.monotonic() + TIMEOUT
    while len(nodes := sorted(grid.get_node_ids())) < num_nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(nodes)} of {num_nodes} SuperNodes connected in {TIMEOUT:.0f} s")
        time.sleep(0.1)
    sampler, phase = random.Random(int(config["seed"])), random.Random(int(config["seed"]) + 1)
    seconds, answered = [], True
    for server_round in range(1, rounds + 1):
        time.sleep(phase.uniform(0.0, float(config["phase-jitter"])))
        started = time.perf_counter()
        if server_round == 1:  # the app identifies its clients within round 1, so the floor does too
            queries = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=node)
                       for node in nodes]
            answered = len(exchange(grid, queries, TIMEOUT)) == len(queries)
        salt = (server_round,) if config["distinct-arrays"] else None
        content = RecordDict({**records(str(config["shapes-out"]), salt),
                              "config": ConfigRecord({"server-round": server_round})})
        messages = [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
                    for node in sorted(sampler.sample(nodes, per_round))]
        answered &= len(exchange(grid, messages, TIMEOUT)) == len(messages)
        seconds.append(time.perf_counter() - started)
    if config["output"]:
        Path(str(config["output"])).write_text(json.dumps({"rounds": seconds, "answered": answered}))
    if answered:
        mark_done(context.run_id)


@client.query()
def identify(msg: Message, context: Context) -> Message:
    return Message(content=RecordDict({"identity": ConfigRecord({})}), reply_to=msg)


@client.train()
def train(msg: Message, context: Context) -> Message:
    salt = (int(msg.content["config"]["server-round"]), context.node_id) if context.run_config["distinct-arrays"] else None
    return Message(content=RecordDict(records(str(context.run_config["shapes-back"]), salt)), reply_to=msg)
