"""Tokenizers for the language tasks, behind one small interface (:class:`TextTokenizer`).

- ``"bytes"`` -> :class:`ByteTokenizer`: UTF-8 bytes are ids 0..255, then ``<pad>`` 256,
  ``<s>`` 257, ``</s>`` 258 (vocabulary 259). Needs nothing; for tests and tiny offline runs.
- a ``*.json`` file -> :class:`BPETokenizer`: a byte-level BPE saved by :func:`train_bpe_tokenizer`,
  which trains one with the ``tokenizers`` library on local text files (special tokens ``<pad>``,
  ``<s>``, ``</s>`` are ids 0, 1, 2).
- anything else (a hub name such as ``t5-base`` or ``meta-llama/Llama-2-7b-hf``, or a local folder
  saved with ``save_pretrained``) -> :class:`HubTokenizer` around ``transformers.AutoTokenizer``.
  Offline and not cached this raises :class:`~fedact_app.tasks.hub.HubUnavailableError`
  naming the name and the local alternatives.

``encode`` never adds special tokens; the tasks add ``bos``/``eos`` where their formats put them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol, Sequence

import tokenizers  # the Hugging Face `tokenizers` library (absolute import: not this module)
from tokenizers import decoders, models, pre_tokenizers, trainers

from fedact_app.tasks.hub import HubUnavailableError, unavailable_message

BYTES = "bytes"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 of a trained BPE; 256, 257, 258 of bytes


class TextTokenizer(Protocol):
    """What the language tasks need from a tokenizer."""

    vocab_size: int  # ids lie in [0, vocab_size)
    bos_id: int | None  # prepended to each document/sequence when not None
    eos_id: int  # appended to each document/response
    pad_id: int  # fills padded positions (never counted in a loss)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 plus ``<pad>`` 256, ``<s>`` 257 and ``</s>`` 258."""

    pad_id, bos_id, eos_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of the byte ids (special ids dropped, invalid UTF-8 replaced)."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` whose special tokens are :data:`SPECIAL_TOKENS`."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self.tokenizer = tokenizer
        self.pad_id, self.bos_id, self.eos_id = (self._special_id(token) for token in SPECIAL_TOKENS)
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """Load a tokenizer saved by :func:`train_bpe_tokenizer` (``tokenizer.json`` format)."""
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    def _special_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the BPE tokenizer has no special token {token!r} (expected {SPECIAL_TOKENS})")
        return token_id

    def encode(self, text: str) -> list[int]:
        """BPE ids of ``text`` without special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens dropped)."""
        return self.tokenizer.decode(list(ids))


class HubTokenizer:
    """A ``transformers`` tokenizer; ``pad_id`` falls back to ``eos_id`` when it has no pad token
    (as Llama's)."""

    def __init__(self, tokenizer):
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no end-of-sequence token")
        self.tokenizer = tokenizer
        self.bos_id = tokenizer.bos_token_id
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        self.vocab_size = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens kept."""
        return self.tokenizer.decode(list(ids))


def train_bpe_tokenizer(files: Iterable[str | Path], vocab_size: int = 8192,
                        save_path: str | Path | None = None) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization, every byte in the initial alphabet, so
    no text is ever unknown) on local text files; save it as JSON when ``save_path`` is given."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(f) for f in files], trainer)
    if save_path is not None:
        tokenizer.save(str(save_path))
    return BPETokenizer(tokenizer)


def load_tokenizer(name_or_path: str, data_dir: str | None = None) -> TextTokenizer:
    """``"bytes"``, a trained BPE ``*.json`` file, or a ``transformers`` tokenizer by hub name or
    local folder (hub downloads are cached under ``data_dir`` when given)."""
    if name_or_path == BYTES:
        return ByteTokenizer()
    if name_or_path.endswith(".json"):
        return BPETokenizer.from_file(name_or_path)
    from transformers import AutoTokenizer  # heavy import, only when a transformers tokenizer is asked for

    try:
        return HubTokenizer(AutoTokenizer.from_pretrained(name_or_path, cache_dir=data_dir))
    except OSError as exc:  # offline / not cached / no such repo or folder
        hint = (f"use tokenizer '{BYTES}' (UTF-8 bytes), a BPE trained on local text with "
                "fedact_app.tasks.tokenizers.train_bpe_tokenizer(files, vocab_size, save_path) and passed "
                "as its .json path, or a local folder holding a tokenizer saved with save_pretrained.")
        raise HubUnavailableError(unavailable_message("tokenizer", name_or_path, exc, hint)) from exc
