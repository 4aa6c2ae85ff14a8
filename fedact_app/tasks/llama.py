"""Llama-style pre-training: model presets, the Chinchilla round budget, batches, loss, perplexity.

Presets (:data:`PRESETS`) are GaLore's ``configs/llama_{60m,130m,250m}.json`` (jiaweizzhao/GaLore,
inherited from ReLoRA): SwiGLU MLP, RMSNorm (eps 1e-6), rotary positions, untied input/output
embeddings, initializer range 0.02, vocabulary 32000, context 1024. ``llama_tiny`` is ours, for
tests and CPU smoke runs. :func:`build_model` makes a ``transformers.LlamaForCausalLM`` from the
config with freshly initialised weights (nothing is downloaded); the vocabulary should be the
tokenizer's (``vocab_size=tokenizer.vocab_size``). The default tokenizer is GaLore's,
:data:`DEFAULT_TOKENIZER` ``t5-base`` (32100 ids, trained on C4; its ids 0/1 are pad/eos as in the
GaLore configs).

Batches differ from GaLore's in one respect: documents are packed into full ``seq_len`` blocks
(:func:`~fedact_app.tasks.text_data.pack_blocks`) instead of one truncated, padded document per row.

The causal-LM computations here are shared by the fine-tuning tasks: a batch is a dict with
``input_ids`` and ``labels`` (``(batch, length)``; ``labels`` = ``IGNORE_INDEX`` where a token
does not count) and an optional ``attention_mask``; the token at position ``t+1`` is predicted from
positions ``<= t``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedact_app.compat import ensure_torchvision_ops
from fedact_app.tasks.text_data import IGNORE_INDEX, TextCorpus, lm_batches, pack_blocks
from fedact_app.tasks.tokenizers import TextTokenizer

ensure_torchvision_ops()  # before transformers imports torchvision (CPU torch + CUDA torchvision)

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

DEFAULT_TOKENIZER = "t5-base"  # GaLore's pre-training tokenizer (torchrun_main.py)
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. (2022): compute-optimal ~20 training tokens per parameter


@dataclass(frozen=True)
class LlamaPreset:
    """The shape of a Llama decoder."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    vocab_size: int = 32000
    max_position_embeddings: int = 1024


PRESETS = {
    "llama_60m": LlamaPreset(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_hidden_layers=8),
    "llama_130m": LlamaPreset(hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_hidden_layers=12),
    "llama_250m": LlamaPreset(hidden_size=768, intermediate_size=2560, num_attention_heads=16, num_hidden_layers=24),
    "llama_tiny": LlamaPreset(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_hidden_layers=2,
                              vocab_size=259, max_position_embeddings=256),  # 259: ByteTokenizer's vocabulary
}


def llama_config(preset: str, *, vocab_size: int | None = None,
                 max_position_embeddings: int | None = None) -> LlamaConfig:
    """The ``LlamaConfig`` of a preset (GaLore's fixed settings), optionally with another vocabulary
    or context length."""
    if preset not in PRESETS:
        raise ValueError(f"unknown Llama preset {preset!r}; choose one of {sorted(PRESETS)}")
    shape = PRESETS[preset]
    return LlamaConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        num_hidden_layers=shape.num_hidden_layers,
        vocab_size=vocab_size or shape.vocab_size,
        max_position_embeddings=max_position_embeddings or shape.max_position_embeddings,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
    )


def build_model(preset: str = "llama_60m", *, vocab_size: int | None = None,
                max_position_embeddings: int | None = None, device: torch.device | str = "cpu",
                seed: int | None = None) -> LlamaForCausalLM:
    """A freshly initialised ``LlamaForCausalLM`` of a preset, on ``device``. Weights are drawn on
    the CPU (the same ``seed`` gives the same weights on every device) from a forked RNG, so the
    caller's global RNG state is untouched."""
    config = llama_config(preset, vocab_size=vocab_size, max_position_embeddings=max_position_embeddings)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Number of parameter entries (all, or only those with ``requires_grad``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def chinchilla_rounds(num_params: int, *, clients_per_round: int, batch_size: int, seq_len: int,
                      local_steps: int, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> int:
    """Rounds that train on ~``tokens_per_param`` tokens per parameter (Chinchilla, Hoffmann et al.
    2022): ``ceil(tokens_per_param * num_params / (clients_per_round * batch_size * seq_len *
    local_steps))``, each round consuming ``batch_size * seq_len`` tokens per local step per client."""
    tokens_per_round = clients_per_round * batch_size * seq_len * local_steps
    if tokens_per_round <= 0 or num_params <= 0 or tokens_per_param <= 0:
        raise ValueError("num_params, tokens_per_param, clients_per_round, batch_size, seq_len and local_steps "
                         "must all be positive")
    return math.ceil(tokens_per_param * num_params / tokens_per_round)


def client_batches(corpus: TextCorpus, tokenizer: TextTokenizer, *, client_id: int, num_clients: int,
                   batch_size: int, seq_len: int, device: torch.device | str,
                   start_document: int = 0) -> Iterator[dict[str, Tensor]]:
    """Endless packed ``(batch_size, seq_len)`` batches from the client's shard of the corpus,
    starting at document ``start_document`` of its document sequence."""
    documents = corpus.client_documents(client_id, num_clients, start=start_document)
    return lm_batches(pack_blocks(documents, tokenizer, seq_len), batch_size, device)


def validation_batches(corpus: TextCorpus, tokenizer: TextTokenizer, *, batch_size: int, seq_len: int,
                       max_batches: int, device: torch.device | str) -> list[dict[str, Tensor]]:
    """Up to ``max_batches`` packed batches of the held-out documents (the same ones every call)."""
    blocks = pack_blocks(corpus.validation_documents(), tokenizer, seq_len)
    batches = list(itertools.islice(lm_batches(blocks, batch_size, device), max_batches))
    if not batches:
        raise ValueError(f"the held-out text is too short for one batch of {batch_size} x {seq_len} tokens")
    return batches


def shifted_logits_and_targets(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Logits at positions ``0..L-2`` (float32) and the labels ``1..L-1`` they predict."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
    return logits[:, :-1].float(), batch["labels"][:, 1:]


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """Negative log-likelihood of each target, ``(batch, positions)``; 0 where the target is
    :data:`IGNORE_INDEX`."""
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")


def loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Causal-LM loss: mean next-token NLL over the positions whose label counts."""
    logits, targets = shifted_logits_and_targets(model, batch)
    return token_nll(logits, targets).sum() / (targets != IGNORE_INDEX).sum().clamp_min(1)


@dataclass
class TokenStatistics:
    """Sums over evaluated tokens and sequences (only positions whose label counts)."""

    nll_sum: float = 0.0  # summed next-token NLL
    tokens: int = 0  # counted tokens
    correct: int = 0  # counted tokens whose arg-max prediction is the target
    sequence_mean_nll_sum: float = 0.0  # sum over sequences of their mean token NLL
    sequences: int = 0  # sequences with at least one counted token

    @property
    def mean_nll(self) -> float:
        """Token-weighted mean NLL (the loss over all counted tokens)."""
        return self.nll_sum / max(self.tokens, 1)

    @property
    def mean_sequence_nll(self) -> float:
        """Sequence-weighted mean NLL: the mean over sequences of their mean token NLL."""
        return self.sequence_mean_nll_sum / max(self.sequences, 1)

    def metrics(self) -> dict[str, float]:
        """``loss`` (token-weighted mean NLL), ``perplexity`` (exp of it) and ``token_accuracy``."""
        return {"loss": self.mean_nll, "perplexity": math.exp(self.mean_nll),
                "token_accuracy": self.correct / max(self.tokens, 1)}

    def add(self, logits: Tensor, targets: Tensor) -> None:
        """Add one batch of shifted logits and targets (:func:`shifted_logits_and_targets`)."""
        counted = targets != IGNORE_INDEX
        nll = token_nll(logits, targets)
        per_sequence = counted.sum(dim=1)
        has_tokens = per_sequence > 0
        self.nll_sum += nll.sum().item()
        self.tokens += int(counted.sum())
        self.correct += int(((logits.argmax(dim=-1) == targets) & counted).sum())
        self.sequence_mean_nll_sum += (nll.sum(dim=1)[has_tokens] / per_sequence[has_tokens]).sum().item()
        self.sequences += int(has_tokens.sum())


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (no dropout) without autograd; its previous train/eval mode is restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def token_statistics(model: nn.Module, batches: Iterable[dict[str, Tensor]]) -> TokenStatistics:
    """:class:`TokenStatistics` of ``model`` (in :func:`evaluation_mode`) over ``batches``."""
    stats = TokenStatistics()
    with evaluation_mode(model):
        for batch in batches:
            stats.add(*shifted_logits_and_targets(model, batch))
    return stats


def evaluate(model: nn.Module, batches: Iterable[dict[str, Tensor]]) -> dict[str, float]:
    """Validation ``loss`` (mean token NLL), ``perplexity`` (exp of it) and ``token_accuracy``."""
    return token_statistics(model, batches).metrics()
