"""LoRA SFT on Alpaca-format data: template, response masking, metrics, offline use. CPU."""

import itertools
import json
import math
import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before any hub import (conftest sets these too)
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from fedact_app.tasks import lora, sft  # noqa: E402
from fedact_app.tasks.text_data import IGNORE_INDEX, HubUnavailableError  # noqa: E402
from fedact_app.tasks.tokenizers import ByteTokenizer  # noqa: E402

EXAMPLES = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "hi"},
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Reverse the word.", "input": "abc", "output": "cba"},
]


def test_alpaca_prompt_with_input_is_the_stanford_template():
    assert sft.format_alpaca_prompt("Add the numbers.", "2 and 3") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:"
    )


def test_alpaca_prompt_without_input_is_the_stanford_template():
    assert sft.format_alpaca_prompt("Say hi.") == sft.format_alpaca_prompt("Say hi.", "") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
        "\n\n### Instruction:\nSay hi.\n\n### Response:"
    )


def test_labels_mask_the_prompt_and_keep_the_response_and_eos():
    tok = ByteTokenizer()
    input_ids, labels = sft.encode_example(EXAMPLES[1], tok, max_length=1000)
    prompt = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
              "request.\n\n### Instruction:\nSay hi.\n\n### Response:")
    prompt_ids = [257] + list(prompt.encode())
    assert input_ids == prompt_ids + [ord("h"), ord("i"), 258]
    assert labels == [IGNORE_INDEX] * len(prompt_ids) + [ord("h"), ord("i"), 258]
    short_ids, short_labels = sft.encode_example(EXAMPLES[1], tok, max_length=len(prompt_ids) + 1)
    assert short_ids == prompt_ids + [ord("h")] and short_labels[-1] == ord("h")
    with pytest.raises(ValueError, match="language.max_length"):  # no response token left: not silent
        sft.encode_example(EXAMPLES[1], tok, max_length=len(prompt_ids))


def test_local_alpaca_files_and_offline_hub_error(tmp_path):
    path = tmp_path / "alpaca.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in EXAMPLES))
    assert sft.load_alpaca(str(path))["output"] == ["5", "hi", "Blue.", "cba"]
    (tmp_path / "bad.json").write_text(json.dumps([{"instruction": "x", "output": "y"}]))
    with pytest.raises(ValueError, match="input"):
        sft.load_alpaca(str(tmp_path / "bad.json"))
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
    with pytest.raises(HubUnavailableError, match="'vicgalle/alpaca-gpt4'.*instruction"):
        sft.load_alpaca()


def test_client_batches_read_disjoint_shards():
    tok = ByteTokenizer()
    seen = []
    for client in range(2):
        batches = sft.client_batches(EXAMPLES, tok, client_id=client, num_clients=2, batch_size=1, max_length=512,
                                     device="cpu", seed=5)
        seen.append({tok.decode(b["input_ids"][0].tolist()) for b in itertools.islice(batches, 2)})
    assert seen[0].isdisjoint(seen[1]) and len(seen[0] | seen[1]) == 4
    batch = next(sft.client_batches(EXAMPLES, tok, client_id=0, num_clients=1, batch_size=4, max_length=512,
                                    device="cpu"))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["input_ids"].shape[0] == 4


def test_metrics_match_an_independent_computation():
    tok = ByteTokenizer()
    model = sft.build_model("llama_tiny", settings=lora.LoraSettings(rank=2))
    batches = sft.eval_batches(EXAMPLES, tok, batch_size=3, max_length=512, device="cpu")
    assert [len(b["input_ids"]) for b in batches] == [3, 1]
    metrics = sft.evaluate(model, batches)
    nll_sum, tokens, correct, example_means = 0.0, 0, 0, []
    model.eval()
    with torch.no_grad():
        for example in EXAMPLES:
            input_ids, labels = sft.encode_example(example, tok, 512)
            logits = model(input_ids=torch.tensor([input_ids])).logits[0].double()
            nlls = []
            for position in range(1, len(input_ids)):
                if labels[position] == IGNORE_INDEX:
                    continue
                row = logits[position - 1]
                log_norm = math.log(sum(math.exp(v) for v in row.tolist()))
                nlls.append(log_norm - row[labels[position]].item())
                correct += int(row.argmax().item() == labels[position])
            nll_sum, tokens = nll_sum + sum(nlls), tokens + len(nlls)
            example_means.append(sum(nlls) / len(nlls))
    assert metrics["loss"] == pytest.approx(nll_sum / tokens, rel=1e-5)
    assert metrics["perplexity"] == pytest.approx(math.exp(nll_sum / tokens), rel=1e-5)
    assert metrics["token_accuracy"] == pytest.approx(correct / tokens)
    assert metrics["response_nll"] == pytest.approx(sum(example_means) / len(example_means), rel=1e-5)


def test_lora_sft_steps_lower_the_response_loss():
    tok = ByteTokenizer()
    model = sft.build_model("llama_tiny", settings=lora.LoraSettings(rank=8, alpha=16.0, dropout=0.0))
    batches = sft.eval_batches(EXAMPLES, tok, batch_size=4, max_length=512, device="cpu")
    before = sft.evaluate(model, batches)["loss"]
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model).values(), lr=2e-2)
    for _ in range(8):
        optimizer.zero_grad()
        sft.loss(model, batches[0]).backward()
        optimizer.step()
    assert sft.evaluate(model, batches)["loss"] < before - 0.3
