"""Direct preference optimisation (Rafailov et al. 2023) with LoRA on HH-RLHF in the Vicuna template.

Data: ``Anthropic/hh-rlhf`` (splits ``train`` and ``test``; columns ``chosen`` and ``rejected``,
each a whole dialogue ``"\\n\\nHuman: ... \\n\\nAssistant: ..."``) or local files with those
columns (:func:`load_hh_rlhf`). :func:`parse_hh_pair` splits both dialogues at their last
``"\\n\\nAssistant:"``: the part before it must be the same in both (the shared prompt, parsed into
turns), the parts after it are the chosen and the rejected response, kept verbatim (they start with
the space that follows the colon, as OpenFedLLM's ``split_hh`` keeps it).

Format (FastChat ``vicuna_v1.1``): ``"<system> USER: <msg> ASSISTANT: <msg></s>USER: <msg>
ASSISTANT:"`` with :data:`VICUNA_SYSTEM`; the response follows ``ASSISTANT:`` and ends with the
end-of-sequence token. Sequences are ``[bos] + encode(prompt) + encode(response) + [eos]``, labels
``IGNORE_INDEX`` on the prompt; when prompt + longer response exceed ``max_length`` the prompt keeps
its last ``max_prompt_length`` tokens and the responses are cut to fit (as TRL's DPO trainer).
A batch of ``B`` pairs holds the ``B`` chosen sequences, then the ``B`` rejected ones.

Loss and metrics, with ``pi`` / ``ref`` the log-probability of a response (summed over its tokens,
given the prompt) under the policy (base + LoRA) and the frozen reference (the same model under
``model.disable_adapter()``, i.e. the base), and implicit reward ``r = beta * (pi - ref)``:

- ``loss`` = mean over pairs of ``-log sigmoid(r_chosen - r_rejected)``;
- ``preference_accuracy`` = fraction of pairs with ``r_chosen > r_rejected`` (ties count as wrong);
- ``reward_margin`` = mean of ``r_chosen - r_rejected``;
- ``policy_gap`` = mean of ``pi_chosen - pi_rejected``: how much more likely the policy itself
  makes the chosen than the rejected response, no reference involved (nonzero for the base model).
  So ``reward_margin = beta * (policy_gap - reference gap)``, which the seed's Table (base gap
  0.1182, reward margins 0.0113 ... 0.0064 at beta 0.1) satisfies to its last digit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import datasets
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedact_app.tasks import lora
from fedact_app.tasks.llama import evaluation_mode, shifted_logits_and_targets, token_nll
from fedact_app.tasks.text_data import (IGNORE_INDEX, batched, client_items, load_records, pad_sequences,
                                        require_columns)
from fedact_app.tasks.tokenizers import TextTokenizer

HH_RLHF_HUB_ID = "Anthropic/hh-rlhf"
HH_COLUMNS = ("chosen", "rejected")
HH_HUMAN, HH_ASSISTANT = "\n\nHuman:", "\n\nAssistant:"
DEFAULT_BASE_MODEL = "QuixiAI/Wizard-Vicuna-7B-Uncensored"  # seed: the FedVA base model
DEFAULT_BETA = 0.1
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
USER, ASSISTANT = "USER", "ASSISTANT"
VICUNA_TURN_END = {USER: " ", ASSISTANT: "</s>"}  # FastChat ADD_COLON_TWO: sep " ", sep2 "</s>"
HH_ROLES = {"Human": USER, "Assistant": ASSISTANT}
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ?")


@dataclass(frozen=True)
class PreferencePair:
    """A dialogue so far (``(role, message)`` turns, roles :data:`USER`/:data:`ASSISTANT`) and the
    preferred and the dispreferred next assistant response."""

    turns: tuple[tuple[str, str], ...]
    chosen: str
    rejected: str


def load_hh_rlhf(path: str | None = None, *, split: str = "train", data_dir: str | None = None) -> datasets.Dataset:
    """HH-RLHF's ``split`` from the hub, or local files with columns ``chosen`` and ``rejected``."""
    hint = ("pass local files instead (path=... a .json/.jsonl/.parquet/.csv file or folder; '{split}' in the "
            f"path is replaced by train/test) with columns {list(HH_COLUMNS)}.")
    dataset = load_records(path, hub_id=HH_RLHF_HUB_ID, split=split, data_dir=data_dir, local_hint=hint)
    require_columns(dataset, HH_COLUMNS, path or HH_RLHF_HUB_ID)
    return dataset


def split_last_assistant_turn(dialogue: str) -> tuple[str, str]:
    """(everything before the last ``"\\n\\nAssistant:"``, the response after it, verbatim)."""
    cut = dialogue.rfind(HH_ASSISTANT)
    if cut < 0:
        raise ValueError(f"no {HH_ASSISTANT!r} turn in dialogue {dialogue[:80]!r}")
    return dialogue[:cut], dialogue[cut + len(HH_ASSISTANT):]


def parse_hh_turns(prefix: str) -> tuple[tuple[str, str], ...]:
    """``(role, message)`` turns of ``"\\n\\nHuman: a\\n\\nAssistant: b..."`` (messages stripped)."""
    parts = _HH_TURN.split(prefix)
    if parts[0].strip() or len(parts) < 3:
        raise ValueError(f"dialogue does not start with a {HH_HUMAN!r} turn: {prefix[:80]!r}")
    return tuple((HH_ROLES[role], message.strip()) for role, message in zip(parts[1::2], parts[2::2]))


def parse_hh_pair(chosen: str, rejected: str) -> PreferencePair:
    """The shared prompt turns and the two final assistant responses of an HH-RLHF pair."""
    (prompt, chosen_response), (other_prompt, rejected_response) = map(split_last_assistant_turn, (chosen, rejected))
    if prompt != other_prompt:
        raise ValueError("chosen and rejected dialogues differ before their last assistant turn")
    return PreferencePair(parse_hh_turns(prompt), chosen_response, rejected_response)


def preference_pairs(dataset: Iterable[dict[str, str]]) -> list[PreferencePair]:
    """Parsed pairs of HH-RLHF rows; rows that do not parse (no shared prompt) are left out."""
    pairs = []
    for row in dataset:
        try:
            pairs.append(parse_hh_pair(row["chosen"], row["rejected"]))
        except ValueError:
            continue
    return pairs


def format_vicuna_prompt(turns: Sequence[tuple[str, str]], system: str = VICUNA_SYSTEM) -> str:
    """The Vicuna v1.1 prompt of a dialogue, ending with ``"ASSISTANT:"`` for the next response."""
    history = "".join(f"{role}: {message}{VICUNA_TURN_END[role]}" for role, message in turns)
    return f"{system} {history}{ASSISTANT}:"


def encode_pair(pair: PreferencePair, tokenizer: TextTokenizer, max_length: int,
                max_prompt_length: int) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """(input ids, labels) of the chosen and of the rejected sequence; labels ``IGNORE_INDEX`` on
    the (shared) prompt tokens."""
    if not 0 < max_prompt_length < max_length:
        raise ValueError(f"need 0 < max_prompt_length < max_length, got {max_prompt_length} and {max_length}")
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompt_ids = tokenizer.encode(format_vicuna_prompt(pair.turns))
    responses = [tokenizer.encode(response) + [tokenizer.eos_id] for response in (pair.chosen, pair.rejected)]
    if len(bos) + len(prompt_ids) + max(map(len, responses)) > max_length:
        prompt_ids = prompt_ids[-max_prompt_length:]
    prompt_ids = bos + prompt_ids
    responses = [response[:max_length - len(prompt_ids)] for response in responses]
    chosen, rejected = ((prompt_ids + r, [IGNORE_INDEX] * len(prompt_ids) + r) for r in responses)
    return chosen, rejected


def collate(pairs: Sequence[PreferencePair], tokenizer: TextTokenizer, max_length: int,
            max_prompt_length: int, device: torch.device | str) -> dict[str, Tensor]:
    """A padded batch of ``2B`` sequences: the ``B`` chosen, then the ``B`` rejected."""
    encoded = [encode_pair(pair, tokenizer, max_length, max_prompt_length) for pair in pairs]
    return pad_sequences([chosen for chosen, _ in encoded] + [rejected for _, rejected in encoded],
                         tokenizer.pad_id, device)


def client_batches(pairs: Sequence[PreferencePair], tokenizer: TextTokenizer, *, client_id: int,
                   num_clients: int, batch_size: int, max_length: int, max_prompt_length: int,
                   device: torch.device | str, seed: int = 0, start_pair: int = 0) -> Iterator[dict[str, Tensor]]:
    """Endless batches of ``batch_size`` pairs from the client's shard (epochs reshuffled by
    ``seed``), from pair ``start_pair`` of its sequence on."""
    shard = client_items(pairs, client_id, num_clients, seed=seed, start=start_pair)
    return (collate(batch, tokenizer, max_length, max_prompt_length, device) for batch in batched(shard, batch_size))


def eval_batches(pairs: Sequence[PreferencePair], tokenizer: TextTokenizer, *, batch_size: int, max_length: int,
                 max_prompt_length: int, device: torch.device | str) -> list[dict[str, Tensor]]:
    """Batches of all ``pairs`` in order (the last one may be smaller)."""
    return [collate(batch, tokenizer, max_length, max_prompt_length, device)
            for batch in batched(pairs, batch_size, drop_last=False)]


def build_model(base: str = DEFAULT_BASE_MODEL, *, settings: lora.LoraSettings = lora.DPO_LORA,
                device: torch.device | str = "cpu", **base_kwargs) -> nn.Module:
    """The base causal LM with LoRA adapters (seed: rank 8, scale 16); see :func:`lora.build_model`."""
    return lora.build_model(base, settings, device=device, **base_kwargs)


def sequence_log_probs(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Log-probability of each sequence's labelled (response) tokens given what precedes them,
    summed over the tokens: shape ``(2B,)``."""
    return -token_nll(*shifted_logits_and_targets(model, batch)).sum(dim=1)


def reference_log_probs(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """:func:`sequence_log_probs` under the frozen reference: the base model, LoRA adapters disabled
    (``peft``'s ``disable_adapter()``), in eval mode without gradients."""
    with evaluation_mode(model), model.disable_adapter():
        return sequence_log_probs(model, batch)


def dpo_terms(policy_chosen: Tensor, policy_rejected: Tensor, reference_chosen: Tensor,
              reference_rejected: Tensor, beta: float = DEFAULT_BETA) -> tuple[Tensor, Tensor, Tensor]:
    """Per pair: (DPO loss ``-log sigmoid(r_c - r_r)``, chosen reward ``r_c``, rejected reward
    ``r_r``) with implicit rewards ``r = beta * (policy - reference)`` log-probabilities."""
    chosen_rewards = beta * (policy_chosen - reference_chosen)
    rejected_rewards = beta * (policy_rejected - reference_rejected)
    return -F.logsigmoid(chosen_rewards - rejected_rewards), chosen_rewards, rejected_rewards


def dpo_metrics(policy_chosen: Tensor, policy_rejected: Tensor, reference_chosen: Tensor,
                reference_rejected: Tensor, beta: float = DEFAULT_BETA) -> dict[str, float]:
    """``loss``, ``preference_accuracy``, ``reward_margin`` and ``policy_gap`` (means over pairs;
    see the module docstring) of per-pair summed log-probabilities."""
    losses, chosen_rewards, rejected_rewards = dpo_terms(policy_chosen, policy_rejected, reference_chosen,
                                                         reference_rejected, beta)
    return {"loss": losses.mean().item(),
            "preference_accuracy": (chosen_rewards > rejected_rewards).float().mean().item(),
            "reward_margin": (chosen_rewards - rejected_rewards).mean().item(),
            "policy_gap": (policy_chosen - policy_rejected).mean().item()}


def loss(model: nn.Module, batch: dict[str, Tensor], beta: float = DEFAULT_BETA) -> Tensor:
    """Mean DPO loss of a batch (``2B`` sequences: chosen then rejected); gradients reach the
    policy (the trainable LoRA tensors) only."""
    policy = sequence_log_probs(model, batch).chunk(2)
    reference = reference_log_probs(model, batch).chunk(2)
    return dpo_terms(*policy, *reference, beta)[0].mean()


def evaluate(model: nn.Module, batches: Iterable[dict[str, Tensor]], beta: float = DEFAULT_BETA) -> dict[str, float]:
    """:func:`dpo_metrics` over all pairs of ``batches`` (policy in eval mode, no gradients)."""
    columns = []  # per batch (B, 4): policy chosen, policy rejected, reference chosen, reference rejected
    for batch in batches:
        with evaluation_mode(model):
            policy = sequence_log_probs(model, batch)
        reference = reference_log_probs(model, batch)
        columns.append(torch.stack([*policy.chunk(2), *reference.chunk(2)], dim=1))
    return dpo_metrics(*torch.cat(columns).unbind(dim=1), beta=beta)
