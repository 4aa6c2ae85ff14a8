"""The automatic GPU share of a simulated client (fedact_app.cli.resources) and where the launcher,
sweeps, studies and tuning apply it, with the GPU count mocked: these machines have none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedact_app.cli import launch, resources
from fedact_app.config import compose

REPO_ROOT = Path(__file__).resolve().parents[1]
PAPER = "experiment=paper_vision"  # 100 clients, 10 % a round: 10 train at once


@pytest.fixture
def machine(monkeypatch):
    """``machine(gpus, cpus)``: what visible_gpus and machine_cpus report from now on."""

    def set_machine(gpus: int, cpus: int = 16) -> None:
        monkeypatch.setattr(resources, "visible_gpus", lambda: gpus)
        monkeypatch.setattr(resources, "machine_cpus", lambda: cpus)

    return set_machine


@pytest.mark.parametrize(("device", "at_once", "gpus", "share"), [
    ("auto", 10, 1, 0.1),       # the seed's round on one GPU
    ("auto", 3, 1, 0.3333),     # rounded down: three shares fit in one GPU
    ("cuda", 4, 2, 0.5),
    ("auto", 1, 2, 1.0),        # one client never gets more than one GPU
    ("cpu", 10, 1, 0.0),
    ("auto", 10, 0, 0.0),
])
def test_the_share_is_the_gpus_over_the_clients_at_once(device, at_once, gpus, share):
    assert resources.gpu_share(device, at_once, gpus) == share
    assert resources.gpu_share(device, at_once, gpus) * at_once <= max(gpus, 0)


@pytest.mark.parametrize(("overrides", "num_cpus", "cpus", "expected"), [
    (PAPER, 1, 16, 10),                                        # 10 sampled, 16 CPUs
    (PAPER, 1, 4, 4),                                          # the CPUs hold 4
    (PAPER, 2, 16, 8),                                         # 2 CPUs each: 8
    ("num_clients=10 fraction_train=0.5 min_train_nodes=2", 1, 16, 5),
    ("num_clients=10 fraction_train=0.1 min_train_nodes=3", 1, 16, 3),  # the minimum wins
    (PAPER, 32, 16, 1),                                        # never fewer than one
])
def test_clients_at_once_are_the_sampled_ones_the_cpus_hold(overrides, num_cpus, cpus, expected):
    assert resources.clients_at_once(compose(overrides), num_cpus, cpus) == expected


def test_the_rule_on_a_mocked_gpu_machine(machine):
    machine(gpus=1, cpus=16)
    assert resources.client_gpus(compose(PAPER), 1, None) == 0.1
    assert resources.client_gpus(compose(PAPER), 1, None, runs_at_once=2) == 0.05
    assert resources.client_gpus(compose(f"{PAPER} device=cpu"), 1, None) == 0.0
    assert resources.client_gpus(compose(PAPER), 1, 0.0) == 0.0  # --num-gpus 0: the CPU
    assert resources.client_gpus(compose(PAPER), 1, 0.25) == 0.25
    assert resources.client_gpus(None, 1, None) == 0.0  # another app: nothing assumed
    machine(gpus=0)
    assert resources.client_gpus(compose(PAPER), 1, None) == 0.0
    with pytest.raises(ValueError, match="device=cuda but this machine shows no GPU"):
        resources.client_gpus(compose("device=cuda"), 1, None)
    with pytest.raises(ValueError, match=r"--num-gpus -0.5: allowed a number >= 0"):
        resources.client_gpus(compose(PAPER), 1, -0.5)


@pytest.mark.parametrize("hidden", ["", "-1"])
def test_hidden_gpus_are_none_without_importing_torch(hidden):
    code = ("import sys; from fedact_app.cli.resources import visible_gpus; "
            "assert visible_gpus() == 0, visible_gpus(); assert 'torch' not in sys.modules, 'torch imported'")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": hidden}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_launcher_gives_clients_the_share_and_says_so(machine, monkeypatch, capsys):
    calls = []

    def fake_run(*args, **kwargs):
        calls.append(kwargs)
        raise launch.LaunchError("no run here")

    monkeypatch.setattr(launch, "run_simulation", fake_run)
    machine(gpus=1, cpus=16)
    assert launch.main(["--app", str(REPO_ROOT), "--overrides", PAPER]) == 2
    assert calls[-1]["num_gpus_per_client"] == 0.1 and calls[-1]["num_supernodes"] == 100
    assert "each client gets 0.1 GPU (automatic" in capsys.readouterr().out
    assert launch.main(["--app", str(REPO_ROOT), "--overrides", PAPER, "--num-gpus", "0"]) == 2
    assert calls[-1]["num_gpus_per_client"] == 0.0
    machine(gpus=0)
    assert launch.main(["--app", str(REPO_ROOT), "--overrides", "device=cuda"]) == 2
    assert len(calls) == 2
    assert "config error: device=cuda but this machine shows no GPU" in capsys.readouterr().err


def test_run_simulation_picks_the_share_from_its_overrides(machine):
    machine(gpus=1, cpus=16)
    assert launch.automatic_gpus(REPO_ROOT, PAPER, 1) == 0.1
    assert launch.automatic_gpus(REPO_ROOT, "algorithm.lr=abc", 1) == 0.0  # the run reports the error
    assert launch.automatic_gpus(REPO_ROOT, "num_clients=4 fraction_train=1.0 min_train_nodes=4", 1) == 0.25
    machine(gpus=0)
    assert launch.automatic_gpus(REPO_ROOT, PAPER, 1) == 0.0


@pytest.mark.parametrize(("argv", "share"), [
    ([], 0.5),                           # 2 clients a round (TINY) on one GPU
    (["--max-parallel", "2"], 0.25),     # two runs at once share it too
    (["--num-gpus", "0"], 0.0),
])
def test_sweep_jobs_get_the_share(machine, fake_engine, monkeypatch, tmp_path, argv, share):
    import sweep  # (fake_engine put scripts/ on the path)

    seen = []

    def fake_run(app_dir, overrides, num_supernodes, **kwargs):
        seen.append(kwargs["num_gpus_per_client"])
        raise RuntimeError("no run here")

    fake_engine(fake_run)
    machine(gpus=1, cpus=16)
    monkeypatch.setattr(sweep, "SWEEP_DIRS", set())
    sweep.cli(["num_clients=2", "fraction_train=1.0", "min_train_nodes=2", *argv, f"hydra.run.dir={tmp_path}",
               "hydra/job_logging=none", "hydra/hydra_logging=none"])
    assert seen == [share]


def test_sweeps_refuse_a_negative_gpu_share(fake_engine, capsys):
    import sweep  # (fake_engine put scripts/ on the path)

    with pytest.raises(SystemExit):
        sweep.parse_launch_options(["--num-gpus", "-1", "seed=1"])
    assert "--num-gpus must be >= 0 (GPUs per client), got -1.0" in capsys.readouterr().err


def test_client_batch_gives_every_sampled_client_a_clientapp(machine):
    """With client_batch the ClientApps only hold their messages for the machine's batching worker:
    Ray counts enough CPUs for one each, and the GPU share is over all of them."""
    batched = f"{PAPER} client_batch=true"
    assert resources.clients_at_once(compose(batched), 1, 4) == 10
    assert resources.ray_cpus(compose(batched), 1, 4) == 10
    assert resources.ray_cpus(compose(batched), 2, 4) == 20
    assert resources.ray_cpus(compose(batched), 1, 16) == 16
    assert resources.ray_cpus(compose(PAPER), 1, 4) == 4
    machine(gpus=1, cpus=4)
    assert resources.client_gpus(compose(batched), 1, None) == 0.1
    assert launch.batching_federation(REPO_ROOT, batched, 1) == {"init-args-num-cpus": 10}
    assert launch.batching_federation(REPO_ROOT, PAPER, 1) == {}
    assert launch.batching_federation(REPO_ROOT, "client_batch=true algorithm=fedavg", 1) == {}  # the run says why
