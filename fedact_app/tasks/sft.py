"""Supervised fine-tuning (instruction tuning) with LoRA on Alpaca-GPT4 in the Alpaca template.

Data: ``vicgalle/alpaca-gpt4`` (one ``train`` split; columns ``instruction``, ``input``,
``output``) or local ``.json``/``.jsonl``/``.parquet``/``.csv`` files with those columns
(:func:`load_alpaca`). Every ``round(1/eval_fraction)``-th example is held out for evaluation
(:func:`~fedact_app.tasks.text_data.split_records`); training example ``i`` goes to client
``i mod N``.

Format (Stanford Alpaca, ``tatsu-lab/stanford_alpaca`` ``train.py``): the prompt is
:data:`ALPACA_PROMPT_WITH_INPUT` when ``input`` is non-empty, else :data:`ALPACA_PROMPT_NO_INPUT`;
the response ``output`` follows ``### Response:`` directly and ends with the end-of-sequence token.
Token ids are ``[bos] + encode(prompt) + encode(output) + [eos]``, prompt and response encoded
separately so the prompt/response boundary is exact; the labels are ``IGNORE_INDEX`` on the
prompt, so the loss counts response tokens only (including ``eos``). Sequences longer than
``max_length`` are cut on the right (as Stanford Alpaca).

Metrics (:func:`evaluate`, over the response tokens of held-out examples): ``loss`` = mean NLL
over all response tokens (token-weighted, the training objective), ``perplexity`` = exp(loss),
``token_accuracy`` = fraction of response tokens whose arg-max prediction is the target,
``response_nll`` = mean over examples of each response's mean token NLL (every example weighs the
same, however long its response).
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import datasets
import torch
from torch import Tensor, nn

from fedact_app.tasks import lora
from fedact_app.tasks.llama import loss, token_statistics  # noqa: F401 - the SFT loss is the causal-LM loss
from fedact_app.tasks.text_data import (IGNORE_INDEX, batched, client_items, load_records, pad_sequences,
                                        require_columns)
from fedact_app.tasks.tokenizers import TextTokenizer

ALPACA_HUB_ID = "vicgalle/alpaca-gpt4"
ALPACA_COLUMNS = ("instruction", "input", "output")
DEFAULT_BASE_MODEL = "meta-llama/Llama-2-7b-hf"  # seed: Llama2-7B for FedIT
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


def load_alpaca(path: str | None = None, *, data_dir: str | None = None) -> datasets.Dataset:
    """Alpaca-GPT4 from the hub, or local files with columns ``instruction``, ``input``, ``output``."""
    hint = ("pass local files instead (path=... a .json/.jsonl/.parquet/.csv file or a folder of them) with "
            f"columns {list(ALPACA_COLUMNS)}.")
    dataset = load_records(path, hub_id=ALPACA_HUB_ID, split="train", data_dir=data_dir, local_hint=hint)
    require_columns(dataset, ALPACA_COLUMNS, path or ALPACA_HUB_ID)
    return dataset


def format_alpaca_prompt(instruction: str, input: str = "") -> str:  # noqa: A002 - Alpaca's column name
    """The Stanford Alpaca prompt: with the ``### Input:`` section only when ``input`` is non-empty."""
    if input:
        return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def encode_example(example: Mapping[str, str], tokenizer: TextTokenizer,
                   max_length: int) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one Alpaca example: labels are ``IGNORE_INDEX`` on the prompt tokens
    and the token ids on the response tokens; both cut to ``max_length``. A prompt that leaves no
    response token within ``max_length`` is an error (it would train on nothing, silently)."""
    prompt = format_alpaca_prompt(example["instruction"], example.get("input") or "")
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompt_ids = bos + tokenizer.encode(prompt)
    if len(prompt_ids) >= max_length:
        raise ValueError(f"An Alpaca prompt of {len(prompt_ids)} tokens leaves no response token within "
                         f"language.max_length={max_length}: raise language.max_length")
    response_ids = tokenizer.encode(example["output"]) + [tokenizer.eos_id]
    input_ids = prompt_ids + response_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids
    return input_ids[:max_length], labels[:max_length]


def collate(examples: Sequence[Mapping[str, str]], tokenizer: TextTokenizer, max_length: int,
            device: torch.device | str) -> dict[str, Tensor]:
    """A padded batch (``input_ids``, ``labels``, ``attention_mask``) of Alpaca examples."""
    return pad_sequences([encode_example(e, tokenizer, max_length) for e in examples], tokenizer.pad_id, device)


def client_batches(examples: Sequence[Mapping[str, str]], tokenizer: TextTokenizer, *, client_id: int,
                   num_clients: int, batch_size: int, max_length: int, device: torch.device | str,
                   seed: int = 0, start_example: int = 0) -> Iterator[dict[str, Tensor]]:
    """Endless batches from the client's shard of ``examples`` (epochs reshuffled by ``seed``),
    from example ``start_example`` of its sequence on."""
    shard = client_items(examples, client_id, num_clients, seed=seed, start=start_example)
    return (collate(batch, tokenizer, max_length, device) for batch in batched(shard, batch_size))


def eval_batches(examples: Sequence[Mapping[str, str]], tokenizer: TextTokenizer, *, batch_size: int,
                 max_length: int, device: torch.device | str) -> list[dict[str, Tensor]]:
    """Batches of all ``examples`` in order (the last one may be smaller)."""
    return [collate(batch, tokenizer, max_length, device)
            for batch in batched(examples, batch_size, drop_last=False)]


def build_model(base: str = DEFAULT_BASE_MODEL, *, settings: lora.LoraSettings = lora.SFT_LORA,
                device: torch.device | str = "cpu", **base_kwargs) -> nn.Module:
    """The base causal LM with LoRA adapters (seed: rank 32, scale 64); see :func:`lora.build_model`."""
    return lora.build_model(base, settings, device=device, **base_kwargs)


def evaluate(model: nn.Module, batches: Sequence[dict[str, Tensor]]) -> dict[str, float]:
    """``loss``, ``perplexity``, ``token_accuracy`` and ``response_nll`` over the response tokens."""
    stats = token_statistics(model, batches)
    return {**stats.metrics(), "response_nll": stats.mean_sequence_nll}
