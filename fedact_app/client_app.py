"""Flower ClientApp: a message's work (``fedact_app.client_work``) done in this process, or in the
SuperNode's warm worker (``fedact_app.node_worker``) where there is one.

In a deployment Flower starts this process for every message, so it imports only Flower and the
small modules below: torch, timm and Hydra are imported where the work is done.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedact_app.node_config import client_identity
from fedact_app.node_worker import forward
from fedact_app.node_worker.gather import CLIENT_BATCH_KEY
from fedact_app.sampling import IDENTITY_RECORD

app = ClientApp()


@app.query()
def identify(msg: Message, context: Context) -> Message:
    """Answer the server's identity query from the node config alone (no data, no model); where a
    warm worker will serve the node, have it get ready for round 1 meanwhile."""
    identity = ConfigRecord(client_identity(context.node_config))
    if forward.wanted(context):
        forward.prepare(context)
    return Message(content=RecordDict({IDENTITY_RECORD: identity}), reply_to=msg)


def reply(kind: str, msg: Message, context: Context) -> Message:
    """The reply to a ``kind`` message: from the machine's batching worker where the run trains
    its clients in batches (a training message), or from the node's warm worker where one takes
    it, else worked on here."""
    if kind == "train" and batched(msg) and forward.allowed(context):
        if (answer := forward.forward(kind, msg, context, batched=True)) is not None:
            return answer
    elif forward.wanted(context) and (answer := forward.forward(kind, msg, context)) is not None:
        return answer
    from fedact_app import client_work  # torch, timm, Hydra: only in the process that does the work

    return client_work.run_message(kind, msg, context)


def batched(msg: Message) -> bool:
    """The server asks for this round's clients to be trained in batches (``client_batch=true``)."""
    config = msg.content.config_records.get("config")
    return config is not None and bool(config.get(CLIENT_BATCH_KEY, False))


@app.train()
def train(msg: Message, context: Context) -> Message:
    return reply("train", msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return reply("evaluate", msg, context)
