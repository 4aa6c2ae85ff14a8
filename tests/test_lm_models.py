"""Llama presets, the Chinchilla budget, pre-training on local text, and LoRA wrapping: offline, CPU."""

import itertools
import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"  # before any hub import (conftest sets these too)
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from fedact_app.tasks import llama, lora  # noqa: E402
from fedact_app.tasks.text_data import HubUnavailableError, load_corpus  # noqa: E402
from fedact_app.tasks.tokenizers import ByteTokenizer  # noqa: E402

STDLIB = os.path.dirname(os.__file__)


@pytest.mark.parametrize("preset, shape, params", [
    # GaLore configs/llama_*.json: hidden, intermediate, heads, layers; vocabulary 32000, untied embeddings
    ("llama_60m", (512, 1376, 8, 8), 58_073_600),
    ("llama_130m", (768, 2048, 12, 12), 134_105_856),
    ("llama_250m", (768, 2560, 16, 24), 247_370_496),
])
def test_presets_match_galore_configs(preset, shape, params):
    config = llama.llama_config(preset)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads,
            config.num_hidden_layers) == shape
    assert (config.vocab_size, config.max_position_embeddings, config.tie_word_embeddings) == (32000, 1024, False)
    with torch.device("meta"):  # shapes only, no memory
        model = llama.LlamaForCausalLM(config)
    assert llama.count_parameters(model) == params


def test_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match="llama_60m"):
        llama.llama_config("llama_7b")


def test_chinchilla_rounds_on_literal_numbers():
    # 20 tokens/param * 58,073,600 params / (4 clients * 64 * 1024 tokens * 50 steps) = 88.6 -> 89
    assert llama.chinchilla_rounds(58_073_600, clients_per_round=4, batch_size=64, seq_len=1024, local_steps=50) == 89
    assert llama.chinchilla_rounds(1000, clients_per_round=2, batch_size=5, seq_len=10, local_steps=2) == 100
    assert llama.chinchilla_rounds(1000, clients_per_round=2, batch_size=5, seq_len=10, local_steps=2,
                                   tokens_per_param=0.5) == 3  # 500 tokens / 200 per round
    with pytest.raises(ValueError):
        llama.chinchilla_rounds(1000, clients_per_round=0, batch_size=5, seq_len=10, local_steps=2)


def test_build_model_is_seeded_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = llama.build_model("llama_tiny", seed=7)
    assert torch.equal(torch.rand(1), expected_next)
    second = llama.build_model("llama_tiny", seed=7)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
    assert llama.build_model("llama_tiny", vocab_size=300).lm_head.out_features == 300


def test_tiny_llama_validation_perplexity_falls_on_local_text(tmp_path):
    for name in ("textwrap.py", "string.py", "heapq.py", "bisect.py", "fnmatch.py", "shlex.py"):
        shutil.copy(os.path.join(STDLIB, name), tmp_path / f"{name}.txt")
    corpus = load_corpus(str(tmp_path), validation_fraction=0.1)
    tok = ByteTokenizer()
    model = llama.build_model("llama_tiny", seed=0)
    validation = llama.validation_batches(corpus, tok, batch_size=8, seq_len=64, max_batches=2, device="cpu")
    before = llama.evaluate(model, validation)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01)
    batches = llama.client_batches(corpus, tok, client_id=0, num_clients=2, batch_size=4, seq_len=64, device="cpu")
    for batch in itertools.islice(batches, 30):
        optimizer.zero_grad()
        llama.loss(model, batch).backward()
        optimizer.step()
    after = llama.evaluate(model, validation)
    assert before["perplexity"] > 200  # about uniform over 259 byte ids at initialisation
    assert after["perplexity"] < 0.5 * before["perplexity"]
    assert after["token_accuracy"] > before["token_accuracy"]
    assert after["loss"] == pytest.approx(torch.log(torch.tensor(after["perplexity"])).item(), rel=1e-6)


def test_loss_matches_an_independent_next_token_computation():
    model = llama.build_model("llama_tiny", seed=1)
    input_ids = torch.tensor([[257, 10, 20, 30, 258]])
    labels = torch.tensor([[-100, -100, 20, 30, 258]])  # predict only tokens 2..4
    log_probs = torch.log_softmax(model(input_ids=input_ids).logits[0].double(), dim=-1)
    expected = -(log_probs[1, 20] + log_probs[2, 30] + log_probs[3, 258]) / 3
    computed = llama.loss(model, {"input_ids": input_ids, "labels": labels})
    assert computed.item() == pytest.approx(expected.item(), rel=1e-5)


def test_lora_trains_only_adapters_and_leaves_the_base_unchanged():
    model = lora.build_model("llama_tiny", lora.LoraSettings(rank=4, alpha=8.0, dropout=0.0))
    trainable = lora.trainable_parameters(model)
    assert len(trainable) == 2 * 2 * 2  # layers x (q_proj, v_proj) x (A, B)
    assert all(("lora_A" in name or "lora_B" in name) for name in trainable)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    assert llama.count_parameters(model, trainable_only=True) == 2 * 2 * (4 * 64 + 64 * 4)
    batch = {"input_ids": torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"]
    base_logits = _base_logits(model, batch)
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2, weight_decay=0.01)
    llama.loss(model, batch).backward()
    optimizer.step()
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if not p.requires_grad)
    assert any(not torch.all(p == 0) for name, p in trainable.items() if "lora_B" in name)  # B moved off zero
    assert torch.equal(_base_logits(model, batch), base_logits)  # the reference (adapters off) is untouched


def _base_logits(model, batch):
    with torch.no_grad(), model.disable_adapter():
        return model(input_ids=batch["input_ids"]).logits


def test_lora_targets_are_configurable():
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = lora.build_model("llama_tiny", lora.LoraSettings(rank=2, target_modules=targets))
    assert len(lora.trainable_parameters(model)) == 2 * 7 * 2


def test_hub_model_offline_fails_fast_naming_alternatives():
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(HubUnavailableError) as err:
        lora.build_model("meta-llama/Llama-2-7b-hf", lora.SFT_LORA)
    assert "'meta-llama/Llama-2-7b-hf'" in str(err.value) and "llama_tiny" in str(err.value)


def test_lora_loads_a_local_pretrained_folder(tmp_path):
    llama.build_model("llama_tiny", seed=3).save_pretrained(tmp_path / "base")
    model = lora.build_model(str(tmp_path / "base"), lora.DPO_LORA)
    assert len(lora.trainable_parameters(model)) == 8
