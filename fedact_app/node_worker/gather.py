"""A round's training messages gathered into batches, for one process to train at once
(``client_batch=true``; :class:`fedact_app.client_batch.ClientBatch` does the training).

The server says in each training message's config whether its clients are batched
(``client-batch``) and how many training messages the round sends (``round-clients``). The
ClientApps of a machine hand such messages to one shared warm worker
(:mod:`fedact_app.node_worker.forward`), which serves each on a thread of its own: it opens a
:class:`Ticket` (:meth:`Gather.open_ticket`) as it accepts the connection, then reads the message
and passes it to :meth:`Gather.submit`. A batch of a round's waiting messages runs

- at once when every message of the round not yet trained is there;
- else once no message is still being read and none has come for ``wait`` seconds: a round can
  have more clients than ClientApps running at once (each holds its message until the reply;
  Flower's simulation runs at most as many as its actors and the threads of its pool, Python's
  default ``min(32, CPUs + 4)``), and the rest of its messages come only after this batch's
  replies.

One batch runs at a time, on one thread of the Gather's own. No torch here: what a batch does
is the ``train`` function given.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from logging import ERROR, INFO
from typing import Any

from flwr.common import log

CLIENT_BATCH_KEY = "client-batch"  # train config: true where the run trains its clients in batches
ROUND_CLIENTS_KEY = "round-clients"  # train config: the number of training messages of the round


@dataclass
class _Entry:
    item: Any
    arrival: float = field(default_factory=time.monotonic)
    outcome: Any = None
    done: bool = False


@dataclass
class _Group:
    """The messages of one round: waiting ones, and how many have been trained or taken."""

    expected: int
    wait: float
    waiting: list[_Entry] = field(default_factory=list)
    taken: int = 0

    def complete(self) -> bool:
        """Every message of the round not yet trained is waiting."""
        return self.taken + len(self.waiting) >= self.expected


class Ticket:
    """A message being read: until it is submitted or closed, no partial batch starts."""

    def __init__(self) -> None:
        self.open = True


KEPT_GROUPS = 64  # groups (rounds) remembered with nothing waiting: a round that lost a message ends nowhere


class Gather:
    """Batches of the items submitted per group (a run's round), trained one batch at a time by
    ``train(items) -> outcomes`` (an outcome per item, in order: a result, or the exception that
    item's work raised) on one thread of its own: CUDA graphs (``compile_model=reduce-overhead``)
    are kept per thread, and a batch on another thread would record them anew. ``label(group)``
    names a group in the log line each batch writes."""

    def __init__(self, train: Callable[[list[Any]], list[Any]], label: Callable[[Hashable], str] = str) -> None:
        self.train, self.label = train, label
        self.changed = threading.Condition()
        self.groups: dict[Hashable, _Group] = {}
        self.reading = 0  # open tickets: messages accepted and not yet submitted
        self.last_arrival = time.monotonic()  # of a ticket or a submitted item
        self.thread: threading.Thread | None = None

    def open_ticket(self) -> Ticket:
        """A ticket for a message about to be read: pass it to :meth:`submit`, and
        :meth:`close` it in any case (closing a submitted ticket does nothing)."""
        with self.changed:
            self.reading += 1
            self.last_arrival = time.monotonic()
        return Ticket()

    def close(self, ticket: Ticket | None) -> None:
        """The ticket's message is no longer being read (submitted, skipped, or failed to read)."""
        with self.changed:
            self._close(ticket)

    @contextlib.contextmanager
    def arrival(self) -> Iterator[Ticket]:
        """:meth:`open_ticket`, closed on exit."""
        ticket = self.open_ticket()
        try:
            yield ticket
        finally:
            self.close(ticket)

    def _close(self, ticket: Ticket | None) -> None:
        if ticket is not None and ticket.open:
            ticket.open = False
            self.reading -= 1
            self.changed.notify_all()

    def submit(self, group: Hashable, expected: int, wait: float, item: Any, ticket: Ticket | None = None) -> Any:
        """Block until ``item`` has been trained in a batch of its ``group``'s items (the module
        docstring says when a batch runs); return its result or raise its exception. The group's
        first item sets its ``expected`` and ``wait``."""
        if expected < 1 or not 0 < wait <= threading.TIMEOUT_MAX:
            raise ValueError(f"a batch needs expected >= 1 and 0 < wait <= {threading.TIMEOUT_MAX:g}; got "
                             f"expected={expected}, wait={wait}")
        entry = _Entry(item)
        with self.changed:
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, daemon=True, name="client-batches")
                self.thread.start()
            if group not in self.groups:
                self._forget_finished()
            self.groups.setdefault(group, _Group(expected, wait)).waiting.append(entry)
            self.last_arrival = entry.arrival
            self._close(ticket)
            self.changed.notify_all()
            while not entry.done:
                self.changed.wait()
        if isinstance(entry.outcome, BaseException):
            raise entry.outcome
        return entry.outcome

    def _due(self, state: _Group) -> float | None:
        """Seconds until ``state``'s waiting entries train (0: now); None while a message is read."""
        if state.complete():
            return 0.0
        if self.reading:
            return None
        return max(0.0, self.last_arrival + state.wait - time.monotonic())

    def _forget_finished(self) -> None:
        """Drop the oldest groups with nothing waiting beyond ``KEPT_GROUPS``."""
        idle = [key for key, state in self.groups.items() if not state.waiting]
        for key in idle[:max(0, len(idle) - KEPT_GROUPS)]:
            del self.groups[key]

    def _serve(self) -> None:
        """Train each group's waiting entries once they are due, one batch at a time. Where this
        thread ends on an exception, the entries waiting fail with it, and the next submit starts
        a new thread."""
        with self.changed:
            try:
                self._serve_forever()
            except BaseException as ex:  # noqa: BLE001 - logged; the next submit starts a new thread
                log(ERROR, "the batches' thread ended: %r", ex)
                for state in self.groups.values():
                    for entry in state.waiting:
                        entry.outcome, entry.done = RuntimeError(f"the batches' thread ended: {ex!r}"), True
                    state.waiting = []
                self.thread = None
                self.changed.notify_all()

    def _serve_forever(self) -> None:
        """:meth:`_serve`'s loop (holding the lock, but while a batch trains)."""
        while True:
            waiting = [(due, key) for key, state in self.groups.items()
                       if state.waiting and (due := self._due(state)) is not None]
            if not waiting:
                self.changed.wait()
                continue
            due, key = min(waiting, key=lambda pair: pair[0])
            if due > 0:
                self.changed.wait(due)
                continue
            self._run(key, self.groups[key])

    def _run(self, group: Hashable, state: _Group) -> None:
        """Train ``state``'s waiting entries (called holding the lock; released while training)."""
        batch, state.waiting = state.waiting, []
        state.taken += len(batch)
        if state.taken >= state.expected:
            del self.groups[group]
        self.changed.release()
        started = time.monotonic()
        outcomes: list[Any] | None = None
        try:
            outcomes = self.train([entry.item for entry in batch])
            if len(outcomes) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} messages got {len(outcomes)} outcomes")
        except Exception as ex:  # noqa: BLE001 - every message of the batch fails with it
            outcomes = [ex] * len(batch)
        finally:  # even where the training raised a BaseException, no message waits for ever
            self.changed.acquire()
            for entry, outcome in zip(batch, outcomes or [RuntimeError("the batch's training was interrupted")]
                                      * len(batch)):
                entry.outcome, entry.done = outcome, True
            self.changed.notify_all()
        arrivals = [entry.arrival for entry in batch]
        log(INFO, "%s: %d of %d messages trained at once in %.2f s; they arrived over %.2f s, the batch began "
            "%.2f s after the first", self.label(group), len(batch), state.expected, time.monotonic() - started,
            max(arrivals) - min(arrivals), started - min(arrivals))
