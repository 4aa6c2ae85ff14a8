"""Text data and tokenizers of the language tasks: offline, CPU."""

import itertools
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before any hub import (conftest sets these too)
os.environ["HF_DATASETS_OFFLINE"] = "1"

import datasets  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from fedact_app.tasks import text_data  # noqa: E402
from fedact_app.tasks.text_data import (IGNORE_INDEX, HubUnavailableError, StreamCorpus, c4_corpus,  # noqa: E402
                                        cycle_shuffled, holdout_split, lm_batches, load_corpus, load_records,
                                        pack_blocks, pad_sequences, read_text_documents, shard_indices)
from fedact_app.tasks.tokenizers import BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe_tokenizer  # noqa: E402

STDLIB = os.path.dirname(os.__file__)


def _union_is_partition(shards, expected):
    """Shards are pairwise disjoint and their union is exactly ``expected`` (as multisets)."""
    flat = [item for shard in shards for item in shard]
    return sorted(flat) == sorted(expected) and len(set(flat)) == len(flat)


def test_byte_tokenizer_round_trip_and_special_ids():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids == [104, 195, 169, 108, 108, 111]
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == "héllo"
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258, 259)


def test_bpe_trained_on_local_files_round_trips(tmp_path):
    files = [os.path.join(STDLIB, name) for name in ("textwrap.py", "string.py", "heapq.py")]
    save = tmp_path / "bpe.json"
    tok = train_bpe_tokenizer(files, vocab_size=600, save_path=save)
    text = "def wrap(text, width=70):\n    return ünïcode_ok"
    assert tok.decode(tok.encode(text)) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert 256 < tok.vocab_size <= 600
    assert len(tok.encode("def return")) < len("def return")  # merges learnt from the files
    loaded = load_tokenizer(str(save))
    assert isinstance(loaded, BPETokenizer) and loaded.encode(text) == tok.encode(text)
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_hub_tokenizer_offline_fails_fast_naming_alternatives():
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(HubUnavailableError) as err:
        load_tokenizer("t5-base")
    message = str(err.value)
    assert "'t5-base'" in message and "'bytes'" in message and "train_bpe_tokenizer" in message


def test_c4_offline_fails_fast_naming_hub_id_and_local_files():
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    with pytest.raises(HubUnavailableError) as err:
        c4_corpus()
    message = str(err.value)
    assert "'allenai/c4'" in message and ".txt" in message and "local_corpus" in message
    with pytest.raises(HubUnavailableError):
        load_corpus(None)


def test_read_text_documents_splits_paragraphs_of_sorted_files(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("third\n\n\n  fourth line\nstill fourth  \n")
    (tmp_path / "a.txt").write_text("first\r\n\r\nsecond\n")
    (tmp_path / "ignored.md").write_text("not text")
    assert read_text_documents(tmp_path) == ["first", "second", "third", "fourth line\nstill fourth"]
    with pytest.raises(FileNotFoundError):
        read_text_documents(tmp_path / "missing")


def test_holdout_split_spreads_held_out_items():
    assert holdout_split(10, 0.2) == ([0, 1, 2, 3, 5, 6, 7, 8], [4, 9])
    with pytest.raises(ValueError):
        holdout_split(3, 0.1)


def test_shards_are_disjoint_and_cover():
    shards = [list(shard_indices(103, c, 7)) for c in range(7)]
    assert _union_is_partition(shards, range(103))
    assert shards[2][:3] == [2, 9, 16]
    with pytest.raises(ValueError):
        shard_indices(103, 7, 7)


def test_local_corpus_client_documents_partition_training_documents(tmp_path):
    documents = [f"document {i}" for i in range(60)]
    (tmp_path / "docs.txt").write_text("\n\n".join(documents))
    corpus = load_corpus(str(tmp_path), validation_fraction=0.1, seed=3)
    assert list(corpus.validation_documents()) == [f"document {i}" for i in range(9, 60, 10)]
    first_epochs = [list(itertools.islice(corpus.client_documents(c, 4), 54 // 4 + (c < 54 % 4)))
                    for c in range(4)]
    assert _union_is_partition(first_epochs, corpus.train)
    # epochs repeat the shard in a new order; `start` resumes the same endless sequence
    client0 = list(itertools.islice(corpus.client_documents(0, 4), 28))
    assert sorted(client0[:14]) == sorted(client0[14:]) and client0[:14] != client0[14:]
    assert list(itertools.islice(corpus.client_documents(0, 4, start=10), 18)) == client0[10:]


def test_cycle_shuffled_start_skips_into_later_epochs():
    items = list("abcde")
    endless = list(itertools.islice(cycle_shuffled(items, seed=1), 17))
    assert list(itertools.islice(cycle_shuffled(items, seed=1, start=12), 5)) == endless[12:]


@pytest.mark.parametrize("num_shards", [4, 3])  # 4: whole files per client; 3: document i mod 4
def test_stream_corpus_shards_are_disjoint_and_cover(num_shards):
    rows = datasets.Dataset.from_dict({"text": [f"doc {i}" for i in range(20)]})
    corpus = StreamCorpus(rows.to_iterable_dataset(num_shards=num_shards), rows.to_iterable_dataset())
    shards = [list(itertools.islice(corpus.client_documents(c, 4), 5)) for c in range(4)]
    assert _union_is_partition(shards, rows["text"])
    assert list(itertools.islice(corpus.client_documents(1, 4, start=3), 4)) == (shards[1] * 2)[3:7]
    assert len(list(corpus.validation_documents())) == 20


def test_pack_blocks_concatenates_documents_and_drops_the_tail():
    tok = ByteTokenizer()
    blocks = list(pack_blocks(["ab", "c"], tok, 3))  # stream: <s> a b </s> <s> c </s>
    assert blocks == [[257, 97, 98], [258, 257, 99]]
    batch = next(lm_batches(iter(blocks), 2, "cpu"))
    assert batch["input_ids"].shape == (2, 3) and torch.equal(batch["labels"], batch["input_ids"])
    assert list(lm_batches(iter(blocks), 3, "cpu")) == []


def test_pad_sequences_right_pads_with_ignored_labels():
    batch = pad_sequences([([5, 6, 7], [IGNORE_INDEX, 6, 7]), ([8], [8])], pad_id=0, device="cpu")
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7], [8, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_load_records_reads_local_files_with_split_pattern(tmp_path):
    for split in ("train", "test"):
        rows = [{"chosen": f"{split} {i}", "rejected": "x"} for i in range(3)]
        (tmp_path / f"hh-{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    test = load_records(str(tmp_path / "hh-{split}.jsonl"), hub_id="unused/hub-id", split="test", local_hint="")
    assert test["chosen"] == ["test 0", "test 1", "test 2"]
    with pytest.raises(HubUnavailableError, match="'nobody/no-such-set'.*my hint"):
        load_records(None, hub_id="nobody/no-such-set", split="train", local_hint="my hint")


def test_dataset_corpus_uses_a_locally_made_dataset():
    rows = datasets.Dataset.from_dict({"body": [f"doc {i}" for i in range(8)]})
    corpus = text_data.dataset_corpus(rows, text_column="body", validation_fraction=0.25)
    assert list(corpus.validation_documents()) == ["doc 3", "doc 7"]
    assert len(corpus.train) == 6
