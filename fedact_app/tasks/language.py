"""The language tasks as ``Task``s: Llama pre-training (``lm_pretrain``), LoRA instruction tuning
(``sft``) and LoRA preference optimisation (``dpo``), over the building blocks of
:mod:`.llama`, :mod:`.sft`, :mod:`.dpo`, :mod:`.lora`, :mod:`.text_data` and :mod:`.tokenizers`
(docs/LANGUAGE.md).

- Models are built from ``cfg.seed`` under a forked RNG (:func:`seeded`): the same seed gives the
  same weights in the ServerApp and in every ClientApp process, so a LoRA task's frozen base - which
  never travels - is bit-identical everywhere.
- ``shared_names``: the whole state for pre-training; only the trainable LoRA A/B tensors for
  SFT/DPO (what travels, and what FedACT's v-bar and Delta_G cover).
- Training data of a round: client ``i`` of ``N`` reads its shard (document/record ``j`` with
  ``j mod N == i``) in an order shuffled by a seed drawn from the round's ``generator`` (itself
  seeded from the run's seed, the round and the partition). A *streamed* corpus (C4) cannot be
  reshuffled: the client continues at document ``(server_round - 1) * documents_per_round`` of its
  stream, ``documents_per_round = K * batch_size * ceil(seq_len / 512)`` (about what a round packs
  when documents average 512 tokens; C4's average is below, so consecutive rounds' windows overlap a
  little rather than skip text). Every position is a function of the round: no state is kept.
- Held-out data: the first ``language.eval_batches`` batches of the held-out set on the server; a
  client evaluates its shard of the same set (up to as many batches).
- Tokenizers, corpora and records are cached per process (the ClientTrainer is kept warm).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedact_app.config import LORA_MODELS, Config, ConfigError
from fedact_app.tasks import dpo, llama, lora, sft
from fedact_app.tasks.base import Task
from fedact_app.tasks.text_data import (
    LocalCorpus,
    StreamCorpus,
    TextCorpus,
    batched,
    load_hub_dataset,
    load_records,
    local_corpus,
    pack_blocks,
    require_columns,
    shard_indices,
)
from fedact_app.tasks.tokenizers import BYTES, TextTokenizer, load_tokenizer

STREAM_TOKENS_PER_DOCUMENT = 512  # documents_per_round of a streamed corpus (module docstring)


class IteratorBatches:
    """``next_batch()`` over an endless iterator of batches (the ``BatchSource`` of base.py)."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches = batches

    def next_batch(self) -> Any:
        return next(self.batches)


def seeded(seed: int, build):
    """``build()`` with the global torch RNG seeded by ``seed`` and restored afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def round_seed(generator: torch.Generator) -> int:
    """A shuffle seed drawn from the round's generator."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))


def tokenizer_name(cfg: Config) -> str:
    """``model.tokenizer``, or when null: the base model's own (a hub name / folder), ``bytes`` for
    ``llama_tiny`` and GaLore's ``t5-base`` for the other Llama presets."""
    if cfg.model.tokenizer:
        return cfg.model.tokenizer
    base = cfg.model.base if cfg.model.name in LORA_MODELS else cfg.model.name
    if base in llama.PRESETS:
        return BYTES if base == "llama_tiny" else llama.DEFAULT_TOKENIZER
    return base


@functools.lru_cache(maxsize=4)
def cached_tokenizer(name: str, data_dir: str | None) -> TextTokenizer:
    return load_tokenizer(name, data_dir)


@functools.lru_cache(maxsize=4)
def cached_local_corpus(path: str, validation_fraction: float, seed: int) -> LocalCorpus:
    return local_corpus(path, validation_fraction, seed)


@functools.lru_cache(maxsize=8)
def cached_records(path: str | None, hub_id: str | None, split: str, data_dir: str | None,
                   columns: tuple[str, ...]) -> list[dict]:
    """The rows of a local or hub record set as a list of dicts (loaded once per process)."""
    hint = (f"pass local files instead (dataset.path=/abs/... a .json/.jsonl/.parquet/.csv file or a folder "
            f"of them) with columns {list(columns)}.")
    if path is None and hub_id is None:
        raise ConfigError("dataset.path and dataset.hub_path are both null: set one of them")
    dataset = load_records(path, hub_id=hub_id or "", split=split, data_dir=data_dir, local_hint=hint)
    require_columns(dataset, columns, path or hub_id)
    return dataset.select_columns(list(columns)).to_list()


def split_held_out(rows: list, fraction: float, what: str) -> tuple[list, list]:
    """(training rows, held-out rows): every ``round(1/fraction)``-th row held out."""
    every = max(2, round(1 / fraction))
    held_out = rows[every - 1::every]
    if not held_out:
        raise ConfigError(f"Invalid config value dataset.validation_fraction={fraction!r}: {len(rows)} {what} "
                          f"are too few to hold out one in {every}; allowed a larger fraction or more data")
    return [r for i, r in enumerate(rows) if i % every != every - 1], held_out


def require_enough(count: int, cfg: Config, what: str) -> None:
    """ConfigError when fewer than ``num_clients`` training items exist (each client needs one)."""
    if count < cfg.num_clients:
        raise ConfigError(f"Invalid config value num_clients={cfg.num_clients!r}: dataset={cfg.dataset.name} "
                          f"({cfg.dataset.path or cfg.dataset.hub_path}) has {count} training {what}; allowed "
                          f"at most {count} clients (each client's shard needs at least one)")


class LanguageTask(Task):
    """What the three language tasks share: tokenizer, seeded model, held-out batches cache."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self._eval_batches: dict[str, list[dict[str, Tensor]]] = {}

    @property
    def tokenizer(self) -> TextTokenizer:
        return cached_tokenizer(tokenizer_name(self.cfg), self.cfg.data_dir)

    def check_data(self) -> None:
        """The task's data checks (``check_task_data``), and a warning that ``partition.*`` does not
        apply: language shards are dealt round-robin, an IID split (docs/LANGUAGE.md)."""
        if self.cfg.partition.name != "iid":
            warnings.warn(f"partition={self.cfg.partition.name} does not apply to task={self.cfg.task}: "
                          "every client gets a round-robin (IID) shard of the documents/records; "
                          "pass partition=iid to silence this", UserWarning, stacklevel=2)
        self.check_task_data()

    def check_task_data(self) -> None:
        """Can the data feed ``num_clients`` clients and the held-out evaluation?"""
        raise NotImplementedError

    def max_eval_items(self) -> int:
        return self.cfg.language.eval_batches * self.cfg.batch_size

    def server_batches(self, device: torch.device) -> list[dict[str, Tensor]]:
        """The server's held-out batches, made once per device."""
        key = str(device)
        if key not in self._eval_batches:
            self._eval_batches[key] = self.held_out_batches(None, 1, device)
        return self._eval_batches[key]

    def held_out_batches(self, partition_id: int | None, num_partitions: int,
                         device: torch.device) -> list[dict[str, Tensor]]:
        """Batches of the held-out set (``partition_id`` None) or of one client's shard of it."""
        raise NotImplementedError

    @staticmethod
    def prefixed(metrics: dict[str, float]) -> dict[str, float]:
        return {f"test_{key}": value for key, value in metrics.items()}

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        return self.prefixed(self.metrics(model, self.server_batches(device)))

    def evaluate_client(self, model: nn.Module, partition_id: int, num_partitions: int,
                        device: torch.device) -> tuple[dict[str, float], int]:
        batches = self.held_out_batches(partition_id, num_partitions, device)
        return self.prefixed(self.metrics(model, batches)), self.count(batches)

    def metrics(self, model: nn.Module, batches: list[dict[str, Tensor]]) -> dict[str, float]:
        raise NotImplementedError

    @staticmethod
    def count(batches: list[dict[str, Tensor]]) -> int:
        """Examples in ``batches`` (sequences)."""
        return sum(b["input_ids"].shape[0] for b in batches)


class PretrainTask(LanguageTask):
    """Next-token prediction with a freshly initialised Llama preset on C4 or local text."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self._corpus: TextCorpus | None = None

    @property
    def corpus(self) -> TextCorpus:
        if self._corpus is None:
            data = self.cfg.dataset
            if data.path is not None:
                self._corpus = cached_local_corpus(data.path, data.validation_fraction, self.cfg.seed)
            else:
                hint = "pass local text instead: dataset=text dataset.path=/abs/file-or-folder-of-txt."
                train, validation = (load_hub_dataset(data.hub_path, data.hub_config, split=split, streaming=True,
                                                      data_dir=self.cfg.data_dir, local_hint=hint)
                                     for split in (data.train_split, data.test_split))
                self._corpus = StreamCorpus(train, validation)
        return self._corpus

    def build_model(self) -> nn.Module:
        name, seq_len = self.cfg.model.name, self.cfg.language.seq_len
        context = max(llama.PRESETS[name].max_position_embeddings, seq_len)
        return llama.build_model(name, vocab_size=self.tokenizer.vocab_size, max_position_embeddings=context,
                                 seed=self.cfg.seed)

    def describe_train_data(self, partition_id: int, num_partitions: int) -> str:
        corpus = self.corpus
        if not isinstance(corpus, LocalCorpus):
            return "a streamed corpus"
        return f"{len(shard_indices(len(corpus.train), partition_id, num_partitions))} training documents"

    def check_task_data(self) -> None:
        corpus = self.corpus
        if isinstance(corpus, LocalCorpus):
            require_enough(len(corpus.train), self.cfg, "documents")
            if next(pack_blocks(corpus.validation_documents(), self.tokenizer, self.cfg.language.seq_len), None) is None:
                raise ConfigError(f"Invalid config value language.seq_len={self.cfg.language.seq_len!r}: the "
                                  f"held-out text of {self.cfg.dataset.path} is shorter than one sequence; allowed a "
                                  "shorter seq_len, a larger dataset.validation_fraction or more text")

    def train_batches(self, partition_id: int, num_partitions: int, server_round: int,
                      device: torch.device, generator: torch.Generator) -> IteratorBatches:
        corpus, start = self.corpus, 0
        if isinstance(corpus, LocalCorpus):  # in memory: a new shuffle of the shard every round
            corpus = dataclasses.replace(corpus, seed=round_seed(generator))
        else:  # a stream: continue at a position derived from the round (module docstring)
            cfg = self.cfg
            per_round = cfg.local_steps * cfg.batch_size * math.ceil(cfg.language.seq_len / STREAM_TOKENS_PER_DOCUMENT)
            start = (server_round - 1) * per_round
        return IteratorBatches(llama.client_batches(
            corpus, self.tokenizer, client_id=partition_id, num_clients=num_partitions,
            batch_size=self.cfg.batch_size, seq_len=self.cfg.language.seq_len, device=device, start_document=start))

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        return llama.loss(model, batch), batch["input_ids"].shape[0]

    def held_out_batches(self, partition_id: int | None, num_partitions: int,
                         device: torch.device) -> list[dict[str, Tensor]]:
        documents: Iterable[str] = self.corpus.validation_documents()
        if partition_id is not None:
            documents = itertools.islice(documents, partition_id, None, num_partitions)
        blocks = list(itertools.islice(pack_blocks(documents, self.tokenizer, self.cfg.language.seq_len),
                                       self.max_eval_items()))
        if not blocks:
            raise ValueError(f"the held-out text is shorter than one sequence of {self.cfg.language.seq_len} tokens")
        return [{"input_ids": ids, "labels": ids}
                for ids in (torch.tensor(b, dtype=torch.long, device=device)
                            for b in batched(blocks, self.cfg.batch_size, drop_last=False))]

    def metrics(self, model: nn.Module, batches: list[dict[str, Tensor]]) -> dict[str, float]:
        return llama.evaluate(model, batches)


class LoraTask(LanguageTask):
    """A frozen causal LM (``model.base``) with LoRA adapters; only the adapters are shared."""

    columns: tuple[str, ...] = ()
    unit = "examples"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self._data: tuple[list, list] | None = None

    def build_model(self) -> nn.Module:
        model_cfg = self.cfg.model
        settings = lora.LoraSettings(rank=model_cfg.lora.rank, alpha=model_cfg.lora.alpha,
                                     dropout=model_cfg.lora.dropout,
                                     target_modules=tuple(model_cfg.lora.target_modules))
        vocab_size = self.tokenizer.vocab_size if model_cfg.base in llama.PRESETS else None
        return seeded(self.cfg.seed, lambda: lora.build_model(model_cfg.base, settings, vocab_size=vocab_size,
                                                              data_dir=self.cfg.data_dir))

    def shared_names(self, model: nn.Module) -> list[str]:
        return list(lora.trainable_parameters(model))

    def rows(self, split: str) -> list[dict]:
        data = self.cfg.dataset
        return cached_records(data.path, data.hub_path, split, self.cfg.data_dir, self.columns)

    def items(self, rows: list[dict]) -> list:
        """Training/held-out items of raw rows (records, or parsed preference pairs)."""
        return rows

    def load(self) -> tuple[list, list]:
        """(training items, held-out items)."""
        rows = self.rows(self.cfg.dataset.train_split)
        return split_held_out(self.items(rows), self.cfg.dataset.validation_fraction, self.unit)

    @property
    def data(self) -> tuple[list, list]:
        if self._data is None:
            self._data = self.load()
        return self._data

    def check_task_data(self) -> None:
        require_enough(len(self.data[0]), self.cfg, self.unit)

    def describe_train_data(self, partition_id: int, num_partitions: int) -> str:
        return f"{len(shard_indices(len(self.data[0]), partition_id, num_partitions))} training {self.unit}"

    def held_out_batches(self, partition_id: int | None, num_partitions: int,
                         device: torch.device) -> list[dict[str, Tensor]]:
        held_out = self.data[1]
        if partition_id is not None:
            held_out = held_out[partition_id::num_partitions]
            if not held_out:
                raise ValueError(f"{len(self.data[1])} held-out {self.unit} leave none for client {partition_id} "
                                 f"of {num_partitions}")
        return self.collate_all(held_out[:self.max_eval_items()], device)

    def collate_all(self, items: Sequence, device: torch.device) -> list[dict[str, Tensor]]:
        raise NotImplementedError


class SFTTask(LoraTask):
    """Instruction tuning on Alpaca-style records (response tokens only count)."""

    columns = sft.ALPACA_COLUMNS

    def train_batches(self, partition_id: int, num_partitions: int, server_round: int,
                      device: torch.device, generator: torch.Generator) -> IteratorBatches:
        return IteratorBatches(sft.client_batches(
            self.data[0], self.tokenizer, client_id=partition_id, num_clients=num_partitions,
            batch_size=self.cfg.batch_size, max_length=self.cfg.language.max_length, device=device,
            seed=round_seed(generator)))

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        return sft.loss(model, batch), batch["input_ids"].shape[0]

    def collate_all(self, items: Sequence, device: torch.device) -> list[dict[str, Tensor]]:
        return sft.eval_batches(items, self.tokenizer, batch_size=self.cfg.batch_size,
                                max_length=self.cfg.language.max_length, device=device)

    def metrics(self, model: nn.Module, batches: list[dict[str, Tensor]]) -> dict[str, float]:
        return sft.evaluate(model, batches)


class DPOTask(LoraTask):
    """Direct preference optimisation on HH-RLHF-style pairs against the frozen base."""

    columns = dpo.HH_COLUMNS
    unit = "preference pairs"

    def items(self, rows: list[dict]) -> list:
        return dpo.preference_pairs(rows)

    def load(self) -> tuple[list, list]:
        """Train/test splits of the hub or of a local path with '{split}'; else one local set of which
        every round(1/validation_fraction)-th pair is held out."""
        data = self.cfg.dataset
        if data.path is None or "{split}" in data.path:
            train, test = (self.items(self.rows(split)) for split in (data.train_split, data.test_split))
            if not test:
                raise ConfigError(f"Invalid config value dataset.test_split={data.test_split!r}: it holds no "
                                  "parsable preference pairs; allowed a split with chosen/rejected dialogues")
            return train, test
        return super().load()

    def train_batches(self, partition_id: int, num_partitions: int, server_round: int,
                      device: torch.device, generator: torch.Generator) -> IteratorBatches:
        language = self.cfg.language
        return IteratorBatches(dpo.client_batches(
            self.data[0], self.tokenizer, client_id=partition_id, num_clients=num_partitions,
            batch_size=self.cfg.batch_size, max_length=language.max_length,
            max_prompt_length=language.max_prompt_length, device=device, seed=round_seed(generator)))

    def loss(self, model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, int]:
        return dpo.loss(model, batch, self.cfg.language.dpo_beta), batch["input_ids"].shape[0] // 2

    def collate_all(self, items: Sequence, device: torch.device) -> list[dict[str, Tensor]]:
        language = self.cfg.language
        return dpo.eval_batches(items, self.tokenizer, batch_size=self.cfg.batch_size,
                                max_length=language.max_length, max_prompt_length=language.max_prompt_length,
                                device=device)

    def metrics(self, model: nn.Module, batches: list[dict[str, Tensor]]) -> dict[str, float]:
        return dpo.evaluate(model, batches, self.cfg.language.dpo_beta)

    @staticmethod
    def count(batches: list[dict[str, Tensor]]) -> int:
        """Pairs in ``batches`` (each holds its chosen, then its rejected sequences)."""
        return sum(b["input_ids"].shape[0] // 2 for b in batches)
