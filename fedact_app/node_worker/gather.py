"""A round's training messages gathered into batches, for one process to train at once
(``client_batch=true``; :class:`fedact_app.client_batch.ClientBatch` does the training).

The server says in each training message's config whether its clients are batched
(``client-batch``) and how many training messages the round sends (``round-clients``). The
ClientApps of a machine hand such messages to one shared warm worker
(:mod:`fedact_app.node_worker.forward`), which serves each on a thread of its own and passes it
to :meth:`Gather.submit`. A batch runs as soon as every message of the round not yet trained has
arrived, or ``wait`` seconds after the first of those arrived (a round whose clients outnumber
the machine's ClientApps, which each hold one message until its reply); one batch runs at a time.
No torch here: what a batch does is the ``train`` function given.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

CLIENT_BATCH_KEY = "client-batch"  # train config: true where the run trains its clients in batches
ROUND_CLIENTS_KEY = "round-clients"  # train config: the number of training messages of the round


@dataclass
class _Entry:
    item: Any
    outcome: Any = None
    done: bool = False


@dataclass
class _Group:
    """The messages of one round: waiting ones, and how many have been trained or taken."""

    expected: int
    wait: float
    waiting: list[_Entry] = field(default_factory=list)
    first_arrival: float = 0.0  # monotonic time the oldest waiting entry arrived
    taken: int = 0

    def due(self) -> float:
        """Seconds until the waiting entries train: 0 once the round's untrained messages are all
        here or the wait is over."""
        if self.taken + len(self.waiting) >= self.expected:
            return 0.0
        return max(0.0, self.first_arrival + self.wait - time.monotonic())


class Gather:
    """Batches of the items submitted per group (a run's round), trained one batch at a time by
    ``train(items) -> outcomes`` (an outcome per item, in order: a result, or the exception that
    item's work raised) on one thread of its own: CUDA graphs (``compile_model=reduce-overhead``)
    are kept per thread, and a batch on another thread would record them anew."""

    def __init__(self, train: Callable[[list[Any]], list[Any]]) -> None:
        self.train = train
        self.changed = threading.Condition()
        self.groups: dict[Hashable, _Group] = {}
        self.thread: threading.Thread | None = None

    def submit(self, group: Hashable, expected: int, wait: float, item: Any) -> Any:
        """``item``'s result (raising its exception), once it has been trained in a batch of its
        ``group``'s items: all ``expected`` of them that were not yet trained, or those that
        arrived within ``wait`` seconds of the first one waiting."""
        if expected < 1 or wait <= 0:
            raise ValueError(f"a batch needs expected >= 1 and wait > 0; got expected={expected}, wait={wait}")
        entry = _Entry(item)
        with self.changed:
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, daemon=True, name="client-batches")
                self.thread.start()
            state = self.groups.setdefault(group, _Group(expected, wait))
            if not state.waiting:
                state.first_arrival = time.monotonic()
            state.waiting.append(entry)
            self.changed.notify_all()
            while not entry.done:
                self.changed.wait()
        if isinstance(entry.outcome, BaseException):
            raise entry.outcome
        return entry.outcome

    def _serve(self) -> None:
        """Train each group's waiting entries once they are due, one batch at a time."""
        with self.changed:
            while True:
                waiting = [(state.due(), key) for key, state in self.groups.items() if state.waiting]
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
        try:
            outcomes = self.train([entry.item for entry in batch])
            if len(outcomes) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} messages got {len(outcomes)} outcomes")
        except Exception as ex:  # noqa: BLE001 - every message of the batch fails with it
            outcomes = [ex] * len(batch)
        finally:
            self.changed.acquire()
        for entry, outcome in zip(batch, outcomes):
            entry.outcome, entry.done = outcome, True
        self.changed.notify_all()
