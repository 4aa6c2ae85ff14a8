"""The Flower ``Strategy``: moves a method's arrays in and out of Flower records.

Each round it samples nodes, sends every sampled node one ``RecordDict``::

    "model":  ArrayRecord   global state x^r (parameters and buffers)
    <key>:    ArrayRecord   the server rule's broadcast arrays (FedACT: "v_bar", "delta_g")
    "config": ConfigRecord  server-round, local-steps, lr, global-step

(the broadcast arrays in ``wire_dtype``: float32 by default, bfloat16/float16 halve their bytes;
the replies' arrays in ``reply_dtype``, float32 or bfloat16)

and expects back::

    "delta":   ArrayRecord  x_i^{r,K} - x^r
    <key>:     ArrayRecord  the local rule's reply arrays (FedACT: "v")
    "metrics": MetricRecord num-examples, num-steps, lr-sum, train-loss, train-seconds,
                            work-start (fedact_app.timeline),
                            partition-id (none from a node with its own data-path) and the
                            trust-score statistics the client sampled
                            (fedact_app.diagnostics)

Each ArrayRecord is packed (fedact_app.wire.packed_record): one array per dtype and a layout
naming the tensors in it, so that Flower moves a handful of objects a record, not one per tensor.

Before a node is first sampled the strategy asks it who it is (a QUERY message; the reply's
``identity`` ConfigRecord, fedact_app.sampling): clients are sampled by those identities, never by
Flower's node ids, so a seed fixes the client sequence and two methods at one seed see the same
clients in the same rounds.

The arithmetic lives in the method's ``ServerRule`` (fedact_app.algorithms, combining by
fedact_app.aggregation); this class holds no method state of its own. What gets into a round is
decided once, by fedact_app.replies.accept_round: a reply is believed only where it cannot lie
(the round's K and learning rate are the server's own, every other number is checked), and a
second moment or an update far above the round's others is rejected (docs/ROBUSTNESS.md has the
table). Rejected replies are logged with node id and reason, counted in the round's metrics and
never reach the rule; a round with fewer than ``min_train_nodes`` accepted replies, or whose
aggregate is not finite, or that the rule refuses (too few replies for trimmed_mean), changes
nothing. Each round's metrics carry the seed's diagnostics over the accepted replies: direction
consistency, ||Delta_G|| and the clients' trust-score statistics (fedact_app.diagnostics).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from logging import INFO, WARNING

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedact_app.algorithms import ClientUpdate, ServerRule, TensorDict
from fedact_app.diagnostics import mean_client_statistics, vector_norms, vectors_direction_consistency
from fedact_app.finite import describe_names, non_finite
from fedact_app.packing import VectorPool, as_vector
from fedact_app.registry import MAX_MOMENT_RATIO, MAX_UPDATE_RATIO
from fedact_app.replies import (Acceptance, Accepted, Arrivals, ReplyError, RoundTerms, accept_round, count,
                                number, record_bytes, round_arrivals)
from fedact_app.sampling import (IDENTITY_RECORD, ClientKey, client_key, column_value, describe,
                                 sample_clients, sample_count, unidentified_key)
from fedact_app.node_worker.gather import ROUND_CLIENTS_KEY
from fedact_app.timeline import ReplyTimes, round_path
from fedact_app.wire import packed_record, to_wire


ALL_NODES_WAIT = 30.0  # seconds the first round waits for every expected node to register
EVAL_EXAMPLES_RATIO = 100  # an evaluation reply may count at most this many times the round's median examples
REPLY_POLL = 0.005  # first wait between two pulls of replies, seconds; each next one is 1.5 times longer, up to
REPLY_POLL_SHARE = 0.01  # this share of the time the pulls have waited so far,
REPLY_POLL_BOUNDS = (0.01, 0.25)  # bounded by these seconds (poll_cap)


def exchange(grid: Grid, messages: Iterable[Message], timeout: float | None,
             on_pull: Callable[[list[Message]], None] | None = None,
             while_waiting: Callable[[], None] | None = None,
             on_push: Callable[[float, float], None] | None = None) -> list[Message]:
    """Push ``messages`` and pull their replies until all have come or ``timeout`` seconds passed
    since the push; ``on_push(start, end)`` gets the push's Unix times, ``on_pull`` each pull's
    replies as they come (:func:`collect`), and ``while_waiting()`` runs once between the push and
    the first pull (the ServerApp's own work that the clients' training then hides: the previous
    round's evaluation).

    What ``Grid.send_and_receive`` does, without its fixed sleep between two pulls (Flower 1.41:
    3 s in a deployment's ``HttpGrid``, 0.1 s in simulation's ``InMemoryGrid``), which a round
    then waits on top of its work. The wait between pulls starts at ``REPLY_POLL`` and grows by
    half each time up to :func:`poll_cap`: 10 ms for the first second, then 1 % of the time
    waited, at most 0.25 s. So a round learns of its last reply within 10 ms, or 1 % of its wait,
    and a long round's pulls (each a small query of the SuperLink) thin out to four a second
    (docs/PERFORMANCE.md has the measured rounds).
    """
    push_start = time.time()
    pending = set(grid.push_messages(messages))
    pushed = time.monotonic()
    if on_push is not None:
        on_push(push_start, time.time())
    if while_waiting is not None:
        while_waiting()
    left = None if timeout is None else max(0.0, timeout - (time.monotonic() - pushed))
    return collect(grid, pending, left, on_pull)


def collect(grid: Grid, pending: set[str], timeout: float | None,
            on_pull: Callable[[list[Message]], None] | None = None) -> list[Message]:
    """Pull the replies to the message ids in ``pending`` (removing each answered id from it)
    until none is left or ``timeout`` seconds passed (0: one pull); ``exchange`` has the waits.
    ``on_pull(pulled)`` runs after every pull, with the replies it brought (possibly none),
    before the next pull (the strategy decodes them there while other clients still train). A
    pull before the timeout is followed by one more, without a wait, even when ``on_pull`` took
    the time left: the replies that came while it ran are collected."""
    replies: list[Message] = []
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    wait = REPLY_POLL
    while pending:
        pulled = list(grid.pull_messages(pending))
        left = math.inf if deadline is None else deadline - time.monotonic()
        replies.extend(pulled)
        pending.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
        if on_pull is not None:
            on_pull(pulled)
        if not pending or left <= 0:
            break
        remaining = math.inf if deadline is None else deadline - time.monotonic()
        time.sleep(max(0.0, min(wait, remaining)))
        wait = min(1.5 * wait, poll_cap(time.monotonic() - started))
    return replies


def poll_cap(waited: float) -> float:
    """The longest wait between two pulls after ``waited`` seconds of pulling: ``REPLY_POLL_SHARE``
    of it, within ``REPLY_POLL_BOUNDS``."""
    low, high = REPLY_POLL_BOUNDS
    return min(max(REPLY_POLL_SHARE * waited, low), high)


def reply_times(accepted: Iterable[Accepted]) -> list[ReplyTimes]:
    """The timeline's times (fedact_app.timeline) of the accepted replies that were pulled through
    a round's ``Arrivals`` and report ``work-start`` and ``train-seconds``, whose client clock is
    consistent: a finite ``created_at`` no earlier than the ``work-start`` (Flower's checks of
    ``created_at`` let NaN through; a reply outside these only leaves the timeline)."""
    times = [ReplyTimes(float(item.metrics["work-start"]), float(item.metrics["train-seconds"]), item.replied,
                        item.arrived)
             for item in accepted
             if item.arrived is not None and "work-start" in item.metrics and "train-seconds" in item.metrics]
    return [t for t in times if math.isfinite(t.replied) and t.work_start <= t.replied]


def on_host(tensors: TensorDict) -> TensorDict:
    """CPU copies of ``tensors``, each with storage of its own."""
    return {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}


def warn_shared_partitions(server_round: int, order: Sequence[tuple[int, int]]) -> None:
    """Log a warning when accepted replies of one round name the same partition-id: two SuperNodes
    started with one ``--node-config "partition-id=i ..."`` train on the same data while another
    partition is never used. (``order``: (partition-id, node id) per reply; -1: none reported, as
    for a node with its own data-path.)"""
    nodes: dict[int, list[int]] = {}
    for partition, node in order:
        if partition >= 0:
            nodes.setdefault(partition, []).append(node)
    for partition, shared in sorted(nodes.items()):
        if len(shared) > 1:
            log(WARNING, "round %d: nodes %s all train partition-id=%d: each SuperNode needs its own "
                "partition-id in 0..num-partitions-1", server_round, ", ".join(map(str, sorted(shared))),
                int(partition))


class AlgorithmStrategy(Strategy):
    """One strategy for every method: sampling and messaging around a ``ServerRule``, with each
    round's replies accepted by fedact_app.replies.accept_round.

    ``batch_size`` bounds a reply's ``num-examples`` (K x batch_size); ``max_update_norm``,
    ``max_moment_ratio`` and ``max_update_ratio`` bound a reply's size (fedact_app.replies.Acceptance).
    ``wire_dtype``: the dtype of the broadcast arrays the messages carry; ``reply_dtype``: the one
    the replies' arrays come in (the run config's keys of those names).
    ``device`` (the run's ``server_device``) holds the global state, the rule's state and the
    decoded replies, so the checks, the diagnostics and the aggregation run there; what goes on the
    wire, into checkpoints and into the results is moved to the CPU.
    """

    def __init__(self, rule: ServerRule, *, trainable: Sequence[str],
                 local_steps: int, lr_schedule: Callable[[int], float], fraction_train: float,
                 min_train_nodes: int, fraction_evaluate: float = 0.0, seed: int = 42,
                 expected_nodes: int = 0, max_empty_rounds: int = 3,
                 node_wait_timeout: float = 300.0, max_update_norm: float | None = None,
                 batch_size: int | None = None, max_moment_ratio: float = MAX_MOMENT_RATIO,
                 max_update_ratio: float = MAX_UPDATE_RATIO, train_config: dict | None = None,
                 wire_dtype: str = "float32", reply_dtype: str = "float32",
                 device: torch.device | str = "cpu") -> None:
        self.rule = rule
        self.device = torch.device(device)  # where the global state, the rule's state and the replies live
        self.vectors = VectorPool(pin=self.device.type == "cuda")  # the decoded replies' vectors (reused)
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
        self.batch_size = batch_size
        self.acceptance = Acceptance(reply_keys=tuple(rule.reply_keys), trainable=tuple(self.trainable),
                                     nonnegative=tuple(rule.nonnegative_keys), max_update_norm=max_update_norm,
                                     max_moment_ratio=max_moment_ratio, max_update_ratio=max_update_ratio,
                                     reply_dtype=reply_dtype)
        self.train_config = dict(train_config or {})  # extra round-config entries for every client
        self.empty_rounds = 0  # consecutive rounds without a usable reply
        self.messages_sent = 0
        self.sampled_clients: list[int | str] = []  # the last training sample, by identity
        self._first_sample = True
        self.seed = seed
        self.client_keys: dict[int, ClientKey] = {}  # node id -> identity (fedact_app.sampling)
        self.open_queries: dict[str, int] = {}  # identity queries without a reply: message id -> node
        self.unanswered = 0  # train and evaluate messages that had no reply by their round's timeout
        self.first_round_started: float | None = None  # Unix time :meth:`run` began its first round
        self.state: TensorDict = {}
        self.bytes_sent = 0

    # ------------------------------------------------------------------ sampling

    def connected_nodes(self, grid: Grid, minimum: int) -> list[int]:
        """The connected nodes, once at least ``minimum`` are.

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
        return nodes

    def identify(self, grid: Grid, nodes: Sequence[int]) -> None:
        """Ask each node not yet known who it is (one QUERY message each, answered by the ClientApp
        from its node config) and remember the answers. The first call waits up to
        ``node_wait_timeout`` for them (the ClientApps' cold start), a later one that asks new
        nodes up to ``ALL_NODES_WAIT``; a node still silent is left out of this sample and its
        query stays open (collected, not sent again, at the next call). A node whose query fails
        gets a key after every identified client (fedact_app.sampling). Two nodes with one
        identity are warned of."""
        asked = [node for node in nodes if node not in self.client_keys and node not in self.open_queries.values()]
        queries = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=node)
                   for node in asked]
        if queries:
            self.open_queries.update(zip(grid.push_messages(queries), asked))
        wait = self.node_wait_timeout if not self.client_keys else ALL_NODES_WAIT if queries else 0.0
        pending = set(self.open_queries)
        for reply in collect(grid, pending, wait):
            node = self.open_queries.pop(reply.metadata.reply_to_message_id)
            try:
                if reply.has_error():
                    raise ValueError(reply.error.reason)
                if IDENTITY_RECORD not in reply.content:
                    raise ValueError(f"no {IDENTITY_RECORD!r} record")
                self.client_keys[node] = client_key(reply.content[IDENTITY_RECORD])
            except ValueError as err:
                log(WARNING, "node %d could not say which client it is (%s); it is sampled after "
                    "the identified clients", node, err)
                self.client_keys[node] = unidentified_key(node)
        holders: dict[ClientKey, list[int]] = {}
        for node, key in self.client_keys.items():
            holders.setdefault(key, []).append(node)
        for key, shared in sorted(holders.items()):
            if len(shared) > 1 and any(node in asked for node in shared):
                log(WARNING, "nodes %s are all %s: each SuperNode needs its own partition-id (or "
                    "client-name); the run's client sequence then depends on Flower's node ids",
                    ", ".join(map(str, sorted(shared))), describe(key))

    def sample_nodes(self, grid: Grid, fraction: float, minimum: int, server_round: int,
                     purpose: str) -> list[int]:
        """max(fraction * identified, minimum) of the connected nodes that have said who they are,
        drawn by their identities (fedact_app.sampling.sample_clients), in identity order."""
        nodes = self.connected_nodes(grid, minimum)
        self.identify(grid, nodes)
        known = [(self.client_keys[node], node) for node in nodes if node in self.client_keys]
        if len(known) < len(nodes):
            log(WARNING, "round %d: %d of %d nodes did not say which client they are in time; "
                "sampling from the others%s", server_round, len(nodes) - len(known), len(nodes),
                f" (fewer than the {minimum} needed: this round cannot update)" if len(known) < minimum else "")
        count = sample_count(len(known), fraction, minimum)
        chosen = sample_clients(known, count, seed=self.seed, server_round=server_round, purpose=purpose)
        return [node for _, node in sorted(chosen)]

    def round_terms(self, server_round: int) -> RoundTerms:
        max_examples = None if self.batch_size is None else self.local_steps * self.batch_size
        return RoundTerms(self.local_steps, self.lr_schedule(server_round), max_examples)

    # ------------------------------------------------------------------ training

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        terms = self.round_terms(server_round)
        nodes = self.sample_nodes(grid, self.fraction_train, self.min_train_nodes, server_round, "train")
        log(INFO, "round %d: sampled %d nodes", server_round, len(nodes))
        # round-clients: how many training messages the round sends (a client batch waits for them)
        config = ConfigRecord({**config, **self.train_config, "server-round": server_round,
                               "local-steps": terms.local_steps, "lr": terms.lr,
                               "global-step": (server_round - 1) * self.local_steps, ROUND_CLIENTS_KEY: len(nodes)})
        content = RecordDict({"model": arrays, "config": config})
        for key, tensors in self.rule.broadcast().items():
            content[key] = packed_record(to_wire(tensors, self.wire_dtype))
        self.sampled_clients = [column_value(self.client_key_of(node)) for node in nodes]
        self.bytes_sent = record_bytes(content) * len(nodes)
        self.messages_sent = len(nodes)
        return [Message(content=content, message_type=MessageType.TRAIN, dst_node_id=node)
                for node in nodes]

    def client_key_of(self, node: int) -> ClientKey:
        """The node's identity; a node never identified (a test's hand-made reply) sorts last."""
        return self.client_keys.get(node, unidentified_key(node))

    def round_arrivals(self, server_round: int) -> Arrivals:
        """What decodes this round's training replies as they come (fedact_app.replies.Arrivals),
        into the vectors of the last round's replies, which it recycles: call it once a round,
        when nothing reads the last round's updates any more (a second call would hand the
        first one's vectors out again)."""
        self.vectors.recycle()
        return round_arrivals(self.acceptance, state=self.state, terms=self.round_terms(server_round),
                              pool=self.vectors)

    def aggregate_train(self, server_round: int, replies: Iterable[Message],
                        arrivals: Arrivals | None = None) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's ``Strategy.aggregate_train``: the round's new global state from its
        ``replies`` and its metrics, diagnostics included (:meth:`aggregate_round`)."""
        arrays, metrics, diagnostics = self.aggregate_round(server_round, replies, arrivals)
        return arrays, MetricRecord({**metrics, **diagnostics()})

    def aggregate_round(self, server_round: int, replies: Iterable[Message], arrivals: Arrivals | None = None,
                        ) -> tuple[ArrayRecord | None, dict, Callable[[], dict]]:
        """The round's new global state from its ``replies`` (None: unchanged), its metrics, and
        its diagnostics as a call (DC and ||Delta_G||: ``direction_consistency``,
        ``delta_g_norm``), which :meth:`run` makes while the next round's clients train. On the
        CPU that call reads the round's decoded updates and the rule's Delta_G: make it before
        the next round's replies are decoded into the same vectors (:meth:`round_arrivals`
        hands them out again) and before the next aggregation. On another device the updates
        are memory of their own there, not kept past the round: the diagnostics are made at
        once (a few ms on a GPU) and the call returns them. ``arrivals``: the replies decoded
        as they came (:meth:`round_arrivals`; None: none was), the others are decoded here."""
        if arrivals is None:
            arrivals = self.round_arrivals(server_round)
        round_replies = accept_round(server_round, replies, self.acceptance, identity=self.client_key_of,
                                     broadcast=self.rule.broadcast(), arrivals=arrivals)
        accepted, rejected = round_replies.accepted, round_replies.rejected
        missing = max(self.messages_sent - round_replies.received, 0)
        if missing:
            log(WARNING, "round %d: %d of %d sampled nodes sent no reply (timeout or gone)",
                server_round, missing, self.messages_sent)
        # rejected: replies not used (failed = Flower error replies, e.g. the ClientApp raised;
        # the rest failed the checks); missing: messages without any reply.
        metrics = {"clients": len(accepted), "rejected": rejected, "failed": round_replies.failed,
                   "missing": missing, "bytes_sent": self.bytes_sent,
                   "bytes_received": round_replies.bytes_received}
        if len(accepted) < max(self.min_train_nodes, 1):
            if accepted:
                log(WARNING, "round %d: %d usable replies, fewer than min_train_nodes=%d; the global "
                    "model is unchanged", server_round, len(accepted), self.min_train_nodes)
            else:
                log(WARNING, "round %d: no usable reply; the global model is unchanged", server_round)
            metrics.update(clients=0, rejected=rejected + len(accepted))
            return None, metrics, dict
        warn_shared_partitions(server_round, [(int(item.metrics.get("partition-id", -1)), item.node)
                                              for item in accepted])
        updates = [item.update for item in accepted]
        client_metrics = [item.metrics for item in accepted]
        if not self.aggregate_finite(server_round, updates):
            metrics.update(clients=0, rejected=rejected + len(accepted))
            return None, metrics, dict
        total = sum(u.num_examples for u in updates)
        metrics["train_loss"] = sum(float(m["train-loss"]) * u.num_examples
                                    for m, u in zip(client_metrics, updates)) / total
        if seconds := [float(m["train-seconds"]) for m in client_metrics if "train-seconds" in m]:
            metrics["client_train_seconds"] = sum(seconds)  # local work of the round's clients, each by its clock
            metrics["client_train_seconds_max"] = max(seconds)  # the slowest client (stragglers)
        if arrivals.push is not None:
            metrics.update(round_path(*arrivals.push, reply_times(accepted)))
        if round_replies.update_ratio is not None:  # how close honest updates come to max_update_ratio
            metrics["update_norm_ratio"] = round_replies.update_ratio
        metrics.update(mean_client_statistics(client_metrics))

        def diagnostics() -> dict:
            found = {"direction_consistency": vectors_direction_consistency(
                [as_vector(u.delta, self.trainable) for u in updates])}
            if "delta_g" in (broadcast := self.rule.broadcast()):
                found["delta_g_norm"] = vector_norms([as_vector(broadcast["delta_g"], self.trainable)])[0]
            return found

        if self.device.type != "cpu":
            found = diagnostics()
            return packed_record(self.state), metrics, lambda: found
        return packed_record(self.state), metrics, diagnostics

    def aggregate_finite(self, server_round: int, updates: Sequence[ClientUpdate]) -> bool:
        """Aggregate ``updates`` into ``self.state`` and the rule's state, unless the rule refuses
        them or the result holds a non-finite value (finite replies can still overflow): then
        both stay as they were."""
        kept = self.rule.state_dict()
        try:
            new_state = self.rule.aggregate(self.state, updates)
        except ValueError as err:  # SCAFFOLD: more updates than N clients (two nodes, one partition);
            # trimmed_mean: too few updates for its trim
            log(WARNING, "round %d: the server rule refused the %d replies (%s); the global model and "
                "the server state are unchanged", server_round, len(updates), err)
            self.rule.load_state_dict(kept)
            return False
        bad = non_finite({f"model[{name!r}]": t for name, t in new_state.items()}
                         | {f"{key}[{name!r}]": t for key, arrays in self.rule.state_dict().items()
                            for name, t in arrays.items()})
        if bad:
            log(WARNING, "round %d: the aggregate of %d replies is not finite (%s); the global model "
                "and the server state are unchanged", server_round, len(updates), describe_names(bad))
            self.rule.load_state_dict(kept)
            return False
        self.state = new_state
        return True

    # ------------------------------------------------------------------ federated evaluation

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self.sample_nodes(grid, self.fraction_evaluate, 1, server_round, "evaluate")
        content = RecordDict({"model": arrays, "config": ConfigRecord({**config, "server-round": server_round})})
        return [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=node)
                for node in nodes]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The example-weighted mean of each metric over the evaluation replies whose
        ``num-examples`` is an integer >= 0, at most ``EVAL_EXAMPLES_RATIO`` times the lower median
        of the round's counts, and whose metrics are all finite numbers; the others are logged
        and left out (a forged count would otherwise take the whole mean)."""
        rows = []
        for msg in sorted(replies, key=lambda m: (self.client_key_of(m.metadata.src_node_id),
                                                  m.metadata.src_node_id)):
            if msg.has_error() or "metrics" not in msg.content:
                continue
            metrics = msg.content["metrics"]
            try:
                rows.append((msg.metadata.src_node_id, count(metrics, "num-examples", minimum=0),
                             {key: number(metrics, key) for key in metrics if key != "num-examples"}))
            except ReplyError as err:
                log(WARNING, "round %d: evaluation reply of node %d left out: %s", server_round,
                    msg.metadata.src_node_id, err)
        if positive := sorted(examples for _, examples, _ in rows if examples > 0):
            bound = EVAL_EXAMPLES_RATIO * positive[(len(positive) - 1) // 2]
            for node, examples, _ in rows:
                if examples > bound:
                    log(WARNING, "round %d: evaluation reply of node %d left out: num-examples %d is "
                        "more than %d times the round's median", server_round, node, examples,
                        EVAL_EXAMPLES_RATIO)
            rows = [row for row in rows if row[1] <= bound]
        total = sum(examples for _, examples, _ in rows)
        if total == 0:
            return None
        keys = [key for key in rows[0][2] if all(key in values for _, _, values in rows)]
        return MetricRecord({f"client_{key.replace('-', '_')}":
                             sum(values[key] * examples for _, examples, values in rows) / total
                             for key in keys})

    def summary(self) -> None:
        log(INFO, "AlgorithmStrategy(%s): fraction_train=%.2f min_train_nodes=%d K=%d",
            type(self.rule).__name__, self.fraction_train, self.min_train_nodes, self.local_steps)

    # ------------------------------------------------------------------ the loop

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the strategy: the global ``model`` state, the rule's state
        (``ServerRule.state_dict``) and the count of consecutive ``empty_rounds``; the tensors are
        CPU copies of their own (a checkpoint loads on a machine without the server's device, and
        safetensors refuses tensors that share memory, as the views of a decoded reply do)."""
        return {"model": on_host(self.state),
                "rule": {key: on_host(arrays) for key, arrays in self.rule.state_dict().items()},
                "empty_rounds": self.empty_rounds}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s output (a resumed run), onto the strategy's ``device``."""
        self.state = {name: t.to(self.device) for name, t in state["model"].items()}
        self.rule.load_state_dict({key: {name: t.to(self.device) for name, t in arrays.items()}
                                   for key, arrays in state["rule"].items()})
        self.empty_rounds = int(state["empty_rounds"])

    def exchange(self, grid: Grid, messages: Iterable[Message], timeout: float,
                 on_pull: Callable[[list[Message]], None] | None = None,
                 while_waiting: Callable[[], None] | None = None,
                 on_push: Callable[[float, float], None] | None = None) -> list[Message]:
        """:func:`exchange`, counting the messages left without a reply in :attr:`unanswered`."""
        messages = list(messages)
        replies = exchange(grid, messages, timeout, on_pull, while_waiting, on_push)
        self.unanswered += len(messages) - len(replies)
        return replies

    @property
    def clients_idle(self) -> bool:
        """Whether every message of the run has had its reply, so that no client can still be
        working on one (a client past a round's timeout may be)."""
        return not self.unanswered and not self.open_queries

    def run(self, grid: Grid, num_rounds: int, timeout: float,
            evaluate_fn: Callable[[int, TensorDict], dict | None],
            on_round_end: Callable[[dict], None], *, initial_state: TensorDict | None = None,
            first_round: int = 1, after_round: Callable[[int], None] | None = None,
            overlap_evaluation: Callable[[int], bool] = lambda server_round: True) -> TensorDict:
        """Run rounds ``first_round..num_rounds`` from ``initial_state`` (or, resuming, from what
        ``load_state_dict`` restored) and return the final global state. ``evaluate_fn(round,
        state)`` evaluates the global model (round 0 = before training, only when
        ``first_round`` is 1), ``on_round_end(row)`` receives each round's metrics and
        ``after_round(round)`` runs after it (checkpoints). Flower's own ``Strategy.start`` (its
        round loop for ArrayRecords) is not used: this loop adds the method's broadcast arrays,
        the reply checks and the empty-round accounting. The returned state is on the CPU.

        A round's diagnostics (:meth:`aggregate_round`), central evaluation, row and
        ``after_round`` run while the next round's clients train (between that round's push and
        its first pull, before any of its replies is decoded), so they leave the round's
        critical path where the clients train on other machines or devices: round
        0's while round 1 trains, round r's while round r + 1 does. Not so for the final round,
        a round that ends the run (``max_empty_rounds``), nor a round where
        ``overlap_evaluation(round)`` is False: ``after_round`` of a checkpoint reads the
        clients' kept state, which the next round's clients rewrite. Rows are recorded in round
        order, each round's evaluation is of its own state, and a failure (an interrupt
        included) still records the round before it. A round's ``seconds`` run from its start
        (its sampling) to the next round's, or to the end of its own evaluation where that does
        not overlap the next; round 0's are its evaluation's."""
        self.summary()
        if initial_state is not None:
            self.state = {name: t.to(self.device) for name, t in initial_state.items()}

        def finish(row: dict, started: float, diagnostics: Callable[[], dict], ended: float | None) -> None:
            """Round ``row["round"]``'s diagnostics, evaluation, row and ``after_round``; the
            round ended at ``ended`` (the next round's start) or, None, when this evaluation does."""
            row.update(diagnostics())
            evaluating = time.perf_counter()
            evaluation = evaluate_fn(row["round"], self.state) or {}
            now = time.perf_counter()
            row.update(evaluation)
            if evaluation and row["round"]:
                row["eval_seconds"] = now - evaluating
            row["seconds"] = now - evaluating if row["round"] == 0 else (ended or now) - started
            on_round_end(row)
            if after_round is not None and row["round"]:
                after_round(row["round"])

        # the round whose diagnostics, evaluation and row wait for the next round's push: (row, its
        # start, its diagnostics)
        unfinished = ({"round": 0}, time.perf_counter(), dict) if first_round == 1 else None

        def finish_unfinished(ended: float) -> None:
            nonlocal unfinished
            if unfinished is not None:
                row, round_started, diagnostics = unfinished
                unfinished = None
                finish(row, round_started, diagnostics, ended)

        arrays = packed_record(self.state)
        try:
            for server_round in range(first_round, num_rounds + 1):
                started = time.perf_counter()
                if self.first_round_started is None:
                    self.first_round_started = time.time()
                lr = self.lr_schedule(server_round)
                messages = list(self.configure_train(server_round, arrays, ConfigRecord(), grid))
                arrivals = self.round_arrivals(server_round)
                replies = self.exchange(grid, messages, timeout, on_pull=arrivals.feed,
                                        while_waiting=lambda: finish_unfinished(started), on_push=arrivals.pushed)
                new_arrays, train_metrics, diagnostics = self.aggregate_round(server_round, replies, arrivals)
                del replies  # the replies' bytes, not needed through the evaluation below
                arrays = new_arrays or arrays
                row = {"round": server_round, "lr": lr, "sampled_clients": self.sampled_clients, **train_metrics}
                if arrivals.last_pull is not None:  # from the pull that ended the wait: no client overlaps this
                    row["server_seconds"] = time.perf_counter() - arrivals.last_pull
                client_eval = self.aggregate_evaluate(
                    server_round,
                    self.exchange(grid, self.configure_evaluate(server_round, arrays, ConfigRecord(), grid), timeout))
                row.update(dict(client_eval or {}))
                self.empty_rounds = 0 if new_arrays is not None else self.empty_rounds + 1
                stopping = self.empty_rounds >= self.max_empty_rounds
                assert unfinished is None, "the exchange finishes the previous round (while_waiting)"
                if server_round < num_rounds and not stopping and overlap_evaluation(server_round):
                    unfinished = (row, started, diagnostics)
                else:
                    finish(row, started, diagnostics, None)
                if stopping:
                    raise RuntimeError(
                        f"No usable client reply in {self.empty_rounds} consecutive rounds (up to round "
                        f"{server_round}); stopping (max_empty_rounds={self.max_empty_rounds}). The "
                        f"reasons are logged above as 'node ... failed' / 'rejected reply'.")
        except BaseException:  # Flower's end of a run and Ctrl-C too: the finished round is recorded
            finish_unfinished(time.perf_counter())
            raise
        if self.empty_rounds >= num_rounds:
            # fewer rounds than max_empty_rounds and none of them usable (a resumed run counts the
            # rounds before its checkpoint too): not a completed run
            raise RuntimeError(
                f"No usable client reply in any round (1..{num_rounds}): the model was never "
                f"updated. The reasons are logged above as 'node ... failed' / 'rejected reply'.")
        return on_host(self.state)
