"""A ClientApp message's work: unpack the message, call the plain training code, pack the reply.

``fedact_app.client_app`` (the ClientApp Flower loads) calls :func:`run_message` in its own process,
or has the SuperNode's warm worker (``fedact_app.node_worker``) call it there; the reply and the
``Context`` it leaves are the same either way.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from logging import WARNING

from flwr.app import ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.common.constant import ErrorCode

from fedact_app.algorithms import TensorDict
from fedact_app.checkpoint import persist_client_state, restored_client_state
from fedact_app.client_trainer import ClientTrainer, RoundResult, trainer_for
from fedact_app.config import Config, compose
from fedact_app.finite import describe_names, non_finite
from fedact_app.node_config import DATA_PATH_KEY
from fedact_app.node_worker.frames import broadcast_group
from fedact_app.node_worker.gather import ROUND_CLIENTS_KEY, Gather, Ticket
from fedact_app.node_slot import node_slot
from fedact_app.registry import FILE_DATASETS
from fedact_app.wire import packed_record, to_wire, unpacked

def node_data(context: Context, cfg: Config) -> tuple[int, int, str | None]:
    """(partition-id, num-partitions, data-path) from the node config: either the node's own
    dataset (``data-path``: (0, 1, path)) or a benchmark partition ((i, n, None))."""
    node_config = context.node_config
    if DATA_PATH_KEY not in node_config:
        return (*node_partition(context, cfg.num_clients), None)
    if "partition-id" in node_config or "num-partitions" in node_config:
        raise ValueError(
            f"The node config has both {DATA_PATH_KEY} and partition-id/num-partitions: give either "
            f"--node-config \"{DATA_PATH_KEY}='/abs/path'\" (this node's own data) or "
            f"\"partition-id=<i> num-partitions=<n>\" (a benchmark partition). "
            f"Node config seen: {dict(node_config)}")
    path = os.path.expanduser(str(node_config[DATA_PATH_KEY]))
    if not os.path.isabs(path):
        raise ValueError(f"{DATA_PATH_KEY}={path!r} must be an absolute path: the ClientApp does "
                         "not run in the directory the SuperNode was started from")
    if cfg.dataset.name not in FILE_DATASETS:
        raise ValueError(
            f"{DATA_PATH_KEY} needs a dataset config that describes this node's files (image size, "
            f"channels, classes, columns): run with dataset=<{'|'.join(FILE_DATASETS)}>, not "
            f"dataset={cfg.dataset.name}")
    if not os.path.exists(os.path.dirname(path) if "{split}" in path else path):
        raise FileNotFoundError(f"{DATA_PATH_KEY}={path!r} does not exist on this SuperNode")
    return 0, 1, path


def node_trainer(context: Context) -> tuple[ClientTrainer, int, int]:
    """(trainer, partition-id, num-partitions) for this run and this SuperNode's node config."""
    overrides = str(context.run_config.get("overrides", ""))
    partition_id, num_partitions, data_path = node_data(context, _compose(overrides))
    return trainer_for(overrides, data_path), partition_id, num_partitions


@functools.lru_cache(maxsize=2)
def _compose(overrides: str) -> Config:
    return compose(overrides)


def run_config(context: Context) -> Config:
    """The run's config, composed from its ``overrides`` (once per process and overrides)."""
    return _compose(str(context.run_config.get("overrides", "")))


def node_partition(context: Context, num_clients: int) -> tuple[int, int]:
    """(partition-id, num-partitions) from the node config, checked against the run config."""
    node_config = context.node_config
    if "partition-id" not in node_config or "num-partitions" not in node_config:
        raise ValueError(
            "This SuperNode has no partition: start it with "
            "--node-config \"partition-id=<i> num-partitions=<n>\" (simulation sets both itself). "
            f"Node config seen: {dict(node_config)}")
    partition_id, num_partitions = int(node_config["partition-id"]), int(node_config["num-partitions"])
    if num_partitions != num_clients:
        raise ValueError(
            f"num-partitions={num_partitions} in this SuperNode's node config differs from "
            f"num_clients={num_clients} in the run config: one SuperNode per client. Set "
            f"num_clients={num_partitions} in the overrides, or run {num_clients} SuperNodes: in "
            f"simulation `python -m fedact_app.cli.launch --num-supernodes {num_clients}` or `flwr run "
            f"--federation-config \"num-supernodes={num_clients}\"`; in a deployment each started with "
            f"--node-config \"partition-id=<i> num-partitions={num_clients}\".")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id={partition_id} outside [0, {num_partitions})")
    return partition_id, num_partitions


CLIENT_STATE_PREFIX = "client_state."  # Context.state key of each array dict a client keeps


def load_client_state(context: Context) -> dict[str, TensorDict]:
    """This client's arrays kept from its previous round ({} before its first round)."""
    return {key[len(CLIENT_STATE_PREFIX):]: unpacked(record)
            for key, record in context.state.array_records.items()
            if key.startswith(CLIENT_STATE_PREFIX)}


def save_client_state(context: Context, client_state: dict[str, TensorDict]) -> None:
    """Store the arrays for this client's next round in its ``Context.state`` (Flower keeps one
    context per node and run, in simulation and deployment alike, across the messages it handles)."""
    for key, arrays in client_state.items():
        context.state[CLIENT_STATE_PREFIX + key] = packed_record(arrays)


class InjectedFault(RuntimeError):
    """The failure ``debug.fail_partitions``/``debug.fail_rounds`` asks for (tests of failure handling)."""


def inject_fault(cfg: Config, partition_id: int, server_round: int) -> None:
    """Raise ``InjectedFault``, or sleep ``debug.hang_seconds`` when that is set, where the debug
    config names this partition and round."""
    debug = cfg.debug
    if partition_id in debug.fail_partitions and server_round in debug.fail_rounds:
        if debug.hang_seconds > 0:
            time.sleep(debug.hang_seconds)
            return
        raise InjectedFault(f"partition {partition_id} fails in round {server_round} as configured "
                            f"(debug.fail_partitions={debug.fail_partitions}, "
                            f"debug.fail_rounds={debug.fail_rounds})")


def kept_state(context: Context, config: ConfigRecord, partition_id: int) -> dict[str, TensorDict]:
    """The client's kept arrays: from ``Context.state``, or, when that is empty in a resumed run,
    from the checkpoint the server resumed from (fedact_app.checkpoint)."""
    own_data = DATA_PATH_KEY in context.node_config  # its partition id is not unique: nothing persisted
    return load_client_state(context) or ({} if own_data else restored_client_state(config, partition_id))


@dataclass
class TrainRequest:
    """A training message's inputs, read from its records and its node's config."""

    content: RecordDict
    context: Context
    trainer: ClientTrainer
    partition_id: int
    num_partitions: int
    work_start: float  # the reply's ``work-start``: the client's part of the round's timeline starts

    @property
    def config(self) -> ConfigRecord:
        return self.content["config"]

    def received(self) -> dict[str, TensorDict]:
        """The server's broadcast arrays (v_bar, Delta_G, c), without the model."""
        return {key: unpacked(record) for key, record in self.content.array_records.items() if key != "model"}

    def round_terms(self) -> dict[str, int | float]:
        """The round's terms from the config, as ``ClientTrainer``'s keyword arguments."""
        config = self.config
        return dict(server_round=int(config["server-round"]), lr=float(config["lr"]),
                    local_steps=int(config["local-steps"]), global_step=int(config["global-step"]))


def train_request(content: RecordDict, context: Context) -> TrainRequest:
    """The message's inputs; raises where its round is to fail (``debug.fail_partitions``)."""
    work_start = time.time()
    trainer, partition_id, num_partitions = node_trainer(context)
    inject_fault(trainer.cfg, partition_id, int(content["config"]["server-round"]))
    return TrainRequest(content, context, trainer, partition_id, num_partitions, work_start)


def train_reply(request: TrainRequest, result: RoundResult, train_seconds: float) -> RecordDict:
    """The reply's records for ``result``, the client's round, its arrays in the run's
    ``reply_dtype``; keeps the client's state in its ``Context`` (and beside the checkpoints)
    unless it holds non-finite values."""
    context, partition_id = request.context, request.partition_id
    kept = {f"{key}/{n}": t for key, arrays in result.client_state.items() for n, t in arrays.items()}
    if diverged := non_finite(kept):  # its reply is rejected too; keep the state of its last good round
        log(WARNING, "partition %d: the kept state holds non-finite values (%s); not kept",
            partition_id, describe_names(diverged))
    else:
        save_client_state(context, result.client_state)
        if DATA_PATH_KEY not in context.node_config:
            persist_client_state(request.config, partition_id, result.client_state)
    update, reply_dtype = result.update, request.trainer.cfg.reply_dtype
    reply = RecordDict({"delta": packed_record(to_wire(update.delta, reply_dtype))})
    for key, arrays in update.arrays.items():
        reply[key] = packed_record(to_wire(arrays, reply_dtype))
    # partition-id orders the server's sums and shows two nodes sharing one partition; a node
    # with its own data-path (always partition 0 of 1) sends none
    partition = {} if DATA_PATH_KEY in context.node_config else {"partition-id": partition_id}
    reply["metrics"] = MetricRecord({"num-examples": update.num_examples, "num-steps": update.num_steps,
                                     "lr-sum": update.lr_sum, "train-loss": result.loss,
                                     "train-seconds": train_seconds, "work-start": request.work_start,
                                     **partition, **result.diagnostics})
    return reply


def train_content(content: RecordDict, context: Context) -> RecordDict:
    """The train handler's work on plain records: one local round, the reply's records."""
    request = train_request(content, context)
    started = time.perf_counter()
    result = request.trainer.train_round(
        unpacked(content["model"]), request.received(), partition_id=request.partition_id,
        num_partitions=request.num_partitions, **request.round_terms(),
        client_state=kept_state(context, request.config, request.partition_id))
    # the round's local work; it ends with copies to the CPU
    return train_reply(request, result, time.perf_counter() - started)


class MessageLate(RuntimeError):
    """A batched message whose deadline passed while it waited for its batch: not trained."""


def train_contents(items: list[tuple[RecordDict, Context, float]]) -> list[RecordDict | Exception]:
    """The replies of training messages of one round, each given with its ``Context`` and its
    deadline (:func:`message_deadline`), their clients trained at once
    (``ClientTrainer.train_batch``), one batch per trainer (a node with its own ``data-path`` has
    its own): a reply per message, in order, or the exception its round raised (``MessageLate``
    past its deadline). Each reply's ``train-seconds`` is its batch's."""
    outcomes: list[RecordDict | Exception | None] = []
    batches: dict[int, list[tuple[int, TrainRequest]]] = {}
    for content, context, deadline in items:
        try:
            if (late := time.time() - deadline) > 0:
                raise MessageLate(f"not trained: the message's deadline passed {late:.1f} s before its batch began")
            request = train_request(content, context)
        except Exception as ex:  # noqa: BLE001 - this message's round fails, the others train
            outcomes.append(ex)
            continue
        batches.setdefault(id(request.trainer), []).append((len(outcomes), request))
        outcomes.append(None)
    for batch in batches.values():
        first = batch[0][1]
        try:
            started = time.perf_counter()
            results = first.trainer.train_batch(
                unpacked(first.content["model"]), first.received(),
                partition_ids=[request.partition_id for _, request in batch],
                num_partitions=first.num_partitions, **first.round_terms())
            seconds = time.perf_counter() - started
        except Exception as ex:  # noqa: BLE001 - every message of this batch fails with it
            results, seconds = [ex] * len(batch), 0.0
        for (position, request), result in zip(batch, results, strict=True):
            try:
                outcomes[position] = result if isinstance(result, Exception) else train_reply(request, result, seconds)
            except Exception as ex:  # noqa: BLE001 - this reply alone fails
                outcomes[position] = ex
    return outcomes


SKIPPED = ErrorCode.MESSAGE_UNAVAILABLE  # a message this node did not work on: past its deadline or node busy


def message_deadline(msg: Message, round_timeout: float) -> float:
    """When the server stops waiting for this message's reply (Unix time): its ``created_at``
    (the ServerApp's clock, just before the push) plus the smaller of its TTL and ``round_timeout``."""
    return msg.metadata.created_at + min(msg.metadata.ttl, round_timeout)


def run_round_timeout(context: Context) -> float:
    """The run's ``round_timeout`` (seconds the server waits for a round's replies)."""
    return run_config(context).round_timeout


def handle(msg: Message, context: Context, work: Callable[[Message, Context], RecordDict]) -> Message:
    """``work``'s reply, or an error reply without any work when the server no longer waits for one
    (the message queued past its deadline behind other nodes' work) or this node is still busy with
    an earlier message (hung or slow); either way the actor is free at once for the other nodes."""
    round_timeout = run_round_timeout(context)
    if (late := time.time() - message_deadline(msg, round_timeout)) > 0:
        return Message(Error(SKIPPED, f"skipped: the message reached the node {late:.1f} s after its "
                                      f"deadline (round_timeout={round_timeout:g} s)"), reply_to=msg)
    with node_slot(msg.metadata.run_id, msg.metadata.dst_node_id) as free:
        if not free:
            return Message(Error(SKIPPED, "skipped: the node is still working on an earlier message"),
                           reply_to=msg)
        return Message(content=work(msg, context), reply_to=msg)


def evaluate_content(msg: Message, context: Context) -> RecordDict:
    """The evaluate handler's work: the local test metrics of the received model."""
    trainer, partition_id, num_partitions = node_trainer(context)
    metrics, num_examples = trainer.evaluate_local(unpacked(msg.content["model"]),
                                                   partition_id=partition_id, num_partitions=num_partitions)
    record = MetricRecord({"num-examples": num_examples,
                           **{key.replace("_", "-"): value for key, value in metrics.items()}})
    return RecordDict({"metrics": record})


WORK: dict[str, Callable[[Message, Context], RecordDict]] = {
    "train": lambda msg, context: train_content(msg.content, context),
    "evaluate": evaluate_content,
}


def prepare(context: Context) -> None:
    """Build what this node's messages of the run will need (the trainer: task, model, optimizer)
    and read the node's training data, ahead of its first message; nothing where the machine's
    batching worker trains the node and the run evaluates on no client (``client_batch=true``,
    ``fraction_evaluate=0``): the node's warm worker then gets no message."""
    cfg = run_config(context)
    if cfg.client_batch and cfg.fraction_evaluate == 0:
        return
    trainer, partition_id, num_partitions = node_trainer(context)
    trainer.task.describe_train_data(partition_id, num_partitions)


def run_batched_train(msg: Message, context: Context, gather: Gather, ticket: Ticket | None = None) -> Message:
    """The reply to a training message of a run with ``client_batch=true``: its client trained at
    once with the other clients of its round that ``gather`` puts in its batch (``ticket``: the
    one the worker opened for this message as it accepted the connection, ``Gather.open_ticket``)."""
    config = msg.content["config"]
    if ROUND_CLIENTS_KEY not in config:
        raise ValueError(f"A training message of a client_batch=true run lacks {ROUND_CLIENTS_KEY!r} in its "
                         "config (the number of the round's training messages, which this app's ServerApp "
                         f"sends); config keys seen: {sorted(config)}")
    if (group := broadcast_group(msg)) is None:
        raise ValueError(f"A training message of a client_batch=true run lacks an integer 'server-round' in its "
                         f"config; config keys seen: {sorted(config)}")
    cfg = run_config(context)
    deadline = message_deadline(msg, cfg.round_timeout)
    return handle(msg, context, lambda msg, context: gather.submit(
        group, int(config[ROUND_CLIENTS_KEY]), cfg.client_batch_wait, (msg.content, context, deadline), ticket))


def run_message(kind: str, msg: Message, context: Context) -> Message:
    """The reply to a ``kind`` ("train" or "evaluate") message, worked on in this process."""
    return handle(msg, context, WORK[kind])
