"""Checkpoints: atomic writes, rotation, round trips of everything a run needs to continue, the
server rules' state, the clients' kept state and the resume checks."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fedact_app.algorithms import ALGORITHMS, ClientUpdate
from fedact_app.checkpoint import (Checkpoint, CheckpointError, Checkpointer, Resume, atomic_write, capture_rng,
                                   check_compatible, client_round_config, list_checkpoints, load_checkpoint,
                                   open_resume, persist_client_state, resolve_resume, restore_rng,
                                   restored_client_state, save_checkpoint)
from fedact_app.config import ConfigError, compose, to_yaml

TRAINABLE = ["w", "b"]
X = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1.0, -1.0]), "bn.n": torch.tensor(4)}


def checkpoint(server_round=2, cfg=None, clients=None) -> Checkpoint:
    return Checkpoint(
        round=server_round, model={n: t + server_round for n, t in X.items()},
        rule={"v_bar": {"w": torch.full((2, 3), 0.5), "b": torch.zeros(2)},
              "delta_g": {"w": -torch.ones(2, 3), "b": torch.tensor([0.25, 3.0])}},
        rng=capture_rng(), empty_rounds=1, config=to_yaml(cfg or compose()),
        rows=[{"round": 0, "test_accuracy": 0.1}, {"round": 1, "train_loss": float("nan")}],
        clients=clients or {})


def same_arrays(a: dict, b: dict) -> bool:
    """Nested dicts of tensors with equal keys, dtypes and values."""
    return a.keys() == b.keys() and all(
        same_arrays(a[k], b[k]) if isinstance(a[k], dict) else
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def assert_same_arrays(a: dict, b: dict) -> None:
    assert same_arrays(a, b)


def test_checkpoint_round_trip(tmp_path):
    c_i = {"c_i": {"w": torch.randn(2, 3), "b": torch.randn(2)}}
    saved = checkpoint(clients={"0": c_i})
    save_checkpoint(tmp_path / "c.safetensors", saved)
    loaded = load_checkpoint(tmp_path / "c.safetensors")
    assert (loaded.round, loaded.empty_rounds, loaded.config) == (2, 1, saved.config)
    assert loaded.rows[0] == saved.rows[0] and np.isnan(loaded.rows[1]["train_loss"])
    assert_same_arrays(loaded.model, saved.model)
    assert_same_arrays(loaded.rule, saved.rule)
    assert_same_arrays(loaded.clients, saved.clients)
    assert loaded.rng["python"] == saved.rng["python"]


def rewrite(path: Path, edit_meta=None, edit_tensors=None) -> None:
    """Write ``path`` again, its "fedact" metadata and tensors changed by the edit functions, as
    another writer (an older FedACT, another tool) would have written it."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["fedact"])
    tensors = load_file(str(path))
    save_file((edit_tensors or (lambda t: t))(tensors),
              str(path), metadata={"fedact": json.dumps((edit_meta or (lambda m: m))(meta))})


def test_checkpoints_hold_no_node_sampler_state_and_older_ones_with_one_still_load(tmp_path):
    """Node sampling is derived from (seed, round), so nothing of it is saved; a checkpoint of an
    older FedACT holds the sampler's random.Random state, which loading ignores."""
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, checkpoint())
    with safe_open(str(path), framework="pt") as f:
        assert set(json.loads(f.metadata()["fedact"])["rng"]) == {"python", "numpy"}
    assert set(load_checkpoint(path).rng) == {"python", "numpy", "torch"}

    rewrite(path, edit_meta=lambda m: {**m, "rng": {**m["rng"], "sampler": m["rng"]["python"]}})
    older = load_checkpoint(path)
    assert set(older.rng) == {"python", "numpy", "torch"} and older.round == 2
    restore_rng(older.rng)


def test_rng_states_restore_the_same_draws(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(4)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's legacy state
    save_checkpoint(tmp_path / "c.safetensors",
                    Checkpoint(1, dict(X), {}, capture_rng(), 0, to_yaml(compose()), []))

    def draws():
        return (random.sample(range(100), 5), random.random(), np.random.standard_normal(3).tolist(),
                torch.rand(3).tolist())

    first = draws()
    restore_rng(load_checkpoint(tmp_path / "c.safetensors").rng)
    assert draws() == first


def test_a_write_that_fails_after_the_temp_file_exists_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "round-00002.safetensors"
    save_checkpoint(path, checkpoint())
    before = path.read_bytes()

    def crash(tmp: Path) -> None:
        tmp.write_bytes(before[: len(before) // 2])  # a torn file under the temporary name
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, crash)
    assert path.read_bytes() == before and load_checkpoint(path).round == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary file left


@pytest.mark.parametrize("every, expected", [(0, [5]), (2, [2, 4, 5]), (1, [1, 2, 3, 4, 5])])
def test_checkpoints_are_due_every_n_rounds_and_at_the_end(tmp_path, every, expected):
    cfg = compose([f"checkpoint_every={every}", "num_rounds=5"])
    checkpointer = Checkpointer(tmp_path, cfg)
    assert [r for r in range(1, 6) if checkpointer.due(r)] == expected


def test_rotation_keeps_the_newest(tmp_path):
    checkpointer = Checkpointer(tmp_path, compose(["keep_checkpoints=2", "checkpoint_every=1"]))
    for r in range(1, 5):
        checkpointer.write(checkpoint(r))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round-00003.safetensors", "round-00004.safetensors"]
    assert resolve_resume(str(tmp_path)) == tmp_path / "checkpoints" / "round-00004.safetensors"


def test_client_state_goes_through_the_checkpoint_to_a_resumed_client(tmp_path):
    """A client writes its kept state; the checkpoint collects it over the restored clients' state;
    a client of a resumed run reads back its own partition's state and nothing else."""
    restored = {"1": {"c_i": {"w": torch.ones(2, 3), "b": torch.ones(2)}}}
    checkpointer = Checkpointer(tmp_path, compose(), restored)
    mine = {"c_i": {"w": torch.randn(2, 3), "b": torch.randn(2)}}
    persist_client_state(client_round_config(checkpointer, None), 0, mine)
    path = checkpointer.write(checkpoint(3))
    config = client_round_config(checkpointer, Resume(path, load_checkpoint(path)))
    assert_same_arrays(restored_client_state(config, 0), mine)
    assert_same_arrays(restored_client_state(config, 1), restored["1"])
    assert restored_client_state(config, 5) == {}  # never trained: starts from zero
    assert restored_client_state(client_round_config(checkpointer, None), 0) == {}  # not resuming


def test_a_diverged_clients_state_file_is_skipped_and_the_checkpoint_written(tmp_path, caplog):
    """A client whose kept state went NaN (its reply rejected) cannot stop the run's checkpoints:
    its file is skipped with a warning and the partition keeps its restored state."""
    import logging

    restored = {"1": {"c_i": {"w": torch.ones(2, 3), "b": torch.ones(2)}}}
    checkpointer = Checkpointer(tmp_path, compose(), restored)
    config = client_round_config(checkpointer, None)
    persist_client_state(config, 0, {"c_i": {"w": torch.randn(2, 3), "b": torch.randn(2)}})
    persist_client_state(config, 1, {"c_i": {"w": torch.full((2, 3), float("nan")), "b": torch.zeros(2)}})
    with caplog.at_level(logging.WARNING, logger="flwr"):
        path = checkpointer.write(checkpoint(3))
    assert "partition 1 keeps its older state" in caplog.text
    assert_same_arrays(load_checkpoint(path).clients["1"], restored["1"])
    assert set(load_checkpoint(path).clients) == {"0", "1"}


def updates(seed: int, num: int = 2) -> list[ClientUpdate]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        delta = {n: torch.randn(t.shape, generator=g) if t.is_floating_point() else torch.tensor(i) for n, t in X.items()}
        arrays = {key: {n: torch.rand(X[n].shape, generator=g) for n in TRAINABLE} for key in ("v", "delta_c")}
        out.append(ClientUpdate(delta=delta, num_steps=3, lr_sum=0.3, num_examples=10 + i, arrays=arrays))
    return out


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_server_rule_state_dict_round_trip_continues_identically(name):
    """Rule A aggregates rounds 1 and 2; rule B, new, loads A's state after round 1 and aggregates
    round 2: both give the same model and state. A new rule without the state differs wherever the
    method keeps state, so the state_dict carries everything that matters."""
    cfg = compose([f"algorithm={name}"]).algorithm
    make = lambda: ALGORITHMS[name].server(cfg, TRAINABLE, num_clients=4)  # noqa: E731
    a = make()
    x1 = a.aggregate(X, updates(1))
    state = a.state_dict()
    assert set(state) == set(a.state_keys) and all(set(s) == set(TRAINABLE) for s in state.values())
    b = make()
    b.load_state_dict({k: {n: t.clone() for n, t in v.items()} for k, v in state.items()})
    assert_same_arrays(b.broadcast(), a.broadcast())  # round 2's clients receive the same arrays
    x2a, x2b = a.aggregate(x1, updates(2)), b.aggregate(x1, updates(2))
    assert_same_arrays(x2a, x2b)
    assert_same_arrays(a.state_dict(), b.state_dict())
    if a.state_keys:  # without the state, round 2 would go differently
        fresh = make()
        sent = fresh.broadcast()
        assert not (same_arrays(sent, b.broadcast()) and same_arrays(fresh.aggregate(x1, updates(2)), x2a)
                    and same_arrays(fresh.state_dict(), a.state_dict()))


def test_load_state_dict_rejects_foreign_state():
    rule = ALGORITHMS["fedact"].server(compose().algorithm, TRAINABLE)
    with pytest.raises(ValueError, match="keeps"):
        rule.load_state_dict({"m": {"w": torch.zeros(2, 3), "b": torch.zeros(2)}})
    with pytest.raises(ValueError, match="trainable"):
        rule.load_state_dict({"v_bar": {"w": torch.zeros(2, 3)}})


def test_resume_must_match_the_checkpointed_run(tmp_path):
    cfg = compose(["num_rounds=4"])
    save_checkpoint(tmp_path / "c.safetensors", checkpoint(2, cfg))
    ckpt = load_checkpoint(tmp_path / "c.safetensors")
    check_compatible(ckpt, compose(["num_rounds=6", "output_dir=/elsewhere", "checkpoint_every=3"]), tmp_path)
    check_compatible(ckpt, compose(["num_rounds=6", "algorithm.compile=true", "algorithm.fused=false"]),
                     tmp_path)  # speed only
    with pytest.raises(ConfigError, match=r"seed: checkpoint 42, now 7"):
        check_compatible(ckpt, compose(["num_rounds=4", "seed=7"]), tmp_path)
    with pytest.raises(ConfigError, match=r"these differ: algorithm.rho: checkpoint 0.5, now 0.25$"):
        check_compatible(ckpt, compose(["num_rounds=4", "algorithm.rho=0.25"]), tmp_path)
    with pytest.raises(ConfigError, match=r"num_rounds=2: allowed > 2"):
        check_compatible(ckpt, compose(["num_rounds=2"]), tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_resume(str(tmp_path / "nope.safetensors"))
    with pytest.raises(ConfigError, match="holds none"):
        resolve_resume(str(tmp_path))


def data_offset(path: Path, name: str) -> int:
    """Where tensor ``name``'s bytes start in the safetensors file ``path`` (8-byte header length,
    JSON header, then the data, each tensor at its ``data_offsets``)."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    return 8 + header_len + json.loads(raw[8:8 + header_len])[name]["data_offsets"][0]


def refused(path: Path, match: str) -> None:
    """load_checkpoint refuses ``path`` naming it and ``match``; so does a run resuming from it."""
    with pytest.raises(CheckpointError, match=match) as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)
    with pytest.raises(ConfigError, match=match) as err:
        open_resume(compose([f"resume={path}", "num_rounds=4"]))
    assert f"resume={str(path)!r}" in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("damage, match", [
    pytest.param(lambda raw: b"", "is empty", id="empty"),
    pytest.param(lambda raw: raw[: len(raw) // 2], "not a readable safetensors file",
                 id="half"),
    pytest.param(lambda raw: raw[:-1], "not a readable safetensors file.*not fully covered", id="last-byte-cut"),
    pytest.param(lambda raw: b"round 2, model w = [1, 2, 3]\n" * 4, "not a readable safetensors file",
                 id="text"),
])
def test_an_empty_truncated_or_foreign_file_is_refused_naming_it(tmp_path, damage, match):
    path = tmp_path / "round-00002.safetensors"
    save_checkpoint(path, checkpoint())
    path.write_bytes(damage(path.read_bytes()))
    refused(path, match)


def test_a_safetensors_file_that_is_not_a_fedact_checkpoint_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"  # e.g. a run's final model
    save_file({n: t.contiguous() for n, t in X.items()}, str(path))
    refused(path, "not a FedACT checkpoint \\(no 'fedact' metadata\\)")
    save_file(dict(X), str(path), metadata={"fedact": "{not json"})
    refused(path, "not a FedACT checkpoint \\('fedact' metadata is not a JSON object")


@pytest.mark.parametrize("edit_meta, edit_tensors, missing", [
    pytest.param(lambda m: {k: v for k, v in m.items() if k != "rows"}, None, "rows", id="rows"),
    pytest.param(lambda m: {**m, "rng": {"numpy": m["rng"]["numpy"]}}, None, "rng.python", id="rng.python"),
    pytest.param(None, lambda t: {n: v for n, v in t.items() if n != "rng/torch"}, "rng/torch", id="rng/torch"),
    pytest.param(None, lambda t: {n: v for n, v in t.items() if not n.startswith("model/")}, "model/",
                 id="model"),
])
def test_a_checkpoint_missing_an_entry_is_refused_naming_it(tmp_path, edit_meta, edit_tensors, missing):
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, checkpoint())
    rewrite(path, edit_meta, edit_tensors)
    refused(path, f"not a FedACT checkpoint \\(missing .*'{missing}'")


def test_a_checkpoint_altered_after_it_was_written_fails_its_checksum(tmp_path):
    """Bytes of the model overwritten in place (the file stays a valid safetensors file with the
    same layout), or the metadata's round changed: the checksum no longer matches."""
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, checkpoint())
    raw = bytearray(path.read_bytes())
    at = data_offset(path, "model/w")
    raw[at:at + 4] = torch.tensor([1e6]).numpy().tobytes()
    path.write_bytes(bytes(raw))
    assert load_file(str(path))["model/w"][0, 0] == 1e6  # still readable: only the checksum tells
    refused(path, "does not match its checksum")

    save_checkpoint(path, checkpoint())
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'{\\"round\\": 2,', b'{\\"round\\": 3,'))  # JSON inside the header's JSON
    assert path.read_bytes() != raw and load_file(str(path))  # same length: still a valid safetensors file
    refused(path, "does not match its checksum")


def test_a_checkpoint_without_a_checksum_from_an_older_fedact_still_loads(tmp_path):
    path = tmp_path / "c.safetensors"
    saved = checkpoint()
    save_checkpoint(path, saved)
    rewrite(path)  # the "fedact" metadata only, as FedACT wrote it before checkpoints had a checksum
    with safe_open(str(path), framework="pt") as f:
        assert set(f.metadata()) == {"fedact"}
    assert_same_arrays(load_checkpoint(path).model, saved.model)


@pytest.mark.parametrize("part, value", [("model", float("nan")), ("rule", float("inf")),
                                         ("model", -float("inf"))])
@pytest.mark.parametrize("older", [False, True])
def test_a_checkpoint_holding_non_finite_state_is_refused_naming_the_tensors(tmp_path, part, value, older):
    """A model or rule state with NaN/inf would resume a poisoned run. Its checksum matches (it was
    saved that way), so the values themselves are checked, in older checkpoints (no checksum) too."""
    path = tmp_path / "c.safetensors"
    ckpt = checkpoint()
    if part == "model":
        ckpt.model["w"] = torch.tensor([[0.0, value, 1.0], [2.0, 3.0, 4.0]])
    else:
        ckpt.rule["v_bar"]["b"] = torch.tensor([value, 0.0])
    save_checkpoint(path, ckpt)
    if older:
        rewrite(path)
    name = "model/w" if part == "model" else "rule/v_bar/b"
    refused(path, f"non-finite values \\(NaN or inf\\) in \\[{name!r}\\]")


def test_a_state_holding_non_finite_values_is_not_checkpointed_and_the_older_checkpoints_stay(tmp_path):
    checkpointer = Checkpointer(tmp_path, compose(["keep_checkpoints=1", "checkpoint_every=1"]))
    good = checkpointer.write(checkpoint(1))
    diverged = checkpoint(2)
    diverged.rule["delta_g"]["w"] = torch.full((2, 3), float("nan"))
    with pytest.raises(RuntimeError, match=r"Round 2's state holds non-finite values \(NaN or inf\) in "
                                           r"\['rule/delta_g/w'\]: no checkpoint written"):
        checkpointer.write(diverged)
    assert list_checkpoints(tmp_path) == [good]


def test_snapshot_and_restore_go_through_the_strategys_state_dict(tmp_path):
    """A strategy's model, rule state (v_bar, Delta_G) and empty-round count survive a checkpoint
    file into a fresh strategy, through ``state_dict``/``load_state_dict`` only."""
    from fedact_app.checkpoint import restore, snapshot
    from fedact_app.strategy import AlgorithmStrategy

    cfg = compose()

    def strategy():
        return AlgorithmStrategy(ALGORITHMS["fedact"].server(cfg.algorithm, TRAINABLE), trainable=TRAINABLE,
                                 local_steps=2, lr_schedule=lambda r: 0.1, fraction_train=1.0, min_train_nodes=1)

    before = strategy()
    before.load_state_dict({"model": X, "rule": checkpoint().rule, "empty_rounds": 2})
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, snapshot(before, 5, [{"round": 0}], cfg))
    after = strategy()
    restore(after, load_checkpoint(path))
    assert same_arrays(after.state_dict()["model"], X) and after.empty_rounds == 2
    assert same_arrays(after.state_dict()["rule"], before.state_dict()["rule"])
