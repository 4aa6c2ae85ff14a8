"""Flower ClientApp: unpack the message, call the plain training code, pack the reply."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

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


@app.train()
def train(msg: Message, context: Context) -> Message:
    trainer = trainer_for(str(context.run_config.get("overrides", "")))
    partition_id, num_partitions = node_partition(context, trainer.cfg.num_clients)
    config = msg.content["config"]
    received = {key: record.to_torch_state_dict()
                for key, record in msg.content.array_records.items() if key != "model"}
    update, loss = trainer.train_round(
        msg.content["model"].to_torch_state_dict(), received, partition_id=partition_id,
        num_partitions=num_partitions, server_round=int(config["server-round"]),
        lr=float(config["lr"]), local_steps=int(config["local-steps"]),
        global_step=int(config["global-step"]))
    content = RecordDict({"delta": ArrayRecord(update.delta)})
    for key, arrays in update.arrays.items():
        content[key] = ArrayRecord(arrays)
    content["metrics"] = MetricRecord({"num-examples": update.num_examples, "num-steps": update.num_steps,
                                       "lr-sum": update.lr_sum, "train-loss": loss})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    trainer = trainer_for(str(context.run_config.get("overrides", "")))
    partition_id, num_partitions = node_partition(context, trainer.cfg.num_clients)
    stats = trainer.evaluate_local(msg.content["model"].to_torch_state_dict(),
                                   partition_id=partition_id, num_partitions=num_partitions)
    metrics = MetricRecord({"num-examples": stats.num_examples, "test-loss": stats.loss,
                            "test-accuracy": stats.accuracy})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
