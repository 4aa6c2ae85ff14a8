"""The warm worker: serves one node's messages on a bound socket (``fedact_app.node_worker.serve``
starts it), or, batched (``client_batch=true``), the training messages of all of a run's nodes on
the machine, whose rounds it trains in batches (:mod:`fedact_app.node_worker.gather`).

Each connection is served on a thread of its own with ``fedact_app.client_work.run_message``: the
same reply as a cold ClientApp, including the node's one-message-at-a-time slot
(``fedact_app.node_slot``), which answers a second message at once while the first still runs.
A "prepare" request (sent with the node's identity query, before round 1's training message)
builds the run's trainer and reads the node's data, with no reply; messages wait for it.
Batched, the worker keeps the array records of the first training message it reads of a round
(the model and the server's broadcast, the same for every client of the round: ``ClientBatch``
trains them all from the first message's), for the ``KEPT_BROADCASTS`` latest rounds. A
ClientApp offers its message (``{"round": [run, server-round]}``), is told which records the
worker holds, and sends the message without them: once the first has been read, the round's
later messages come without the broadcast. The process keeps what ``run_message`` keeps between
messages (the imports, the run's composed config, the ``ClientTrainer`` with its task, data,
model and optimizer, a CUDA context), and nothing of the client's own: ``Context.state`` comes
with every message and goes back with its reply.

It ends, removing its socket, when the process it watches (its SuperNode) is gone, after
``--idle`` seconds without a message, or on SIGTERM.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from logging import ERROR, INFO, WARNING
from pathlib import Path

from flwr.app import ArrayRecord, Message
from flwr.common import log

from fedact_app.cli.procs import start_time
from fedact_app.node_worker.channel import (PREPARE, ChannelClosed, UnsafeChannel, info_path, peer, recv_frames,
                                            send_frames)
from fedact_app.node_worker.frames import broadcast_group, message_blobs, message_from_blobs
from fedact_app.node_worker.gather import Gather, Ticket

WATCH_EVERY = 0.5  # seconds between checks of the SuperNode and of the idle time
READ_TIMEOUT = 120.0  # seconds a read of a ClientApp's request may wait for its next bytes
KEPT_BROADCASTS = 2  # rounds whose first message's array records a batching worker keeps
Group = tuple[int, int]  # (run, server round): a round's training messages, which share its broadcast


def round_label(group: Group) -> str:
    """How a batch's log line names its group, a (run, server round): ``run 7 round 3``."""
    return f"run {group[0]} round {group[1]}"


class Worker:
    """One node's and one run configuration's worker (``batched``: the machine's nodes' batching
    worker of one run configuration), serving the socket ``listener``."""

    def __init__(self, listener: socket.socket, path: Path, key: str, label: str,
                 watch: tuple[int, int], idle_timeout: float, batched: bool = False) -> None:
        self.listener, self.path, self.key, self.label = listener, path, key, label
        self.work = None  # fedact_app.client_work, imported by serve()
        self.gather = None  # batched: the training messages' batches (Gather), made by serve()
        self.batched = batched
        self.inode = os.stat(path).st_ino  # the socket file this worker made (a successor may replace it)
        self.watch, self.idle_timeout = watch, idle_timeout
        self.lock = threading.Lock()  # guards the counters below and the config's first composition
        self.ready = threading.Lock()  # held while a "prepare" request builds the trainer
        self.active, self.last_seen = 0, time.monotonic()
        # batched: (run, server round) -> the array records of that round's first training message read
        self.broadcasts: dict[Group, dict[str, ArrayRecord]] = {}

    def serve(self) -> None:
        """Accept connections until ``stop``; each on a thread of its own."""
        from fedact_app import client_work  # torch, timm, Hydra: after the socket exists

        self.work = client_work
        if self.batched:
            self.gather = Gather(client_work.train_contents, round_label)
        threading.Thread(target=self._watch, daemon=True, name="watch").start()
        log(INFO, "warm worker %s (pid %d) serving %s", self.label, os.getpid(), self.path)
        while True:
            conn, _ = self.listener.accept()
            # batched: a message being read holds back the round's partial batch (node_worker.gather)
            ticket = self.gather.open_ticket() if self.batched else None
            threading.Thread(target=self._serve_one, args=(conn, ticket), daemon=True).start()

    def _serve_one(self, conn: socket.socket, ticket: Ticket | None) -> None:
        with self.lock:
            self.active += 1
        try:
            with conn:
                peer(conn)
                conn.settimeout(READ_TIMEOUT)  # a stalled sender would hold a batched round's partial batch back
                header, blobs = recv_frames(conn)
                if header.get("key") != self.key:
                    send_frames(conn, {"refused": f"the worker at {self.path} serves another run or node"})
                    return
                if header.get("kind") == PREPARE:
                    self._prepare(blobs)
                    return
                offered, shared = None, {}
                if "round" in header:  # a batched training message, offered without the records kept here
                    offered, blobs, shared = self._offered(conn, header["round"])
                    if offered is None:
                        return
                conn.settimeout(None)
                self._answer(conn, str(header.get("kind")), blobs, ticket, shared, offered)
        except (ChannelClosed, UnsafeChannel, OSError, ValueError) as err:
            log(WARNING, "warm worker %s: a connection ended without a reply (%s)", self.label, err)
        finally:
            if ticket is not None:
                self.gather.close(ticket)
            with self.lock:
                self.active -= 1
                self.last_seen = time.monotonic()

    def _prepare(self, blobs: list[bytes]) -> None:
        """Build the run's trainer and read this node's data (``client_work.prepare``); errors
        are left for the messages to meet and report."""
        from flwr.common.serde import context_from_proto
        from flwr.proto.message_pb2 import Context as ProtoContext

        with self.ready, self.lock:
            try:
                self.work.prepare(context_from_proto(ProtoContext.FromString(blobs[0])))
            except Exception as ex:  # noqa: BLE001
                log(WARNING, "warm worker %s: preparing failed (%s); the messages will say why", self.label, ex)

    def _offered(self, conn: socket.socket, group: object) -> tuple[Group | None, list[bytes], dict[str, ArrayRecord]]:
        """Answer a message's offer (its ``group``, [run, server round]) with the records held for
        that round, then read the message: (the round, its blobs, the records it left out). Where
        the offer or the records left out are not ones this worker can take, the ClientApp is told
        why and the round is None."""
        if not (isinstance(group, list) and len(group) == 2 and all(type(n) is int for n in group)):
            send_frames(conn, {"refused": f"a message offered for round {str(group)[:80]}: not [run, server-round]"})
            return None, [], {}
        offered = (group[0], group[1])
        with self.lock:
            held = dict(self.broadcasts.get(offered, {}))  # this connection's own: eviction cannot take it
        send_frames(conn, {"have": list(held)})
        sent, blobs = recv_frames(conn)
        omitted = sent.get("omitted", [])
        if not isinstance(omitted, list) or not all(isinstance(key, str) and key in held for key in omitted):
            send_frames(conn, {"refused": f"records left out that this worker does not hold: {str(omitted)[:200]}"})
            return None, [], {}
        return offered, blobs, {key: held[key] for key in omitted}

    def _keep_broadcast(self, msg: Message) -> None:
        """Keep the array records of the first training message read of its round, for the
        ``KEPT_BROADCASTS`` latest rounds."""
        if (group := broadcast_group(msg)) is None:  # run_batched_train names what is missing
            return
        with self.lock:
            if group not in self.broadcasts:
                self.broadcasts[group] = dict(msg.content.array_records)
                for oldest in sorted(self.broadcasts)[:-KEPT_BROADCASTS]:
                    del self.broadcasts[oldest]

    def _answer(self, conn: socket.socket, kind: str, blobs: list[bytes], ticket: Ticket | None = None,
                shared: dict[str, ArrayRecord] | None = None, offered: Group | None = None) -> None:
        """Ack with the message's deadline, then the reply and the Context it leaves; where the
        work raises, its exception's type and text instead, as a cold ClientApp would fail.
        ``shared``: the records the message was sent without, held here for the round it was
        offered for (``offered``), which must be its own."""
        from flwr.common.serde import context_from_proto, context_to_proto
        from flwr.proto.message_pb2 import Context as ProtoContext

        try:
            context = context_from_proto(ProtoContext.FromString(blobs[0]))
            msg = message_from_blobs(blobs[1:], shared)
            if shared and broadcast_group(msg) != offered:
                raise ValueError(f"a message of round {broadcast_group(msg)} was offered for round {offered}")
            if self.batched and kind == "train":
                self._keep_broadcast(msg)  # before the ack: the round's next offers find it
            with self.ready, self.lock:  # Hydra's composition is not thread-safe; later calls hit its cache
                deadline = self.work.message_deadline(msg, self.work.run_round_timeout(context))
            send_frames(conn, {"ack": True, "deadline": deadline})
            if self.batched and kind == "train":
                reply = self.work.run_batched_train(msg, context, self.gather, ticket)
            else:
                reply = self.work.run_message(kind, msg, context)
        except Exception as ex:  # noqa: BLE001 - the ClientApp process raises it for Flower to report
            log(ERROR, "warm worker %s: %s", self.label, traceback.format_exc())
            send_frames(conn, {"raised": f"{type(ex).__name__}: {ex}"})
            return
        send_frames(conn, {"reply": True}, context_to_proto(context).SerializeToString(), *message_blobs(reply))

    def _watch(self) -> None:
        pid, started = self.watch
        while True:
            time.sleep(WATCH_EVERY)
            if start_time(pid) != started:
                self.stop(f"its SuperNode (pid {pid}) is gone")
            with self.lock:
                idle = time.monotonic() - self.last_seen if self.active == 0 else 0.0
            if idle > self.idle_timeout:
                self.stop(f"no message for {idle:.0f} s")

    def stop(self, reason: str) -> None:
        """Remove the socket, its description and its lock file (where the socket is still this
        worker's: a successor may have replaced it), and exit."""
        log(INFO, "warm worker %s (pid %d) ends: %s", self.label, os.getpid(), reason)
        try:
            if os.stat(self.path).st_ino == self.inode:
                for path in (self.path, info_path(self.path), self.path.with_suffix(".lock")):
                    path.unlink(missing_ok=True)
        except OSError:
            pass
        os._exit(0)  # threads may be inside torch: nothing of theirs needs finishing
