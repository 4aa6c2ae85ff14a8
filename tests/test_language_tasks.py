"""The language tasks as Tasks (fedact_app/tasks/language.py): seeded models, shared tensors, a
real ClientTrainer round per task, the config's task/dataset/model combinations. Offline, tiny."""

import json
import logging
import math
import warnings

import pytest
import torch
from flwr.app import Context, RecordDict

from fedact_app.client_work import node_data
from fedact_app.client_trainer import ClientTrainer, trainer_for
from fedact_app.config import ConfigError, compose
from fedact_app.results import main_metric_summary
from fedact_app.tasks.base import build_task

TINY = "num_clients=2 min_train_nodes=2 batch_size=4 local_steps=3 device=cpu language.eval_batches=2"
LORA = "model=lora_causal_lm model.base=llama_tiny model.lora.rank=4 model.lora.alpha=8"


def write_data(root):
    """Local text, Alpaca-style records and HH-RLHF-style pairs (made up)."""
    (root / "text").mkdir()
    documents = [f"Document {i}: " + " ".join(f"word{j % 7}" for j in range(i, i + 40)) for i in range(40)]
    (root / "text" / "corpus.txt").write_text("\n\n".join(documents))
    with (root / "alpaca.jsonl").open("w") as f:
        for i in range(40):
            f.write(json.dumps({"instruction": f"Add {i} and 1.", "input": "" if i % 2 else f"n={i}",
                                "output": f"The sum is {i + 1}."}) + "\n")
    with (root / "hh.jsonl").open("w") as f:
        for i in range(40):
            prompt = f"\n\nHuman: What is {i} plus one?"
            f.write(json.dumps({"chosen": f"{prompt}\n\nAssistant: It is {i + 1}.",
                                "rejected": f"{prompt}\n\nAssistant: No idea."}) + "\n")


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    write_data(root)
    return {
        "lm_pretrain": f"task=lm_pretrain model=llama_tiny dataset=text dataset.path={root / 'text'} "
                       f"language.seq_len=32 {TINY}",
        "sft": f"task=sft {LORA} dataset=alpaca_gpt4 dataset.path={root / 'alpaca.jsonl'} "
               f"dataset.validation_fraction=0.2 language.max_length=256 {TINY}",
        "dpo": f"task=dpo {LORA} dataset=hh_rlhf dataset.path={root / 'hh.jsonl'} dataset.validation_fraction=0.2 "
               f"language.max_length=256 language.max_prompt_length=200 {TINY}",
    }


@pytest.mark.parametrize("task", ["lm_pretrain", "sft", "dpo"])
def test_build_model_is_deterministic_from_the_seed(task, overrides):
    task_obj = build_task(compose(overrides[task]))
    torch.manual_seed(123)
    first = task_obj.build_model().state_dict()
    torch.manual_seed(456)  # the caller's RNG state does not matter
    second = task_obj.build_model().state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = build_task(compose(f"{overrides[task]} seed=7")).build_model().state_dict()
    assert any(not torch.equal(first[k], other[k]) for k in first)


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_lora_tasks_share_exactly_the_adapter_tensors(task, overrides):
    task_obj = build_task(compose(overrides[task]))
    model = task_obj.build_model()
    shared = task_obj.shared_names(model)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert shared and set(shared) == set(trainable)
    assert all(("lora_A" in n or "lora_B" in n) for n in shared)
    # 2 layers x (q_proj, v_proj) x (A: 4 x 64, B: 64 x 4)
    assert sum(trainable[n].numel() for n in shared) == 2 * 2 * (4 * 64 + 64 * 4)
    assert len(model.state_dict()) > len(shared)


def test_pretraining_shares_the_whole_state(overrides):
    task_obj = build_task(compose(overrides["lm_pretrain"]))
    model = task_obj.build_model()
    assert task_obj.shared_names(model) == list(model.state_dict())


@pytest.mark.parametrize("algorithm", ["fedact", "fedavg"])
@pytest.mark.parametrize("task", ["lm_pretrain", "sft", "dpo"])
def test_a_client_round_returns_a_delta_over_the_shared_names(task, algorithm, overrides):
    trainer = ClientTrainer(compose(f"{overrides[task]} algorithm={algorithm}"))
    trainer.task.check_data()
    state = {n: t.detach().clone() for n, t in trainer.model.state_dict().items() if n in trainer.shared}
    result = trainer.train_round(state, {}, partition_id=1, num_partitions=2, server_round=1, lr=1e-3,
                                 local_steps=3, global_step=0)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert set(result.update.delta) == trainer.shared
    assert math.isfinite(result.loss) and result.loss > 0
    assert result.update.num_examples == 3 * 4
    if algorithm == "fedact":
        assert set(result.update.arrays["v"]) == trainable
    assert any(d.abs().sum() > 0 for d in result.update.delta.values())
    metrics, n = trainer.evaluate_local(state, partition_id=1, num_partitions=2)
    assert n > 0 and all(k.startswith("test_") and math.isfinite(v) for k, v in metrics.items())
    expected = {"lm_pretrain": {"test_loss", "test_perplexity", "test_token_accuracy"},
                "sft": {"test_loss", "test_perplexity", "test_token_accuracy", "test_response_nll"},
                "dpo": {"test_loss", "test_preference_accuracy", "test_reward_margin", "test_policy_gap"}}[task]
    assert set(trainer.task.evaluate(trainer.model, trainer.device)) == expected


def test_dpo_starts_at_log_2(overrides):
    task_obj = build_task(compose(overrides["dpo"]))
    metrics = task_obj.evaluate(task_obj.build_model(), torch.device("cpu"))
    assert metrics["test_loss"] == pytest.approx(math.log(2), abs=1e-5)  # B = 0: policy = reference


@pytest.mark.parametrize("bad, key", [
    ("task=lm_pretrain", "dataset.name"),  # digits with a language task
    ("task=lm_pretrain dataset=text dataset.path=/x", "model.name"),  # cnn_small
    ("dataset=c4", "dataset.name"),  # a language dataset with task=vision
    ("model=llama_tiny", "model.name"),
    ("task=sft dataset=alpaca_gpt4 model=llama_tiny", "model.name"),
    ("task=dpo dataset=c4 model=lora_causal_lm", "dataset.name"),
    ("task=lm_pretrain dataset=text model=llama_tiny", "dataset.path"),
    ("task=dpo dataset=hh_rlhf model=lora_causal_lm language.max_length=64", "language.max_prompt_length"),
    ("model.lora.rank=0", "model.lora.rank"),
    ("task=sft dataset=alpaca_gpt4 model=lora_causal_lm model.base=null", "model.base"),
])
def test_bad_task_combinations_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        compose(bad)
    if key in ("dataset.name", "model.name"):
        assert "task=" in str(err.value) and "task=vision" in str(err.value)


def test_too_few_documents_for_the_clients_is_a_config_error(overrides):
    with pytest.raises(ConfigError, match="num_clients"):
        build_task(compose(overrides["sft"].replace("num_clients=2 min_train_nodes=2", "num_clients=40"))).check_data()


def test_experiment_presets_carry_the_seed_defaults():
    pre = compose("experiment=lm_pretrain_c4")
    assert (pre.task, pre.dataset.name, pre.model.name, pre.num_clients, pre.fraction_train, pre.batch_size,
            pre.language.seq_len, pre.local_steps) == ("lm_pretrain", "c4", "llama_60m", 20, 0.2, 64, 1024, 50)
    assert (pre.algorithm.lr, pre.algorithm.betas, pre.algorithm.weight_decay) == (3e-4, [0.9, 0.99], 0.01)
    sft = compose("experiment=sft_alpaca")
    assert (sft.model.lora.rank, sft.model.lora.alpha, sft.algorithm.lr, sft.algorithm.lr_min) == (32, 64, 5e-5, 1e-6)
    assert (sft.num_clients, sft.fraction_train, sft.num_rounds, sft.batch_size, sft.local_steps) == (20, 0.1, 200, 16, 10)
    dpo = compose("experiment=dpo_hh")
    assert (dpo.model.lora.rank, dpo.model.lora.alpha, dpo.algorithm.lr, dpo.algorithm.lr_min) == (8, 16, 5e-4, 1e-5)
    assert (dpo.num_clients, dpo.fraction_train, dpo.num_rounds, dpo.batch_size, dpo.local_steps) == (5, 0.4, 200, 16, 10)


def test_summary_reports_the_language_main_metric():
    rows = [{"round": 0, "test_perplexity": 9.0}, {"round": 1, "test_perplexity": 5.0},
            {"round": 2, "test_perplexity": 6.0}]
    assert main_metric_summary(rows) == {"initial_test_perplexity": 9.0, "final_test_perplexity": 6.0,
                                         "best_test_perplexity": 5.0}
    rows = [{"round": 0, "test_preference_accuracy": 0.0, "test_perplexity": 3.0},
            {"round": 1, "test_preference_accuracy": 0.5}]
    assert main_metric_summary(rows)["best_test_preference_accuracy"] == 0.5
    assert main_metric_summary([{"round": 0, "test_accuracy": 0.1}]) == {}


def test_a_streamed_corpus_continues_at_a_position_derived_from_the_round(overrides):
    """C4 is a stream: round r starts at document (r - 1) K B ceil(seq_len / 512) of the client's part."""
    import datasets

    from fedact_app.train import batch_generator
    from fedact_app.tasks.text_data import StreamCorpus

    documents = [f"document number {i:04d} " * 3 for i in range(400)]
    stream = datasets.Dataset.from_dict({"text": documents}).to_iterable_dataset()
    task_obj = build_task(compose(overrides["lm_pretrain"]))
    task_obj._corpus = StreamCorpus(stream, stream)
    tokenizer = task_obj.tokenizer

    def first_block(server_round):
        generator = batch_generator(42, server_round, 0)
        batch = task_obj.train_batches(0, 2, server_round, torch.device("cpu"), generator).next_batch()
        return tokenizer.decode(batch["input_ids"][0].tolist())

    per_round = 3 * 4 * 1  # K x B x ceil(32 / 512)
    assert "number 0000" in first_block(1)
    assert f"number {2 * per_round:04d}" in first_block(2)  # client 0 of 2 keeps every other document
    assert first_block(2) == first_block(2)  # a function of the round only


def test_a_supernode_serves_its_own_text_through_data_path(overrides, tmp_path, caplog):
    """node-config data-path with a language dataset: the node trains on its own files (all of
    them, one partition of one) and logs what it holds."""
    write_data(tmp_path)  # this node's own files, not the run's
    own = tmp_path / "text"
    context = Context(run_id=1, node_id=1, node_config={"data-path": str(own)}, state=RecordDict(),
                      run_config={})
    cfg = compose(overrides["lm_pretrain"])
    assert node_data(context, cfg) == (0, 1, str(own))
    with caplog.at_level(logging.INFO, logger="flwr"):
        trainer = trainer_for(overrides["lm_pretrain"], str(own))
    assert trainer.cfg.dataset.path == str(own)
    documents = len(trainer.task.corpus.train)
    assert f"data-path={own}, {documents} training documents" in caplog.text
    state = {n: t.clone() for n, t in trainer.model.state_dict().items()}
    result = trainer.train_round(state, {}, partition_id=0, num_partitions=1, server_round=1, lr=1e-3,
                                 local_steps=2, global_step=0)
    assert set(result.update.delta) == set(state) and math.isfinite(result.loss)


def test_an_unused_partition_setting_is_warned_about_not_ignored_silently(overrides):
    with pytest.warns(UserWarning, match="partition=dirichlet does not apply to task=lm_pretrain"):
        build_task(compose(overrides["lm_pretrain"])).check_data()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_task(compose(f"{overrides['lm_pretrain']} partition=iid")).check_data()
