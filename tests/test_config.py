"""Hydra composition of conf/ into the typed schema, and bad overrides failing with clear messages."""

import threading

import pytest
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from fedact_app.config import Config, ConfigError, compose, to_yaml


def test_default_is_a_short_fedact_run_on_digits():
    cfg = compose()
    assert isinstance(cfg, Config)
    assert (cfg.dataset.name, cfg.model.name, cfg.algorithm.name) == ("digits", "cnn_small", "fedact")
    assert cfg.algorithm.lr == 3e-4 and cfg.algorithm.betas == [0.9, 0.999]
    assert (cfg.algorithm.rho, cfg.algorithm.tau) == (0.5, 0.5)
    assert cfg.algorithm.trust_scope == "global" and cfg.algorithm.trust_signal == "corrected"


def test_overrides_string_builds_the_paper_setting():
    cfg = compose("dataset=cifar100 model=vit_tiny partition.alpha=0.1 experiment=paper_vision")
    assert cfg.dataset.hub_path == "uoft-cs/cifar100" and cfg.dataset.label_column == "fine_label"
    assert cfg.dataset.num_classes == 100
    assert cfg.model.kwargs == {"patch_size": 4, "embed_dim": 192, "depth": 6, "num_heads": 3,
                                "mlp_ratio": 4.0}
    assert (cfg.partition.name, cfg.partition.alpha) == ("dirichlet", 0.1)
    assert (cfg.num_clients, cfg.fraction_train, cfg.batch_size, cfg.local_steps, cfg.num_rounds) == (
        100, 0.1, 50, 50, 300)


def test_algorithm_group_and_keys():
    cfg = compose(["algorithm=fedadamw", "algorithm.tau=0.3", "algorithm.trust_scope=tensor"])
    assert cfg.algorithm.name == "fedadamw" and cfg.algorithm.trust_signal == "none"
    assert cfg.algorithm.tau == 0.3 and cfg.algorithm.trust_scope == "tensor"


def test_threads_compose_at_the_same_time():
    """Hydra's composition goes through one process-wide object: four threads composing at once
    (as study.py's jobs do) each get their own config, none finds it taken."""
    start, errors, seeds = threading.Barrier(4), [], []

    def compose_five(seed):
        start.wait()
        for _ in range(5):
            try:
                seeds.append(compose(f"seed={seed}").seed)
            except Exception as err:  # noqa: BLE001 - every failure is collected and shown
                errors.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=compose_five, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:2]
    assert sorted(seeds) == [seed for seed in range(4) for _ in range(5)]


def test_resolved_yaml_round_trips():
    cfg = compose("algorithm.rho=0.25")
    assert "rho: 0.25" in to_yaml(cfg)


@pytest.mark.parametrize("override, needle", [
    ("dataset=imagenet21k", "imagenet21k"),
    ("algorithm=sgd_magic", "sgd_magic"),
    ("num_rounds=abc", "num_rounds"),
])
def test_unknown_options_and_types_fail_naming_them(override, needle):
    with pytest.raises((HydraException, OmegaConfBaseException)) as err:
        compose([override])
    assert needle in str(err.value)


@pytest.mark.parametrize("override, key, allowed", [
    ("no_such_key=1", "no_such_key", "local_steps, max_empty_rounds"),
    ("algorithm.no_such=1", "algorithm.no_such", "lr, lr_min"),
    ("algorithm.no_such.deeper=1", "algorithm.no_such", "lr, lr_min"),
    ("model.lora.rnk=4", "model.lora.rnk", "alpha, dropout, rank, target_modules"),
])
def test_unknown_keys_fail_naming_the_key_and_the_keys_allowed_there(override, key, allowed):
    """Not Hydra's "To append to your config use +KEY=...": the schema refuses such a key."""
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert f"Unknown config key {key}: allowed keys there: " in str(err.value) and allowed in str(err.value)
    assert "+" not in str(err.value)


@pytest.mark.parametrize("override, hint", [
    ("model.kwargs.depth=2", r"use \+model.kwargs.depth=2"),  # a free-form dict: '+' is right there
    ("hydra.no_such=1", r"Could not override 'hydra.no_such'"),  # Hydra's own keys
    ("model@x=vit_tiny", r"Did you mean to override model\?"),  # a group override
])
def test_keys_outside_the_schema_keep_hydras_message(override, hint):
    with pytest.raises(HydraException, match=hint):
        compose([override])


def test_a_new_key_of_a_free_form_dict_composes_with_plus():
    assert compose(["model=vit_tiny", "model.kwargs.depth=2"]).model.kwargs["depth"] == 2
    assert compose(["+model.kwargs.depth=2"]).model.kwargs["depth"] == 2


@pytest.mark.parametrize("override, key, allowed", [
    ("+algorithm.lrr=1", "algorithm.lrr", "lr, lr_min"),
    ("+no_such_key=1", "no_such_key", "local_steps"),
    ("+diagnostics.every=3", "diagnostics.every", "top_p, trust_every"),
])
def test_keys_added_with_plus_fail_instead_of_being_dropped(override, key, allowed):
    """Hydra adds a key given as '+key=value' to the typed config; it must fail too, naming the
    key and the keys allowed there, not vanish from the run."""
    with pytest.raises(ConfigError) as err:
        compose([override])
    assert f"Unknown config key {key}: allowed keys there: " in str(err.value) and allowed in str(err.value)
    assert "(added with '+'? the run would ignore it)" in str(err.value)
    assert compose(["model.kwargs.width=8"]).model.kwargs["width"] == 8  # a free-form dict stays open


@pytest.mark.parametrize("dataset", ["digits", "synthetic"])
def test_a_data_path_for_a_built_in_dataset_fails(dataset):
    """digits and synthetic read no files: a dataset.path would be ignored, so it is refused."""
    with pytest.raises(ConfigError, match=f"dataset.path='/data/mine'.*null for dataset={dataset}.*cifar10"):
        compose([f"dataset={dataset}", "dataset.path=/data/mine"])
    assert compose("dataset=cifar10 dataset.path=/data/mine").dataset.path == "/data/mine"


@pytest.mark.parametrize("override, key", [
    ("algorithm.tau=0", "algorithm.tau"),
    ("algorithm.tau=1.5", "algorithm.tau"),
    ("algorithm.rho=-0.1", "algorithm.rho"),
    ("algorithm.rho=1.1", "algorithm.rho"),
    ("algorithm.gamma=-1", "algorithm.gamma"),
    ("algorithm.alpha=0.1", "algorithm.alpha"),  # alpha < gamma (= tau = 0.5)
    ("algorithm.lr=0", "algorithm.lr"),
    ("algorithm.betas=[0.9,1.0]", "algorithm.betas"),
    ("algorithm.trust_scope=layer", "algorithm.trust_scope"),
    ("algorithm.trust_signal=magic", "algorithm.trust_signal"),
    ("partition.alpha=0", "partition.alpha"),
    ("fraction_train=0", "fraction_train"),
    ("num_clients=0", "num_clients"),
    ("local_steps=0", "local_steps"),
    ("device=tpu", "device"),
    ("model.name=alexnet", "model.name"),
])
def test_bad_values_fail_with_key_value_and_range(override, key):
    with pytest.raises(ConfigError) as err:
        compose([override])
    message = str(err.value)
    assert key in message and "allowed" in message


def test_holdout_fraction_is_a_vision_fraction_off_by_default():
    assert compose().dataset.holdout_fraction == 0.0
    assert compose("dataset.holdout_fraction=0.1").dataset.holdout_fraction == 0.1
    for value in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match="dataset.holdout_fraction"):
            compose(f"dataset.holdout_fraction={value}")
    with pytest.raises(ConfigError, match="dataset.holdout_fraction.*task=lm_pretrain"):
        compose("task=lm_pretrain dataset=text dataset.path=/x.txt model=llama_tiny dataset.holdout_fraction=0.1")


@pytest.mark.parametrize(("overrides", "message"), [
    ("client_batch=true algorithm=fedavg", "client_batch=True: allowed false for algorithm=fedavg.*FedACT family"),
    ("client_batch=true task=lm_pretrain dataset=text dataset.path=/x.txt model=llama_tiny", "false for task=lm_pretrain"),
    ("client_batch=true channels_last=true", "false with channels_last=true"),
    ("client_batch_wait=0", "client_batch_wait=0.0: allowed > 0"),
    ("client_batch=true client_batch_wait=100 round_timeout=60",
     r"client_batch_wait=100.0: allowed <= round_timeout \(60\) with client_batch=true"),
    ("client_batch=true debug.fail_partitions=[0] debug.fail_rounds=[1] debug.hang_seconds=5",
     "false with debug.hang_seconds > 0"),
])
def test_client_batch_is_refused_where_the_clients_cannot_train_at_once(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(overrides)
    assert compose("client_batch=true algorithm=fedadamw").client_batch
