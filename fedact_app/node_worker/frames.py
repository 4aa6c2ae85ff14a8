"""A Flower ``Message`` as blobs for the worker socket: its protobuf without its arrays' bytes,
then each array's bytes as they are, one blob each. Records the other end already holds (a
round's broadcast, which the batching worker keeps: :mod:`fedact_app.node_worker.worker`) can be
left out: they cross as empty records and are put back from what that end holds.

Flower's own serialization (``message_to_proto`` and ``SerializeToString``) copies every array's
bytes into protobuf objects and then into one string. On the 2-vCPU AMD EPYC VM that takes
0.08-0.15 s for a ViT-Tiny reply (Δ and v, 21.7 MB), and a batching worker does it for every
reply of a round, one after another. The blobs here leave the arrays' bytes as they are. No
torch: the ClientApp side imports this on every message.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Mapping

from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Message as ProtoMessage


def broadcast_group(msg: Message) -> tuple[int, int] | None:
    """(run, server round) of a training message: the round whose broadcast it carries, and whose
    messages the batching worker trains together (``node_worker.gather``'s group; the worker keeps
    one broadcast per round); None where its config lacks the round."""
    config = msg.content.config_records.get("config") if msg.has_content() else None
    server_round = None if config is None else config.get("server-round")
    return None if type(server_round) is not int else (msg.metadata.run_id, server_round)


def message_blobs(msg: Message, omit: Collection[str] = ()) -> list[bytes]:
    """``[the message's protobuf with every array empty, each array's bytes in record order]``;
    the array records named in ``omit`` go as empty records, without blobs (ValueError for a name
    that is not one of its array records)."""
    if not msg.has_content():
        if omit:
            raise ValueError(f"records {sorted(omit)} to leave out of a message without content")
        return [message_to_proto(msg).SerializeToString()]
    if not_arrays := [key for key in omit if key not in msg.content.array_records]:
        raise ValueError(f"records {sorted(not_arrays)} to leave out are not array records of the message")
    data = [array.data for key, record in msg.content.array_records.items() if key not in omit
            for array in record.values()]
    stripped = _with_array_data(msg, itertools.repeat(b""), {key: ArrayRecord() for key in omit})
    return [message_to_proto(stripped).SerializeToString(), *data]


def message_from_blobs(blobs: list[bytes], shared: Mapping[str, ArrayRecord] | None = None) -> Message:
    """The message :func:`message_blobs` made ``blobs`` of, with the records it omitted from
    ``shared`` (name -> the record this end holds); ValueError where the blobs' count does not
    match its arrays, or a record named in ``shared`` came with arrays."""
    shared = shared or {}
    msg = message_from_proto(ProtoMessage.FromString(blobs[0]))
    if not msg.has_content():
        if len(blobs) > 1 or shared:
            raise ValueError(f"a message without content came with {len(blobs) - 1} array blobs and "
                             f"{len(shared)} shared records")
        return msg
    records = msg.content.array_records
    if sent := [key for key in shared if key not in records or len(records[key])]:
        raise ValueError(f"the records {sorted(sent)} were to be left out, and are missing or came with arrays")
    arrays = sum(len(record) for record in records.values())
    if arrays != len(blobs) - 1:
        raise ValueError(f"a message of {arrays} arrays came with {len(blobs) - 1} array blobs")
    return _with_array_data(msg, iter(blobs[1:]), shared)


def _with_array_data(msg: Message, data: Iterator[bytes], replaced: Mapping[str, ArrayRecord]) -> Message:
    """``msg`` with each array's bytes the next of ``data`` (record and array order kept), the
    records named in ``replaced`` replaced by those."""
    content = RecordDict()
    for key, record in msg.content.items():
        if key in replaced:
            record = replaced[key]
        elif isinstance(record, ArrayRecord):
            record = ArrayRecord(array_dict={
                name: Array(dtype=array.dtype, shape=array.shape, stype=array.stype, data=next(data))
                for name, array in record.items()})
        content[key] = record
    return Message(metadata=msg.metadata, content=content)
