"""Flower ClientApp: unpack the message, call the plain training code, pack the reply."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedact_app.algorithms import TensorDict
from fedact_app.client_trainer import trainer_for

app = ClientApp()


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
            f"num-partitions={num_partitions} (the number of SuperNodes) differs from "
            f"num_clients={num_clients} in the run config: set num_clients={num_partitions} in the "
            f"overrides, or run with --federation-config \"num-supernodes={num_clients}\".")
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id={partition_id} outside [0, {num_partitions})")
    return partition_id, num_partitions


CLIENT_STATE_PREFIX = "client_state."  # Context.state key of each array dict a client keeps


def load_client_state(context: Context) -> dict[str, TensorDict]:
    """This client's arrays kept from its previous round ({} before its first round)."""
    return {key[len(CLIENT_STATE_PREFIX):]: record.to_torch_state_dict()
            for key, record in context.state.array_records.items()
            if key.startswith(CLIENT_STATE_PREFIX)}


def save_client_state(context: Context, client_state: dict[str, TensorDict]) -> None:
    """Store the arrays for this client's next round in its ``Context.state`` (Flower keeps one
    context per node and run, in simulation and deployment alike, across the messages it handles)."""
    for key, arrays in client_state.items():
        context.state[CLIENT_STATE_PREFIX + key] = ArrayRecord(arrays)


def train_content(content: RecordDict, context: Context) -> RecordDict:
    """The train handler's work on plain records: one local round, the reply's records."""
    trainer = trainer_for(str(context.run_config.get("overrides", "")))
    partition_id, num_partitions = node_partition(context, trainer.cfg.num_clients)
    config = content["config"]
    received = {key: record.to_torch_state_dict()
                for key, record in content.array_records.items() if key != "model"}
    result = trainer.train_round(
        content["model"].to_torch_state_dict(), received, partition_id=partition_id,
        num_partitions=num_partitions, server_round=int(config["server-round"]),
        lr=float(config["lr"]), local_steps=int(config["local-steps"]),
        global_step=int(config["global-step"]), client_state=load_client_state(context))
    save_client_state(context, result.client_state)
    update = result.update
    reply = RecordDict({"delta": ArrayRecord(update.delta)})
    for key, arrays in update.arrays.items():
        reply[key] = ArrayRecord(arrays)
    reply["metrics"] = MetricRecord({"num-examples": update.num_examples, "num-steps": update.num_steps,
                                     "lr-sum": update.lr_sum, "train-loss": result.loss})
    return reply


@app.train()
def train(msg: Message, context: Context) -> Message:
    return Message(content=train_content(msg.content, context), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    trainer = trainer_for(str(context.run_config.get("overrides", "")))
    partition_id, num_partitions = node_partition(context, trainer.cfg.num_clients)
    stats = trainer.evaluate_local(msg.content["model"].to_torch_state_dict(),
                                   partition_id=partition_id, num_partitions=num_partitions)
    metrics = MetricRecord({"num-examples": stats.num_examples, "test-loss": stats.loss,
                            "test-accuracy": stats.accuracy})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
