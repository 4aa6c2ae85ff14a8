"""Text data for the language tasks: where documents and records come from, how they are split over
clients and held out, and how token ids become tensors.

Sources
-------
- **C4-en** (pre-training): ``datasets.load_dataset("allenai/c4", "en", streaming=True)``, column
  ``text`` (the rows also carry ``timestamp`` and ``url``, which are not used); split ``train`` for
  the clients, split ``validation`` held out (:func:`c4_corpus` -> :class:`StreamCorpus`).
- **Local text**: a ``.txt`` file or a folder searched recursively for ``*.txt`` (sorted paths);
  every block of text between blank lines is one document (:func:`read_text_documents`,
  :func:`local_corpus`).
- **A locally made** ``datasets.Dataset`` with a text column (:func:`dataset_corpus`), or any
  ``datasets.IterableDataset`` pair given to :class:`StreamCorpus`.
- **Records** for SFT/DPO (:func:`load_records`): a hub dataset split loaded whole, or local
  ``.json``/``.jsonl``/``.parquet``/``.csv`` files (one file or a folder of them) with the same
  columns; a ``{split}`` in the local path is replaced by the split's name.

Without hub access (offline, ``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``) a hub source fails
at once with :class:`HubUnavailableError`, whose message names the hub id and the local alternative.

Held-out and client shards
--------------------------
- Local corpora hold out every ``round(1/validation_fraction)``-th document (index ``i`` with
  ``i % every == every - 1``), so the held-out text is spread over all files (:func:`holdout_split`).
- Training document (or record) ``i`` belongs to client ``i mod N`` (:func:`shard_indices`): the
  shards are disjoint and together cover the training set. C4 streams use
  ``datasets.distributed.split_dataset_by_node``: when ``N`` divides the stream's number of files
  (1024 for C4-en train) client ``i`` streams its own contiguous group of files; otherwise every
  client reads the stream and keeps document ``i mod N`` (disjoint and covering in both cases; the
  first costs each client only its own share of downloads).

Each client reads its shard as an endless sequence (:func:`client_items` for documents and records
held in memory, :meth:`StreamCorpus.client_documents` for streams): a shard in memory repeats in
epochs, each epoch in a new order drawn from ``(seed, client, epoch)``; a stream restarts when
exhausted. ``start`` skips that many items of the sequence, so a client can resume where its
previous round stopped.

Tensors
-------
:func:`pack_blocks` concatenates documents as ``[bos] + ids + [eos]`` (``bos`` only when the
tokenizer has one) and cuts the token stream into blocks of exactly ``seq_len`` tokens (no padding;
the incomplete tail is dropped); :func:`lm_batches` stacks blocks into ``(batch, seq_len)``.
:func:`pad_sequences` right-pads variable-length (input ids, labels) pairs for SFT/DPO, labels
padded with :data:`IGNORE_INDEX`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Protocol, Sequence, TypeVar

import torch
from torch import Tensor

from fedact_app.compat import ensure_torchvision_ops

ensure_torchvision_ops()  # datasets and transformers may import torchvision; keep it importable on CPU torch

import datasets  # noqa: E402
from datasets.distributed import split_dataset_by_node  # noqa: E402

from fedact_app.tasks.hub import HubUnavailableError, unavailable_message  # noqa: E402

if TYPE_CHECKING:
    from fedact_app.tasks.tokenizers import TextTokenizer

IGNORE_INDEX = -100  # label of tokens that do not count in the loss (torch cross_entropy's default)
C4_HUB_ID = "allenai/c4"
C4_CONFIG = "en"
TEXT_COLUMN = "text"
RECORD_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}

T = TypeVar("T")


def load_hub_dataset(hub_id: str, config: str | None = None, *, split: str, streaming: bool = False,
                     data_dir: str | None = None, local_hint: str) -> datasets.Dataset | datasets.IterableDataset:
    """``datasets.load_dataset(hub_id, config, split=split, streaming=streaming)``; any I/O failure
    (``ConnectionError``, ``OfflineModeIsEnabled``, ``DatasetNotFoundError``, all ``OSError``)
    becomes a :class:`HubUnavailableError` naming ``hub_id`` and ``local_hint``."""
    try:
        return datasets.load_dataset(hub_id, config, split=split, streaming=streaming, cache_dir=data_dir)
    except OSError as exc:
        raise HubUnavailableError(unavailable_message("dataset", hub_id, exc, local_hint)) from exc


def load_local_records(path: str | Path) -> datasets.Dataset:
    """All rows of a ``.json``/``.jsonl``/``.parquet``/``.csv`` file, or of every such file in a
    folder (recursively, sorted; all of one format), as one ``datasets.Dataset``."""
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.suffix in RECORD_FILE_BUILDERS) if root.is_dir() else [root]
    if not files or not all(f.is_file() and f.suffix in RECORD_FILE_BUILDERS for f in files):
        raise FileNotFoundError(f"{str(path)!r} is not a {'/'.join(RECORD_FILE_BUILDERS)} file or a folder "
                                "holding such files")
    builders = {RECORD_FILE_BUILDERS[f.suffix] for f in files}
    if len(builders) > 1:
        raise ValueError(f"{str(path)!r} mixes file formats {sorted(builders)}; keep one format per folder")
    return datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train")


def load_records(path: str | None, *, hub_id: str, split: str, data_dir: str | None = None,
                 local_hint: str) -> datasets.Dataset:
    """The ``split`` of an SFT/DPO data set: local files when ``path`` is set (a ``{split}`` in it is
    replaced by the split's name, e.g. ``/data/hh-{split}.jsonl``), else the hub's ``hub_id``
    (downloaded whole: these sets are small)."""
    if path is not None:
        return load_local_records(path.format(split=split) if "{split}" in path else path)
    return load_hub_dataset(hub_id, split=split, data_dir=data_dir, local_hint=local_hint)


def require_columns(dataset: datasets.Dataset, columns: Sequence[str], source: str) -> None:
    """Raise ValueError naming ``source`` when ``dataset`` lacks one of ``columns``."""
    missing = [c for c in columns if c not in dataset.column_names]
    if missing:
        raise ValueError(f"{source} has no column(s) {missing}; it has {dataset.column_names}")


def split_records(dataset: datasets.Dataset, fraction: float) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(training records, held-out records): every ``round(1/fraction)``-th record held out."""
    train, held_out = holdout_split(len(dataset), fraction)
    return dataset.select(train), dataset.select(held_out)


def read_text_documents(path: str | Path) -> list[str]:
    """Documents of a ``.txt`` file or of every ``*.txt`` under a folder (sorted paths): the blocks
    of text between blank lines, stripped, empty blocks skipped."""
    root = Path(path)
    files = sorted(root.rglob("*.txt")) if root.is_dir() else [root]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"{str(path)!r} is neither a text file nor a folder with *.txt files")
    documents = []
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        blocks = (block.strip() for block in text.split("\n\n"))
        documents.extend(block for block in blocks if block)
    return documents


def holdout_split(num_items: int, fraction: float) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of ``num_items`` items: every ``round(1/fraction)``-th
    item is held out, so the held-out set is spread evenly over the source order."""
    if not 0 < fraction < 1:
        raise ValueError(f"validation fraction must lie in (0, 1), got {fraction}")
    every = max(2, round(1 / fraction))
    held_out = [i for i in range(num_items) if i % every == every - 1]
    if not held_out:
        raise ValueError(f"{num_items} items are too few to hold out a fraction {fraction} (one in {every})")
    return [i for i in range(num_items) if i % every != every - 1], held_out


def check_client(client_id: int, num_clients: int) -> None:
    """Raise ValueError unless ``0 <= client_id < num_clients``."""
    if not 0 <= client_id < num_clients:
        raise ValueError(f"client_id must lie in [0, {num_clients}), got {client_id}")


def shard_indices(num_items: int, client_id: int, num_clients: int) -> range:
    """Indices of the items client ``client_id`` holds: item ``i`` goes to client ``i mod num_clients``."""
    check_client(client_id, num_clients)
    if num_items < num_clients:
        raise ValueError(f"{num_items} items cannot give each of {num_clients} clients at least one")
    return range(client_id, num_items, num_clients)


def cycle_shuffled(items: Sequence[T], seed: int | str, start: int = 0) -> Iterator[T]:
    """``items`` forever, epoch after epoch, each epoch in the order of a ``random.Random`` seeded
    with ``(seed, epoch)``; the first ``start`` items of that endless sequence are skipped."""
    if not items:
        raise ValueError("cannot cycle over an empty set of items")
    first_epoch, offset = divmod(start, len(items))
    for epoch in itertools.count(first_epoch):
        order = list(range(len(items)))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        yield from (items[i] for i in order[offset:])
        offset = 0


def client_items(items: Sequence[T], client_id: int, num_clients: int, *, seed: int | str = 0,
                 start: int = 0) -> Iterator[T]:
    """Client ``client_id``'s shard of ``items`` (item ``i`` with ``i mod num_clients == client_id``)
    as an endless sequence of epochs shuffled by ``(seed, client_id, epoch)``, from item ``start`` on."""
    shard = [items[i] for i in shard_indices(len(items), client_id, num_clients)]
    return cycle_shuffled(shard, seed=f"{seed}-{client_id}", start=start)


class TextCorpus(Protocol):
    """A pre-training corpus: an endless document stream per client and a finite held-out set."""

    def client_documents(self, client_id: int, num_clients: int, start: int = 0) -> Iterator[str]: ...

    def validation_documents(self) -> Iterator[str]: ...


@dataclass(frozen=True)
class LocalCorpus:
    """Documents held in memory, split into training documents (sharded round-robin over clients)
    and held-out validation documents."""

    train: tuple[str, ...]
    validation: tuple[str, ...]
    seed: int = 0

    def client_documents(self, client_id: int, num_clients: int, start: int = 0) -> Iterator[str]:
        """The client's shard (training document ``i`` with ``i mod num_clients == client_id``),
        repeated in epochs shuffled by ``(seed, client_id, epoch)``, from document ``start`` on."""
        return client_items(self.train, client_id, num_clients, seed=self.seed, start=start)

    def validation_documents(self) -> Iterator[str]:
        """The held-out documents, in source order."""
        return iter(self.validation)


@dataclass(frozen=True)
class StreamCorpus:
    """Documents streamed from ``datasets.IterableDataset``s (C4 from the hub, or any local stream)."""

    train: datasets.IterableDataset
    validation: datasets.IterableDataset
    text_column: str = TEXT_COLUMN

    def client_documents(self, client_id: int, num_clients: int, start: int = 0) -> Iterator[str]:
        """The client's part of the training stream (``split_dataset_by_node``: its own files when
        ``num_clients`` divides the number of files, else document ``i mod num_clients``), restarted
        when exhausted, from document ``start`` on (skipped documents are read, not tokenized)."""
        check_client(client_id, num_clients)
        shard = split_dataset_by_node(self.train, rank=client_id, world_size=num_clients)
        return itertools.islice(self._repeat(shard), start, None)

    def validation_documents(self) -> Iterator[str]:
        """The held-out stream's documents, in stream order."""
        return self._texts(self.validation)

    def _texts(self, stream: datasets.IterableDataset) -> Iterator[str]:
        """The text column of each row of ``stream``."""
        return (row[self.text_column] for row in stream)

    def _repeat(self, stream: datasets.IterableDataset) -> Iterator[str]:
        """The texts of ``stream`` pass after pass; ValueError when a pass yields none."""
        while True:
            count = 0
            for count, text in enumerate(self._texts(stream), start=1):
                yield text
            if count == 0:
                raise ValueError("this client's part of the training stream holds no documents")


def corpus_from_documents(documents: Iterable[str], validation_fraction: float = 0.05,
                          seed: int = 0) -> LocalCorpus:
    """A :class:`LocalCorpus` holding out every ``round(1/validation_fraction)``-th document."""
    documents = list(documents)
    train, held_out = holdout_split(len(documents), validation_fraction)
    return LocalCorpus(tuple(documents[i] for i in train), tuple(documents[i] for i in held_out), seed)


def local_corpus(path: str | Path, validation_fraction: float = 0.05, seed: int = 0) -> LocalCorpus:
    """The documents of local ``.txt`` files (:func:`read_text_documents`) as a corpus."""
    return corpus_from_documents(read_text_documents(path), validation_fraction, seed)


def dataset_corpus(dataset: datasets.Dataset, text_column: str = TEXT_COLUMN,
                   validation_fraction: float = 0.05, seed: int = 0) -> LocalCorpus:
    """The ``text_column`` of a locally made ``datasets.Dataset`` as a corpus."""
    return corpus_from_documents(dataset[text_column], validation_fraction, seed)


def c4_corpus(data_dir: str | None = None) -> StreamCorpus:
    """C4-en streamed from the hub: ``train`` for the clients, ``validation`` held out."""
    hint = ("pass local text instead: a .txt file or a folder of *.txt files "
            "(fedact_app.tasks.text_data.local_corpus), or a datasets.Dataset with a 'text' column "
            "(dataset_corpus).")
    train, validation = (load_hub_dataset(C4_HUB_ID, C4_CONFIG, split=split, streaming=True, data_dir=data_dir,
                                          local_hint=hint) for split in ("train", "validation"))
    return StreamCorpus(train, validation)


def load_corpus(path: str | None = None, *, validation_fraction: float = 0.05, seed: int = 0,
                data_dir: str | None = None) -> TextCorpus:
    """The pre-training corpus: local ``.txt`` text when ``path`` is set, else C4-en from the hub."""
    if path is not None:
        return local_corpus(path, validation_fraction, seed)
    return c4_corpus(data_dir)


def pack_blocks(documents: Iterable[str], tokenizer: TextTokenizer, seq_len: int) -> Iterator[list[int]]:
    """Blocks of exactly ``seq_len`` token ids cut from the concatenation of ``[bos] + ids + [eos]``
    of consecutive documents (documents are packed, never padded; the incomplete tail is dropped)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2 (one input and one next token), got {seq_len}")
    prefix = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    buffer: list[int] = []
    for document in documents:
        buffer.extend(prefix + tokenizer.encode(document) + [tokenizer.eos_id])
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            del buffer[:seq_len]


def batched(items: Iterable[T], batch_size: int, *, drop_last: bool = True) -> Iterator[list[T]]:
    """Consecutive lists of ``batch_size`` items; an incomplete last list is dropped unless
    ``drop_last`` is False."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, batch_size)):
        if len(batch) < batch_size and drop_last:
            return
        yield batch


def lm_batches(blocks: Iterable[list[int]], batch_size: int, device: torch.device | str) -> Iterator[dict[str, Tensor]]:
    """``{"input_ids", "labels"}`` of shape ``(batch_size, seq_len)`` on ``device``; the labels are
    the inputs (the model predicts token ``t+1`` from tokens ``<= t``), no position is masked."""
    for batch in batched(blocks, batch_size):
        input_ids = torch.tensor(batch, dtype=torch.long, device=device)
        yield {"input_ids": input_ids, "labels": input_ids}


def pad_sequences(sequences: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int,
                  device: torch.device | str) -> dict[str, Tensor]:
    """Right-pad ``(input_ids, labels)`` pairs to the longest: ``input_ids`` padded with ``pad_id``,
    ``labels`` with :data:`IGNORE_INDEX`, ``attention_mask`` 1 on real tokens, 0 on padding."""
    length = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, (ids, row_labels) in enumerate(sequences):
        if len(ids) != len(row_labels):
            raise ValueError(f"sequence {row} has {len(ids)} input ids but {len(row_labels)} labels")
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[row, :len(ids)] = torch.tensor(row_labels, dtype=torch.long)
        attention_mask[row, :len(ids)] = 1
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    return {name: tensor.to(device) for name, tensor in batch.items()}
