"""LoRA (Hu et al. 2022) on a causal LM with ``peft``: only the adapter matrices train and travel.

:func:`build_model` loads the base model - a hub name or a local folder through
``AutoModelForCausalLM.from_pretrained``, or a :data:`~fedact_app.tasks.llama.PRESETS` name for a
randomly initialised Llama (``llama_tiny`` in tests) - freezes it, and adds LoRA adapters
``W x + (alpha / rank) * B A x`` to the ``target_modules`` (``A`` random, ``B`` zero, so the
wrapped model starts equal to the base). The seed's "scaling factor" is peft's ``lora_alpha``.

Defaults follow the seed's protocol, OpenFedLLM (Ye et al. 2024): dropout 0.05, no bias, and
peft's default Llama targets ``q_proj`` and ``v_proj`` (the attention query and value
projections); any Llama linear layer may be added (``k_proj o_proj gate_proj up_proj down_proj``).
Ranks: SFT rank 32 / alpha 64 (:data:`SFT_LORA`), DPO rank 8 / alpha 16 (:data:`DPO_LORA`).

After :func:`build_model` exactly the ``lora_A`` / ``lora_B`` weights have ``requires_grad``;
:func:`trainable_parameters` returns them by name - the tensors the optimizers update and the
federated algorithms exchange (FedACT's v-bar and Delta_G cover these only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fedact_app.compat import ensure_torchvision_ops
from fedact_app.tasks import llama
from fedact_app.tasks.hub import HubUnavailableError, unavailable_message

ensure_torchvision_ops()  # before peft/transformers import torchvision (CPU torch + CUDA torchvision)

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

LLAMA_TARGET_MODULES = ("q_proj", "v_proj")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyperparameters: rank r, scale alpha (update = alpha/r * B A), dropout on the adapter
    input, and the names of the linear modules that get adapters."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    target_modules: tuple[str, ...] = LLAMA_TARGET_MODULES


SFT_LORA = LoraSettings(rank=32, alpha=64.0)  # seed, Appendix C: FedIT on Alpaca-GPT4
DPO_LORA = LoraSettings(rank=8, alpha=16.0)  # seed, Appendix C: FedVA on HH-RLHF


def load_base_model(name_or_path: str, *, vocab_size: int | None = None, dtype: torch.dtype | None = None,
                    data_dir: str | None = None) -> nn.Module:
    """The base causal LM: a randomly initialised Llama preset (``vocab_size`` from the tokenizer;
    seed 0), or ``AutoModelForCausalLM.from_pretrained(name_or_path)`` for a hub name or local
    folder (downloads cached under ``data_dir``); in ``dtype`` when given, else float32 for a preset
    and transformers' default (the stored dtype) for a pretrained model."""
    if name_or_path in llama.PRESETS:
        model = llama.build_model(name_or_path, vocab_size=vocab_size, seed=0)
        return model if dtype is None else model.to(dtype=dtype)
    dtype_kwargs = {} if dtype is None else {"dtype": dtype}
    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path, cache_dir=data_dir, **dtype_kwargs)
    except OSError as exc:  # offline / not cached / no such repo or folder
        hint = (f"pass a local folder saved with save_pretrained (config.json + weights) as the model, or a "
                f"randomly initialised preset ({', '.join(sorted(llama.PRESETS))}) for smoke runs.")
        raise HubUnavailableError(unavailable_message("model", name_or_path, exc, hint)) from exc


def add_lora(model: nn.Module, settings: LoraSettings) -> PeftModel:
    """Freeze ``model`` and wrap it with LoRA adapters on ``settings.target_modules``."""
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def build_model(base: str, settings: LoraSettings, *, device: torch.device | str = "cpu",
                vocab_size: int | None = None, dtype: torch.dtype | None = None,
                data_dir: str | None = None) -> PeftModel:
    """The base model (:func:`load_base_model`) with LoRA adapters (:func:`add_lora`), on ``device``."""
    base_model = load_base_model(base, vocab_size=vocab_size, dtype=dtype, data_dir=data_dir)
    return add_lora(base_model, settings).to(device)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters with ``requires_grad`` by name (after :func:`build_model`: the LoRA A/B weights)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}
