"""What gets into a round: decoding each client reply into a ``ClientUpdate``, checking every array
and number in it, and the round-relative bounds on the replies that pass (docs/ROBUSTNESS.md has
the table). The strategy decodes a round's replies as they are pulled (:class:`Arrivals`) and makes
one call a round, :func:`accept_round`; what it accepts goes to the method's server rule
(fedact_app.algorithms), which combines it (fedact_app.aggregation).

A reply is untrusted input. Arrays must match the global state (names, shapes, dtypes) and be
finite; second moments must be >= 0; the round's K and learning rate are the server's own
(``RoundTerms``), so a reply naming others is refused and Delta_G divides by the server's K eta_r;
every other number must be finite and in range. ``ReplyError`` names what is wrong. Then each
reply is measured against the round's others: a second moment or an update whose norm is far
above the round's lower median is rejected (``RoundBounds``).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from logging import WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log

from fedact_app.algorithms import ClientUpdate, TensorDict
from fedact_app.diagnostics import CLIENT_METRICS, vector_norms
from fedact_app.finite import all_finite
from fedact_app.optim.topk import host_map
from fedact_app.packing import VectorPool, as_vector, consecutive, views
from fedact_app.registry import MAX_MOMENT_RATIO, MAX_UPDATE_RATIO, REPLY_DTYPES
from fedact_app.sampling import ClientKey
from fedact_app.wire import BFLOAT16_BITS, Entry, packed_entries, widen_bfloat16


class ReplyError(ValueError):
    """A client reply that cannot be aggregated."""


def record_bytes(content: RecordDict) -> int:
    """Bytes of the arrays in a record dict (what dominates the wire)."""
    return sum(record.count_bytes() for record in content.array_records.values())


@dataclass(frozen=True)
class RoundTerms:
    """What the server itself set for a round, which a reply must agree with."""

    local_steps: int  # K
    lr: float  # the round's learning rate eta_r (constant within the round)
    max_examples: int | None = None  # K x batch_size: the most examples K steps can see

    @property
    def lr_sum(self) -> float:
        """sum_k eta_{i,k} = K eta_r, as the client computes it."""
        return self.lr * self.local_steps


def decode_update(content: RecordDict, state: TensorDict, reply_keys: Sequence[str],
                  trainable: Sequence[str], nonnegative: Sequence[str] = (),
                  max_update_norm: float | None = None, terms: RoundTerms | None = None,
                  device: torch.device | str | None = None, pool: VectorPool | None = None,
                  reply_dtype: str = "float32") -> ClientUpdate:
    """Turn a reply's records into a ``ClientUpdate``, checking it fits the global state.

    ``nonnegative``: reply arrays that must hold no negative value (second moments).
    ``max_update_norm``: when set, the delta's global L2 norm over the trainable parameters,
    sqrt(sum_p ||Delta_p||^2), must not exceed it (the reply is rejected, not clipped).
    ``terms``: the round's own K, learning rate and example bound. With them, ``num-steps`` must
    be K, ``lr-sum`` K eta_r (to 1e-9 relative) and ``num-examples`` at most K x batch_size, and
    the update carries the server's K eta_r, not the reply's: Delta_G divides by it.
    The arrays come out on ``device`` (default: the state's, the ServerApp's ``server_device``),
    each key's entries views into one vector (:func:`read_arrays`; from ``pool`` when given), the
    trainable parameters first. ``reply_dtype``: the dtype the run's clients send floating
    arrays in (the ``reply_dtype`` config key; :func:`read_arrays`).
    Every metric must be a finite number (``train-loss`` included); the client statistics lie
    in [0, 1], and ``train-seconds`` and ``work-start`` (a Unix time) are >= 0.
    """
    for key in ("delta", "metrics", *reply_keys):
        if key not in content:
            raise ReplyError(f"missing record {key!r}")
    metrics = content["metrics"]
    num_steps = count(metrics, "num-steps")
    num_examples = count(metrics, "num-examples")
    lr_sum = number(metrics, "lr-sum")
    if not lr_sum > 0:
        raise ReplyError(f"metric 'lr-sum' must be > 0, got {lr_sum!r}")
    number(metrics, "train-loss")
    for key in ("train-seconds", "work-start"):
        if key in metrics and number(metrics, key) < 0:
            raise ReplyError(f"metric {key!r} must be >= 0, got {metrics[key]!r}")
    for key in CLIENT_METRICS:
        if key in metrics and not 0 <= number(metrics, key) <= 1:
            raise ReplyError(f"metric {key!r} must lie in [0, 1], got {metrics[key]!r}")
    if terms is not None:
        if num_steps != terms.local_steps:
            raise ReplyError(f"metric 'num-steps' {num_steps} differs from the round's local_steps={terms.local_steps}")
        if not math.isclose(lr_sum, terms.lr_sum, rel_tol=1e-9):
            raise ReplyError(f"metric 'lr-sum' {lr_sum!r} differs from the round's K x lr = {terms.lr_sum!r}")
        if terms.max_examples is not None and num_examples > terms.max_examples:
            raise ReplyError(f"metric 'num-examples' {num_examples} exceeds local_steps x batch_size = "
                             f"{terms.max_examples}")
        lr_sum = terms.lr_sum
    if device is None:
        device = next(iter(state.values())).device if state else "cpu"
    expected = {name: state[name] for name in state}
    delta, delta_norm = read_arrays("delta", content["delta"], expected, first=trainable, device=device, pool=pool,
                                    wire=reply_dtype)
    arrays, norms = {}, {"delta": delta_norm}
    for key in reply_keys:
        arrays[key], norms[key] = read_arrays(key, content[key], {name: state[name] for name in trainable},
                                              first=trainable, device=device, pool=pool, wire=reply_dtype)
        if key in nonnegative and (negative := negative_entries(arrays[key], trainable)):
            raise ReplyError(f"{key!r} has negative values (in {negative[:3]}); it must be >= 0")
    if max_update_norm:
        norm = norms["delta"]
        if norm > max_update_norm:
            raise ReplyError(f"update norm {norm:.4g} exceeds max_update_norm={max_update_norm:g}")
    return ClientUpdate(delta=delta, num_steps=num_steps, lr_sum=lr_sum, num_examples=num_examples,
                        arrays=arrays, norms=norms)


def decode_updates(contents: Sequence[RecordDict], state: TensorDict, reply_keys: Sequence[str],
                   trainable: Sequence[str], nonnegative: Sequence[str] = (),
                   max_update_norm: float | None = None, terms: RoundTerms | None = None,
                   pool: VectorPool | None = None, reply_dtype: str = "float32") -> list[ClientUpdate | ReplyError]:
    """:func:`decode_update` of every reply, in order, a refused reply's ``ReplyError`` in its
    place. The replies are decoded on up to ``torch.get_num_threads()`` threads (consecutive
    replies a thread, :func:`fedact_app.optim.topk.host_map`): copying a reply's bytes and its
    norms' passes release the GIL, so a round's copies run on the cores side by side (10 ViT-Tiny
    replies, 216 MB, on the 2-vCPU AMD EPYC VM: docs/PERFORMANCE.md). Each reply is decoded as
    alone, so the updates are the same whatever the threads. An exception other than
    ``ReplyError`` (a defect, not a bad reply) comes out of this call."""
    def decoded(content: RecordDict) -> ClientUpdate | ReplyError:
        try:
            return decode_update(content, state, reply_keys, trainable, nonnegative, max_update_norm, terms,
                                 pool=pool, reply_dtype=reply_dtype)
        except ReplyError as err:  # its frames (and its context's) would hold the reply's arrays all round
            err.__context__ = None
            return err.with_traceback(None)

    return host_map(decoded, contents, [1] * len(contents))


def read_arrays(key: str, record: ArrayRecord, expected: TensorDict, first: Sequence[str] = (),
                device: torch.device | str = "cpu", pool: VectorPool | None = None,
                wire: str = "float32") -> tuple[TensorDict, float]:
    """The tensors of a packed record (fedact_app.wire) on ``device``, checked against
    ``expected`` (the same names, shapes and dtypes; floating values finite), and the L2 norm of
    the entries ``first`` (the trainable parameters; squares and sums in float64).

    The values are copied once, into one vector for all entries of the first entry's floating
    dtype (``first`` of them at its start, in that order, then the others in ``expected``'s
    order), of which the returned tensors are views (fedact_app.packing): one copy for each run
    of entries that lie in that order in the record too (all of them, when the client packed
    them in the state's order). The dict lists them in that vector's order, then the entries of
    other dtypes. The vector comes from ``pool`` when one is given (for a GPU ``device`` it is the
    staging of the one copy there). The norm's pass is the finiteness check of ``first`` (a NaN
    or inf entry makes it so, and finite float32 squares cannot overflow float64's sum), one float
    sum that of the vector's other entries; only a result that is not finite is looked into
    entry by entry. ``wire`` (the run's ``reply_dtype``) "bfloat16": every floating entry comes as
    bfloat16's bits in int16 (fedact_app.wire.to_wire) and is widened to its expected dtype
    (exactly to float32 or float64); ValueError for a ``wire`` other than float32 and bfloat16."""
    try:
        entries, values = packed_entries(record)
    except ValueError as err:
        raise ReplyError(f"{key!r}: not a readable packed record ({err})") from None
    if entries.keys() != expected.keys():
        missing, extra = expected.keys() - entries.keys(), entries.keys() - expected.keys()
        extra_names = [name[:80] for name in sorted(extra)[:3]]  # a client's names, cut for the log
        raise ReplyError(f"{key!r}: wrong entries (missing {sorted(missing)[:3]}, extra {extra_names})")
    if wire not in REPLY_DTYPES:
        raise ValueError(f"reply dtype {wire!r}: allowed one of {', '.join(REPLY_DTYPES)}")
    bits = wire == "bfloat16"
    order = list(dict.fromkeys([*first, *expected]))
    for name in order:
        entry, want = entries[name], expected[name]
        sent = BFLOAT16_BITS if bits and want.is_floating_point() else _numpy_name(want.dtype)
        if entry.shape != tuple(want.shape) or entry.dtype != sent:
            floating = want.is_floating_point()
            hint = f" (the run's reply_dtype is {wire})" if floating and BFLOAT16_BITS in (sent, entry.dtype) else ""
            as_bits = f" as bfloat16's bits ({BFLOAT16_BITS})" if sent == BFLOAT16_BITS else ""
            raise ReplyError(f"{key!r}[{name!r}]: {str(entry.shape)[:80]} {entry.dtype[:80]}, expected "
                             f"{tuple(want.shape)} {want.dtype}{as_bits}{hint}")
    dtype = expected[order[0]].dtype if order else None
    vectorized = dtype is not None and dtype.is_floating_point and (not bits or dtype == torch.float32)
    packed = [n for n in order if expected[n].dtype == dtype] if vectorized else []
    tensors = {}
    if packed:
        numel = sum(expected[n].numel() for n in packed)
        vector = pool.take(numel, dtype) if pool is not None else torch.empty(numel, dtype=dtype)
        _copy_runs(vector.numpy(), [entries[n] for n in packed], values[BFLOAT16_BITS if bits else _numpy_name(dtype)],
                   widen_bfloat16 if bits else np.copyto)
        tensors = views(vector.to(device), packed, [expected[n].shape for n in packed])
    single, in_vector = {}, set(packed)
    for name in order:
        if name not in in_vector:
            entry, want = entries[name], expected[name]
            host = torch.from_numpy(values[entry.dtype][entry.offset:entry.end].reshape(entry.shape).copy())
            if bits and want.is_floating_point():
                host = host.view(torch.bfloat16).to(want.dtype)
            single[name] = host.to(device)
    tensors.update(single)
    lead = list(first)[:consecutive(tensors, list(first))] if tensors else []
    norm = vector_norms([as_vector(tensors, lead)])[0] if lead == list(first) and lead else None
    rest = packed[len(lead):] if norm is not None else packed
    finite = (norm is None or math.isfinite(norm)) and (
        not rest or math.isfinite(float(as_vector(tensors, rest).sum())))
    if not finite and (bad := [n for n in packed if not all_finite(tensors[n])]):
        raise ReplyError(f"{key!r}[{bad[0]!r}] has non-finite values")
    for name, tensor in single.items():
        if tensor.is_floating_point() and not all_finite(tensor):
            raise ReplyError(f"{key!r}[{name!r}] has non-finite values")
    if norm is None:  # ``first`` not one vector (mixed dtypes): entry by entry
        norm = vector_norms([torch.cat([tensors[n].reshape(-1).double() for n in first])])[0] if first else 0.0
    return tensors, norm


def _copy_runs(target: np.ndarray, entries: Sequence[Entry], source: np.ndarray,
               copy: Callable[[np.ndarray, np.ndarray], None] = np.copyto) -> None:
    """Copy the entries' values, all in ``source`` (the record's array of their dtype), one after
    the other into ``target`` (``copy(target_part, source_part)``, e.g. ``fedact_app.wire.widen_bfloat16``):
    one copy for each run of entries that lie one after the other in ``source`` too."""
    runs: list[list[int]] = []  # [start, end] in source
    for entry in entries:
        if runs and runs[-1][1] == entry.offset:
            runs[-1][1] = entry.end
        else:
            runs.append([entry.offset, entry.end])
    start = 0
    for first, end in runs:
        copy(target[start:start + end - first], source[first:end])
        start += end - first


def negative_entries(arrays: TensorDict, names: Sequence[str]) -> list[str]:
    """The entries among ``names`` holding a negative value: one minimum over them when they lie
    in one vector (:func:`read_arrays`), entry by entry only when it is negative."""
    run = consecutive(arrays, names)
    if run == len(names) and names:
        vector = as_vector(arrays, names)
        if not vector.numel() or float(vector.min()) >= 0:
            return []
    return [n for n in names if arrays[n].numel() and float(arrays[n].min()) < 0]


@functools.lru_cache(maxsize=32)
def _numpy_name(dtype: torch.dtype) -> str | None:
    """NumPy's name of a torch dtype, as a packed record's layout gives it (None for one NumPy
    lacks, e.g. bfloat16)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype.name
    except TypeError:
        return None


def number(metrics: MetricRecord, key: str) -> float:
    """``metrics[key]`` as a finite float; ReplyError when it is missing, not a number or not finite."""
    value = metrics.get(key)
    try:  # an int beyond float's range (a MetricRecord holds any Python int) overflows in isfinite
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        finite = False
    if not finite:
        raise ReplyError(f"metric {key!r} missing or not a finite number: {value!r}")
    return float(value)


def count(metrics: MetricRecord, key: str, minimum: int = 1) -> int:
    """``metrics[key]`` as an integer >= ``minimum`` (a float with an integer value is accepted)."""
    value = number(metrics, key)
    if value < minimum or value != int(value):
        raise ReplyError(f"metric {key!r} must be an integer >= {minimum}, got {metrics[key]!r}")
    return int(value)


def partition_problem(identity: ClientKey, metrics: MetricRecord) -> str | None:
    """Why a reply's ``partition-id`` does not fit the node, or None: when sent, it must be an
    integer >= 0 and, for a node that identified by its partition (``identity``,
    fedact_app.sampling), that partition. A reason, not a raised ``ReplyError``: the caller holds
    the round's decoded updates, which a raised error's traceback would keep alive."""
    if "partition-id" not in metrics:
        return None
    try:
        partition = count(metrics, "partition-id", minimum=0)
    except ReplyError as err:
        return str(err)
    kind, identified, _ = identity
    if kind == 0 and partition != identified:
        return f"metric 'partition-id' {partition} differs from the partition-id={identified} this node identified as"
    return None


# ---------------------------------------------------------------- the round's acceptance


@dataclass(frozen=True)
class Acceptance:
    """What a round accepts: the method's reply arrays (``reply_keys``; ``nonnegative``: second
    moments) over the ``trainable`` parameters, and the bounds on a reply's size.

    ``max_update_norm`` (None: off): an absolute bound on the update's L2 norm over the trainable
    parameters. ``max_update_ratio`` (0: off): that norm may be at most this many times the
    lower median of the positive norms among the round's replies. ``max_moment_ratio`` (0: off):
    a second moment's norm must lie within this factor above or below the lower median of the
    positive norms among the round's replies and the current broadcast (v_bar). Honest updates of
    one round are within a small factor of each other (docs/ROBUSTNESS.md has the measured
    ratios), and an honest v, a running mean of squared gradients started from v_bar, within a few
    orders of magnitude; a reply far above (or a v far below) is forged or broken.
    """

    reply_keys: tuple[str, ...]
    trainable: tuple[str, ...]
    nonnegative: tuple[str, ...] = ()
    max_update_norm: float | None = None
    max_moment_ratio: float = MAX_MOMENT_RATIO
    max_update_ratio: float = MAX_UPDATE_RATIO
    reply_dtype: str = "float32"  # the dtype the clients send floating arrays in (read_arrays' ``wire``)


@dataclass
class Accepted:
    """One accepted reply: who sent it, its update, its metrics."""

    key: ClientKey  # the client's identity (fedact_app.sampling)
    node: int
    update: ClientUpdate
    metrics: dict
    replied: float  # the reply's created_at (Unix seconds, the client's clock)
    arrived: float | None  # the pull that brought it (Unix seconds; None: not pulled through Arrivals.feed)


@dataclass
class RoundReplies:
    """What :func:`accept_round` made of a round's replies."""

    accepted: list[Accepted] = field(default_factory=list)  # in aggregation order: identity, node id
    received: int = 0  # replies, Flower error replies included
    rejected: int = 0  # replies not used: failed, or refused by a check
    failed: int = 0  # Flower error replies (e.g. the ClientApp raised)
    bytes_received: int = 0
    update_ratio: float | None = None  # the largest accepted update norm over the round's median


class Arrivals:
    """A round's replies decoded as they are pulled (:meth:`feed`, the strategy's reply loop
    calling it with each pull's replies), so that decoding the early replies overlaps the clients
    still training: what the ServerApp has left to do after the round's last reply is that
    reply's decode and the rule. ``decode``: :func:`decode_updates` with the round's state,
    acceptance and terms bound. Each reply is decoded as alone, so the updates are the same
    whenever and in whatever batches they are decoded. It also keeps when the round's messages
    were pushed (:meth:`pushed`) and when each reply was pulled, the round's timeline
    (fedact_app.timeline)."""

    def __init__(self, decode: Callable[[Sequence[RecordDict]], list[ClientUpdate | ReplyError]]) -> None:
        self._decode = decode
        self._decoded: dict[int, tuple[RecordDict, ClientUpdate | ReplyError]] = {}  # by id() of the content
        self.last_pull: float | None = None  # time.perf_counter() of the last pull fed (its replies or none)
        self.push: tuple[float, float] | None = None  # the push's start and end (Unix seconds)
        # Unix time of the pull that brought each reply, by the id of the message it answers
        self.arrived: dict[str, float] = {}

    def pushed(self, start: float, end: float) -> None:
        """The round's messages were pushed from ``start`` to ``end`` (Unix seconds)."""
        self.push = (start, end)

    def feed(self, replies: Iterable[Message]) -> None:
        """One pull's replies (possibly none), decoded now (a Flower error reply has nothing to
        decode). The last pull of a round ended its wait: for the last reply, or at the timeout."""
        self.last_pull = time.perf_counter()
        replies = list(replies)
        now = time.time()
        self.arrived.update((msg.metadata.reply_to_message_id, now) for msg in replies)
        contents = [msg.content for msg in replies if not msg.has_error()]
        if contents:
            for content, update in zip(contents, self._decode(contents)):
                self._decoded[id(content)] = (content, update)

    def updates(self, contents: Sequence[RecordDict]) -> list[ClientUpdate | ReplyError]:
        """The decoded update (or ``ReplyError``) of each of ``contents``, in order: the one
        :meth:`feed` made of that very record, else decoded now (all such records together).
        Each is handed out once and then forgotten here, so the updates live as long as the
        caller keeps them (on a GPU server, fresh device memory a reply)."""
        known = [self._decoded.pop(id(content), (None, None)) for content in contents]
        missing = [content for content, (fed, _) in zip(contents, known) if fed is not content]
        fresh = iter(self._decode(missing) if missing else [])
        return [update if fed is content else next(fresh) for content, (fed, update) in zip(contents, known)]


def accept_round(server_round: int, replies: Iterable[Message], acceptance: Acceptance, *,
                 identity: Callable[[int], ClientKey], broadcast: dict[str, TensorDict],
                 arrivals: Arrivals) -> RoundReplies:
    """The round's accepted replies, each rejection logged with node id and reason.

    Every reply is decoded and checked by ``arrivals`` (:func:`round_arrivals`: :func:`decode_update`
    against the global state and the round's terms; at its arrival, or here for a reply it has not
    seen) and by :func:`partition_problem` against the node's ``identity``; the ones that pass are
    put in a fixed order (float sums depend on their order and replies arrive in any: the
    clients' identities, then node id, so a run repeats bit for bit) and measured against each
    other (:func:`moment_outliers`, :func:`update_ratios`; ``broadcast``: the server's current
    arrays, v_bar among them)."""
    out = RoundReplies()
    passed: list[Accepted] = []
    replies = list(replies)
    contents = [msg.content for msg in replies if not msg.has_error()]
    decoded = iter(arrivals.updates(contents))
    for msg in replies:
        out.received += 1
        node = msg.metadata.src_node_id
        if msg.has_error():
            out.rejected += 1
            out.failed += 1
            log(WARNING, "round %d: node %d failed: %s", server_round, node, msg.error.reason)
            continue
        out.bytes_received += record_bytes(msg.content)
        update = next(decoded)
        # the refusal's text, not the error re-raised: a raised error's traceback would hold this
        # frame, and with it every decoded update of the round, until the cycle collector runs
        reason = (str(update) if isinstance(update, ReplyError)
                  else partition_problem(identity(node), msg.content["metrics"]))
        if reason is not None:
            out.rejected += 1
            log(WARNING, "round %d: rejected reply of node %d: %s", server_round, node, reason)
            continue
        passed.append(Accepted(identity(node), node, update, dict(msg.content["metrics"]), msg.metadata.created_at,
                               arrivals.arrived.get(msg.metadata.reply_to_message_id)))
    passed.sort(key=lambda item: (item.key, item.node))
    updates = [item.update for item in passed]
    reasons: dict[int, list[str]] = {}
    for index, reason in moment_outliers(updates, acceptance.nonnegative, broadcast, acceptance.max_moment_ratio):
        reasons.setdefault(index, []).append(reason)
    ratios, median = update_ratios(updates, acceptance.trainable)
    bound = acceptance.max_update_ratio
    for index, ratio in enumerate(ratios):
        if bound and ratio > bound:
            reasons.setdefault(index, []).append(
                f"update norm {ratio * median:.4g} is {ratio:.4g} times the round's median {median:.4g}, "
                f"more than max_update_ratio={bound:g}")
    for index, why in sorted(reasons.items()):
        log(WARNING, "round %d: rejected reply of node %d: %s", server_round, passed[index].node, "; ".join(why))
    out.rejected += len(reasons)
    out.accepted = [item for index, item in enumerate(passed) if index not in reasons]
    kept = [ratio for index, ratio in enumerate(ratios) if index not in reasons]
    out.update_ratio = max(kept) if kept and median > 0 else None
    return out


def round_arrivals(acceptance: Acceptance, *, state: TensorDict, terms: RoundTerms,
                   pool: VectorPool | None = None) -> Arrivals:
    """:class:`Arrivals` decoding a round's replies against the global ``state`` and the round's
    ``terms``, as ``acceptance`` says, into vectors from ``pool`` (which the caller recycles once
    the round's updates are no longer read)."""
    return Arrivals(functools.partial(decode_updates, state=state, reply_keys=acceptance.reply_keys,
                                      trainable=acceptance.trainable, nonnegative=acceptance.nonnegative,
                                      max_update_norm=acceptance.max_update_norm, terms=terms, pool=pool,
                                      reply_dtype=acceptance.reply_dtype))


def lower_median(values: Sequence[float]) -> float:
    """The lower median: the middle value, or the smaller of the two middle ones; an attacker
    holding half of the values cannot raise it above every honest one."""
    return sorted(values)[(len(values) - 1) // 2]


def update_ratios(updates: Sequence[ClientUpdate], trainable: Sequence[str]) -> tuple[list[float], float]:
    """Each update's norm over the ``trainable`` parameters divided by the lower median of the
    positive norms among them, and that median (0, with every ratio 0, when no norm is positive:
    nothing to compare against)."""
    norms = measured_norms(updates, None, trainable)
    positive = [norm for norm in norms if norm > 0]
    if not positive:
        return [0.0] * len(norms), 0.0
    median = lower_median(positive)
    return [norm / median for norm in norms], median


def measured_norms(updates: Sequence[ClientUpdate], key: str | None, trainable: Sequence[str]) -> list[float]:
    """Each update's L2 norm over the ``trainable`` parameters' entries of its delta (``key``
    None) or of its reply array ``key``: the one :func:`decode_update` measured over them
    (``ClientUpdate.norms``), else measured here, all updates in one pass."""
    label = "delta" if key is None else key
    if all(label in u.norms for u in updates):
        return [u.norms[label] for u in updates]
    return vector_norms([as_vector(u.delta if key is None else u.arrays[key], trainable) for u in updates])


def moment_outliers(updates: Sequence[ClientUpdate], keys: Sequence[str], broadcast: dict[str, TensorDict],
                    ratio: float) -> list[tuple[int, str]]:
    """(index, reason) of each update whose second moment (each of ``keys``) has a norm more than
    ``ratio`` times above or below the reference: the lower median of the positive norms among
    the updates' and, once there is one, the current broadcast's (``<key>_bar``, e.g. v_bar). An
    honest v after K steps is positive and within a few orders of magnitude of the others'; with
    no positive norm to compare against nothing is rejected. ``ratio`` 0: no check."""
    if not ratio or not updates:
        return []
    outliers = []
    for key in keys:
        norms = measured_norms(updates, key, list(updates[0].arrays[key]))
        bar = vector_norms([as_vector(broadcast[f"{key}_bar"])]) if f"{key}_bar" in broadcast else []
        reference = [n for n in norms + bar if n > 0]
        if not reference:
            continue
        median = lower_median(reference)
        outliers += [(i, f"{key!r} norm {norm:.4g} is more than max_moment_ratio={ratio:g} times "
                         f"{'above' if norm > median else 'below'} the round's median {median:.4g}")
                     for i, norm in enumerate(norms) if not median / ratio <= norm <= median * ratio]
    return outliers
