"""The Flower ``Strategy``: moves a method's arrays in and out of Flower records.

Each round it samples nodes, sends every sampled node one ``RecordDict``::

    "model":  ArrayRecord   global state x^r (parameters and buffers)
    <key>:    ArrayRecord   the server rule's broadcast arrays (FedACT: "v_bar", "delta_g")
    "config": ConfigRecord  server-round, local-steps, lr, global-step

(the broadcast arrays in ``wire_dtype``: float32 by default, bfloat16/float16 halve their bytes)

and expects back::

    "delta":   ArrayRecord  x_i^{r,K} - x^r
    <key>:     ArrayRecord  the local rule's reply arrays (FedACT: "v")
    "metrics": MetricRecord num-examples, num-steps, lr-sum, train-loss, train-seconds,
                            partition-id (none from a node with its own data-path) and the
                            trust-score statistics the client sampled
                            (fedact_app.diagnostics)

The arithmetic lives in the method's ``ServerRule`` (fedact_app.algorithms); this class holds
no method state of its own. Replies that are errors or do not match the model are rejected
(logged with node id and reason, counted in the round's metrics) and never reach the rule. Each
round's metrics carry the seed's diagnostics over the accepted replies: direction consistency,
||Delta_G|| and the clients' trust-score statistics (fedact_app.diagnostics).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedact_app.algorithms import ClientUpdate, ServerRule, TensorDict
from fedact_app.diagnostics import direction_consistency, global_norm, mean_client_statistics
from fedact_app.wire import array_record, to_wire


ALL_NODES_WAIT = 30.0  # seconds the first round waits for every expected node to register
REPLY_POLL = (0.005, 0.05)  # first and longest wait between two pulls of replies, seconds


def exchange(grid: Grid, messages: Iterable[Message], timeout: float | None) -> list[Message]:
    """Push ``messages`` and pull their replies until all have come or ``timeout`` seconds passed.

    What ``Grid.send_and_receive`` does, without its fixed sleep between two pulls (Flower 1.41:
    3 s in a deployment's ``HttpGrid``, 0.1 s in simulation's ``InMemoryGrid``), which a round
    then waits on top of its work. The wait between pulls starts at ``REPLY_POLL[0]`` and grows
    by half each time up to ``REPLY_POLL[1]``: a round learns of its last reply within 50 ms,
    with twenty pulls a second while clients train (a pull is one small query of the SuperLink;
    a cap of 0.25 s cost a simulated round about 0.1 s more, docs/PERFORMANCE.md).
    """
    pending = set(grid.push_messages(messages))
    replies: list[Message] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    wait = REPLY_POLL[0]
    while pending:
        pulled = list(grid.pull_messages(pending))
        replies.extend(pulled)
        pending.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
        left = math.inf if deadline is None else deadline - time.monotonic()
        if not pending or left <= 0:
            break
        time.sleep(min(wait, left))
        wait = min(1.5 * wait, REPLY_POLL[1])
    return replies


class ReplyError(ValueError):
    """A client reply that cannot be aggregated."""


def record_bytes(content: RecordDict) -> int:
    """Bytes of the arrays in a record dict (what dominates the wire)."""
    return sum(record.count_bytes() for record in content.array_records.values())


def decode_update(content: RecordDict, state: TensorDict, reply_keys: Sequence[str],
                  trainable: Sequence[str], nonnegative: Sequence[str] = (),
                  max_update_norm: float | None = None) -> ClientUpdate:
    """Turn a reply's records into a ``ClientUpdate``, checking it fits the global state.

    ``nonnegative``: reply arrays that must hold no negative value (second moments).
    ``max_update_norm``: when set, the delta's global L2 norm over the trainable parameters,
    sqrt(sum_p ||Delta_p||^2), must not exceed it (the reply is rejected, not clipped).
    """
    for key in ("delta", "metrics", *reply_keys):
        if key not in content:
            raise ReplyError(f"missing record {key!r}")
    delta = content["delta"].to_torch_state_dict()
    _check_arrays("delta", delta, {name: state[name] for name in state})
    arrays = {}
    for key in reply_keys:
        arrays[key] = content[key].to_torch_state_dict()
        _check_arrays(key, arrays[key], {name: state[name] for name in trainable})
        if key in nonnegative and (negative := [n for n, t in arrays[key].items()
                                                if t.numel() and float(t.min()) < 0]):
            raise ReplyError(f"{key!r} has negative values (in {negative[:3]}); it must be >= 0")
    if max_update_norm:
        norm = global_norm({name: delta[name] for name in trainable})
        if norm > max_update_norm:
            raise ReplyError(f"update norm {norm:.4g} exceeds max_update_norm={max_update_norm:g}")
    metrics = content["metrics"]
    for key in ("num-examples", "num-steps", "lr-sum"):
        if key not in metrics or not metrics[key] > 0:
            raise ReplyError(f"metric {key!r} missing or not positive: {metrics.get(key)!r}")
    return ClientUpdate(delta=delta, num_steps=int(metrics["num-steps"]),
                        lr_sum=float(metrics["lr-sum"]), num_examples=int(metrics["num-examples"]),
                        arrays=arrays)


def _check_arrays(key: str, arrays: TensorDict, expected: TensorDict) -> None:
    if arrays.keys() != expected.keys():
        missing, extra = expected.keys() - arrays.keys(), arrays.keys() - expected.keys()
        raise ReplyError(f"{key!r}: wrong entries (missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]})")
    for name, tensor in arrays.items():
        if tensor.shape != expected[name].shape or tensor.dtype != expected[name].dtype:
            raise ReplyError(f"{key!r}[{name!r}]: {tuple(tensor.shape)} {tensor.dtype}, expected "
                             f"{tuple(expected[name].shape)} {expected[name].dtype}")
        if tensor.is_floating_point() and not all_finite(tensor):
            raise ReplyError(f"{key!r}[{name!r}] has non-finite values")


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no entry is inf or NaN. The sum is inf or NaN when an entry is (IEEE addition never
    turns them back into a finite number), so one reduction without a temporary decides; only a
    sum that is not finite (such an entry, or an overflow of finite ones) is checked entry by entry."""
    return math.isfinite(float(tensor.sum())) or bool(torch.isfinite(tensor).all())


def warn_shared_partitions(server_round: int, order: Sequence[tuple[float, int]]) -> None:
    """Log a warning when accepted replies of one round name the same partition-id: two SuperNodes
    started with one ``--node-config "partition-id=i ..."`` train on the same data while another
    partition is never used. (``order``: (partition-id, node id) per reply; -1: none reported, as
    for a node with its own data-path.)"""
    nodes: dict[float, list[int]] = {}
    for partition, node in order:
        if partition >= 0:
            nodes.setdefault(partition, []).append(node)
    for partition, shared in sorted(nodes.items()):
        if len(shared) > 1:
            log(WARNING, "round %d: nodes %s all train partition-id=%d: each SuperNode needs its own "
                "partition-id in 0..num-partitions-1", server_round, ", ".join(map(str, sorted(shared))),
                int(partition))


class AlgorithmStrategy(Strategy):
    """One strategy for every method: sampling, messaging and reply checks around a ``ServerRule``."""

    def __init__(self, rule: ServerRule, *, trainable: Sequence[str],
                 local_steps: int, lr_schedule: Callable[[int], float], fraction_train: float,
                 min_train_nodes: int, fraction_evaluate: float = 0.0, seed: int = 42,
                 expected_nodes: int = 0, max_empty_rounds: int = 3,
                 node_wait_timeout: float = 300.0, max_update_norm: float | None = None,
                 train_config: dict | None = None, wire_dtype: str = "float32") -> None:
        self.rule = rule
        self.trainable = list(trainable)
        self.local_steps = local_steps
        self.lr_schedule = lr_schedule
        self.fraction_train = fraction_train
        self.min_train_nodes = min_train_nodes
        self.fraction_evaluate = fraction_evaluate
        self.node_wait_timeout = node_wait_timeout
        self.expected_nodes = expected_nodes
        self.max_empty_rounds = max_empty_rounds
        self.wire_dtype = wire_dtype
        self.max_update_norm = max_update_norm
        self.train_config = dict(train_config or {})  # extra round-config entries for every client
        self.empty_rounds = 0  # consecutive rounds without a usable reply
        self.messages_sent = 0
        self._first_sample = True
        self.rng = random.Random(seed)
        self.state: TensorDict = {}
        self.bytes_sent = 0

    # ------------------------------------------------------------------ sampling

    def sample_nodes(self, grid: Grid, fraction: float, minimum: int) -> list[int]:
        """Sample max(fraction * connected, minimum) of the connected nodes.

        Nodes register with the SuperLink while the ServerApp starts, so the first call waits up
        to ``ALL_NODES_WAIT`` seconds for all ``expected_nodes``; every call waits up to
        ``node_wait_timeout`` for ``minimum``. Fewer than ``minimum`` after that is an error.
        """
        wanted = max(minimum, self.expected_nodes) if self._first_sample else minimum
        self._first_sample = False
        started = time.monotonic()
        while len(nodes := sorted(grid.get_node_ids())) < wanted:
            waited = time.monotonic() - started
            if (len(nodes) >= minimum and waited > ALL_NODES_WAIT) or waited > self.node_wait_timeout:
                break
            time.sleep(1.0)
        if len(nodes) < minimum:
            raise RuntimeError(f"Only {len(nodes)} nodes connected after {self.node_wait_timeout:.0f} s; "
                               f"at least {minimum} are needed (min_train_nodes)")
        if len(nodes) < wanted:
            log(WARNING, "%d of the %d expected nodes connected; sampling from those", len(nodes), wanted)
        count = min(len(nodes), max(int(len(nodes) * fraction), minimum))
        return self.rng.sample(nodes, count)

    # ------------------------------------------------------------------ training

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        config = ConfigRecord({**config, **self.train_config, "server-round": server_round,
                               "local-steps": self.local_steps,
                               "lr": self.lr_schedule(server_round),
                               "global-step": (server_round - 1) * self.local_steps})
        content = RecordDict({"model": arrays, "config": config})
        for key, tensors in self.rule.broadcast().items():
            content[key] = array_record(to_wire(tensors, self.wire_dtype))
        nodes = self.sample_nodes(grid, self.fraction_train, self.min_train_nodes)
        log(INFO, "round %d: sampled %d nodes", server_round, len(nodes))
        self.bytes_sent = record_bytes(content) * len(nodes)
        self.messages_sent = len(nodes)
        return [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
                for node in nodes]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        updates, client_metrics, order, bytes_received, rejected, failed, received = [], [], [], 0, 0, 0, 0
        for msg in replies:
            received += 1
            node = msg.metadata.src_node_id
            if msg.has_error():
                rejected += 1
                failed += 1
                log(WARNING, "round %d: node %d failed: %s", server_round, node, msg.error.reason)
                continue
            bytes_received += record_bytes(msg.content)
            try:
                updates.append(decode_update(msg.content, self.state, self.rule.reply_keys, self.trainable,
                                             self.rule.nonnegative_keys, self.max_update_norm))
            except ReplyError as err:
                rejected += 1
                log(WARNING, "round %d: rejected reply of node %d: %s", server_round, node, err)
                continue
            client_metrics.append(dict(msg.content["metrics"]))
            order.append((float(client_metrics[-1].get("partition-id", -1)), node))
        missing = max(self.messages_sent - received, 0)
        if missing:
            log(WARNING, "round %d: %d of %d sampled nodes sent no reply (timeout or gone)",
                server_round, missing, self.messages_sent)
        # rejected: replies not used (failed = Flower error replies, e.g. the ClientApp raised;
        # the rest failed decode_update); missing: messages without any reply.
        metrics = {"clients": len(updates), "rejected": rejected, "failed": failed, "missing": missing,
                   "bytes_sent": self.bytes_sent, "bytes_received": bytes_received}
        if not updates:
            log(WARNING, "round %d: no usable reply; the global model is unchanged", server_round)
            return None, MetricRecord(metrics)
        # Sums of floats depend on their order and replies arrive in any order: aggregate in a
        # fixed one (the client's partition id, then node id), so a run repeats bit for bit.
        ranked = sorted(range(len(updates)), key=order.__getitem__)
        warn_shared_partitions(server_round, order)
        updates, client_metrics = [updates[i] for i in ranked], [client_metrics[i] for i in ranked]
        self.state = self.rule.aggregate(self.state, updates)
        total = sum(u.num_examples for u in updates)
        metrics["train_loss"] = sum(float(m.get("train-loss", math.nan)) * u.num_examples
                                    for m, u in zip(client_metrics, updates)) / total
        if seconds := [float(m["train-seconds"]) for m in client_metrics if "train-seconds" in m]:
            metrics["client_train_seconds"] = sum(seconds)  # local work of the round's clients, each by its clock
            metrics["client_train_seconds_max"] = max(seconds)  # the slowest client (stragglers)
        metrics["direction_consistency"] = direction_consistency([u.delta for u in updates], self.trainable)
        if "delta_g" in (broadcast := self.rule.broadcast()):
            metrics["delta_g_norm"] = global_norm(broadcast["delta_g"])
        metrics.update(mean_client_statistics(client_metrics))
        return array_record(self.state), MetricRecord(metrics)

    # ------------------------------------------------------------------ federated evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self.sample_nodes(grid, self.fraction_evaluate, 1)
        content = RecordDict({"model": arrays, "config": ConfigRecord({**config, "server-round": server_round})})
        return [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=node)
                for node in nodes]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        rows = [msg.content["metrics"] for msg in replies
                if not msg.has_error() and "metrics" in msg.content]
        total = sum(int(m["num-examples"]) for m in rows)
        if total == 0:
            return None
        keys = [key for key in rows[0] if key != "num-examples"]  # one task: the same metrics everywhere
        return MetricRecord({f"client_{key.replace('-', '_')}":
                             sum(float(m[key]) * int(m["num-examples"]) for m in rows) / total
                             for key in keys})

    def summary(self) -> None:
        log(INFO, "AlgorithmStrategy(%s): fraction_train=%.2f min_train_nodes=%d K=%d",
            type(self.rule).__name__, self.fraction_train, self.min_train_nodes, self.local_steps)

    # ------------------------------------------------------------------ the loop

    def start(self, grid: Grid, initial_state: TensorDict, num_rounds: int, timeout: float,
              evaluate_fn: Callable[[int, TensorDict], dict | None],
              on_round_end: Callable[[dict], None], *, first_round: int = 1,
              after_round: Callable[[int], None] | None = None) -> TensorDict:
        """Run rounds ``first_round..num_rounds``; ``evaluate_fn(round, state)`` evaluates the global
        model (round 0 = before training, skipped when resuming at ``first_round > 1`` from a
        restored state, rule, ``rng`` and ``empty_rounds``), ``on_round_end(row)`` receives each
        round's metrics and ``after_round(round)`` runs after it (checkpoints)."""
        self.summary()
        self.state = dict(initial_state)
        if first_round == 1:
            on_round_end({"round": 0, **(evaluate_fn(0, self.state) or {})})
        arrays = array_record(self.state)
        for server_round in range(first_round, num_rounds + 1):
            started = time.perf_counter()
            lr = self.lr_schedule(server_round)
            replies = exchange(grid, self.configure_train(server_round, arrays, ConfigRecord(), grid), timeout)
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            arrays = new_arrays or arrays
            row = {"round": server_round, "lr": lr, **dict(train_metrics or {})}
            client_eval = self.aggregate_evaluate(
                server_round,
                exchange(grid, self.configure_evaluate(server_round, arrays, ConfigRecord(), grid), timeout))
            row.update(dict(client_eval or {}))
            row.update(evaluate_fn(server_round, self.state) or {})
            row["seconds"] = time.perf_counter() - started
            on_round_end(row)
            self.empty_rounds = 0 if new_arrays is not None else self.empty_rounds + 1
            if after_round is not None:
                after_round(server_round)
            if self.empty_rounds >= self.max_empty_rounds:
                raise RuntimeError(
                    f"No usable client reply in {self.empty_rounds} consecutive rounds (up to round "
                    f"{server_round}); stopping (max_empty_rounds={self.max_empty_rounds}). The "
                    f"reasons are logged above as 'node ... failed' / 'rejected reply'.")
        if self.empty_rounds >= num_rounds:
            # fewer rounds than max_empty_rounds and none of them usable (a resumed run counts the
            # rounds before its checkpoint too): not a completed run
            raise RuntimeError(
                f"No usable client reply in any round (1..{num_rounds}): the model was never "
                f"updated. The reasons are logged above as 'node ... failed' / 'rejected reply'.")
        return self.state
