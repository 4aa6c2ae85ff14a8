"""LoRA DPO on HH-RLHF-format pairs: parsing, Vicuna template, loss and metrics, reference. CPU, offline."""

import json
import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before any hub import (conftest sets these too)
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from fedact_app.tasks import dpo, lora  # noqa: E402
from fedact_app.tasks.text_data import IGNORE_INDEX, HubUnavailableError  # noqa: E402
from fedact_app.tasks.tokenizers import ByteTokenizer  # noqa: E402

PREFIX = "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: What is the capital of France?"
CHOSEN = PREFIX + "\n\nAssistant: The capital of France is Paris."
REJECTED = PREFIX + "\n\nAssistant: I don't know."
SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the user's questions.")


def test_hh_pair_splits_off_the_last_assistant_turn():
    pair = dpo.parse_hh_pair(CHOSEN, REJECTED)
    assert pair.turns == (("USER", "Hi there"), ("ASSISTANT", "Hello! How can I help?"),
                          ("USER", "What is the capital of France?"))
    assert pair.chosen == " The capital of France is Paris."
    assert pair.rejected == " I don't know."


def test_vicuna_prompt_of_a_hand_made_hh_pair():
    pair = dpo.parse_hh_pair(CHOSEN, REJECTED)
    prompt = dpo.format_vicuna_prompt(pair.turns)
    assert prompt == (SYSTEM + " USER: Hi there ASSISTANT: Hello! How can I help?</s>"
                      "USER: What is the capital of France? ASSISTANT:")
    assert prompt + pair.chosen == (SYSTEM + " USER: Hi there ASSISTANT: Hello! How can I help?</s>"
                                    "USER: What is the capital of France? ASSISTANT: The capital of France is Paris.")


def test_pairs_with_different_prompts_are_left_out():
    other = "\n\nHuman: Something else?\n\nAssistant: No."
    rows = [{"chosen": CHOSEN, "rejected": REJECTED}, {"chosen": CHOSEN, "rejected": other},
            {"chosen": "no turns at all", "rejected": "none"}]
    assert dpo.preference_pairs(rows) == [dpo.parse_hh_pair(CHOSEN, REJECTED)]
    with pytest.raises(ValueError, match="differ"):
        dpo.parse_hh_pair(CHOSEN, other)


def test_encode_pair_masks_the_shared_prompt():
    tok = ByteTokenizer()
    pair = dpo.parse_hh_pair(CHOSEN, REJECTED)
    (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = dpo.encode_pair(pair, tok, 1000, 500)
    prompt_ids = [257] + list(dpo.format_vicuna_prompt(pair.turns).encode())
    assert chosen_ids == prompt_ids + list(b" The capital of France is Paris.") + [258]
    assert chosen_labels == [IGNORE_INDEX] * len(prompt_ids) + chosen_ids[len(prompt_ids):]
    assert rejected_ids == prompt_ids + list(b" I don't know.") + [258]
    assert rejected_labels[len(prompt_ids):] == list(b" I don't know.") + [258]
    # too long: the prompt keeps its last 20 tokens (after bos), the responses are cut to fit 40
    (short_ids, short_labels), _ = dpo.encode_pair(pair, tok, max_length=40, max_prompt_length=20)
    assert short_ids == [257] + prompt_ids[-20:] + list(b" The capital of France is Paris.")[:19]
    assert short_labels.count(IGNORE_INDEX) == 21


def test_dpo_loss_and_metrics_against_an_independent_computation():
    beta = 0.25
    # hand-made summed log-probabilities per pair: policy chosen, policy rejected, ref chosen, ref rejected
    pairs = [(-10.0, -12.0, -11.0, -11.5), (-8.0, -7.0, -8.5, -6.0), (-20.0, -20.0, -20.0, -20.0),
             (-3.0, -9.0, -4.0, -5.0)]
    losses, accuracies, margins, gaps = [], [], [], []
    for pc, pr, rc, rr in pairs:
        reward_chosen, reward_rejected = beta * (pc - rc), beta * (pr - rr)
        losses.append(-math.log(1.0 / (1.0 + math.exp(-(reward_chosen - reward_rejected)))))
        accuracies.append(1.0 if reward_chosen > reward_rejected else 0.0)
        margins.append(reward_chosen - reward_rejected)
        gaps.append(pc - pr)
    columns = [torch.tensor(column, dtype=torch.float64) for column in zip(*pairs)]
    metrics = dpo.dpo_metrics(*columns, beta=beta)
    assert metrics["loss"] == pytest.approx(sum(losses) / 4, rel=1e-12)
    assert metrics["preference_accuracy"] == pytest.approx(sum(accuracies) / 4)  # ties (pair 3) count as wrong
    assert metrics["reward_margin"] == pytest.approx(sum(margins) / 4, rel=1e-12)
    assert metrics["policy_gap"] == pytest.approx(sum(gaps) / 4, rel=1e-12)
    per_pair_losses = dpo.dpo_terms(*columns, beta=beta)[0]
    assert per_pair_losses.tolist() == pytest.approx(losses, rel=1e-12)


def _model_and_batch():
    tok = ByteTokenizer()
    model = dpo.build_model("llama_tiny", settings=lora.LoraSettings(rank=4, alpha=8.0, dropout=0.0))
    pairs = [dpo.parse_hh_pair(CHOSEN, REJECTED),
             dpo.parse_hh_pair("\n\nHuman: 2+2?\n\nAssistant: 4", "\n\nHuman: 2+2?\n\nAssistant: 5, maybe")]
    return tok, model, pairs, dpo.eval_batches(pairs, tok, batch_size=2, max_length=512, max_prompt_length=256,
                                               device="cpu")


def test_sequence_log_probs_sum_response_tokens_and_reference_is_the_base():
    tok, model, pairs, (batch,) = _model_and_batch()
    assert batch["input_ids"].shape[0] == 4  # 2 chosen, then 2 rejected
    (ids, labels), _ = dpo.encode_pair(pairs[0], tok, 512, 256)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    expected = sum(log_probs[t - 1, labels[t]].item() for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX)
    assert dpo.sequence_log_probs(model, batch)[0].item() == pytest.approx(expected, rel=1e-5)
    # LoRA B starts at zero: policy = reference, so the DPO loss is log 2 and the rewards are 0
    metrics = dpo.evaluate(model, [batch])
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["reward_margin"] == pytest.approx(0, abs=1e-6)
    reference = dpo.reference_log_probs(model, batch)
    assert metrics["policy_gap"] == pytest.approx((reference[:2] - reference[2:]).mean().item(), rel=1e-5)


def test_dpo_steps_move_the_policy_not_the_reference():
    _, model, _, (batch,) = _model_and_batch()
    reference_before = dpo.reference_log_probs(model, batch)
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model).values(), lr=1e-2)
    for _ in range(5):
        optimizer.zero_grad()
        dpo.loss(model, batch).backward()
        optimizer.step()
    assert model.training  # the reference pass restores training mode
    metrics = dpo.evaluate(model, [batch])
    assert metrics["loss"] < math.log(2) and metrics["reward_margin"] > 0
    assert metrics["preference_accuracy"] == 1.0
    assert torch.allclose(dpo.reference_log_probs(model, batch), reference_before)


def test_local_hh_files_and_offline_hub_error(tmp_path):
    rows = [{"chosen": CHOSEN, "rejected": REJECTED}] * 3
    (tmp_path / "hh-test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    data = dpo.load_hh_rlhf(str(tmp_path / "hh-{split}.jsonl"), split="test")
    assert len(dpo.preference_pairs(data)) == 3
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    with pytest.raises(HubUnavailableError, match="'Anthropic/hh-rlhf'.*chosen"):
        dpo.load_hh_rlhf(split="train")
