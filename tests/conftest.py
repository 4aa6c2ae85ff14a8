"""Test setup: no network on CI, so every hub and Flower network feature is switched off here."""

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import fedact_app.train

# Bound before any app module imports resolve_device by name (they all take this one).
_resolve_device = fedact_app.train.resolve_device
_CURRENT_TEST: list[pytest.Item] = []


def _pinned_resolve_device(device: str, *args, **kwargs):
    """``resolve_device`` that fails a test resolving ``device=auto`` in this process unless it
    is marked ``any_device``: on a machine with a GPU, auto is CUDA, and a test comparing with a
    CPU computation would then fail there only. Tests pin ``device=cpu`` (or ask for cuda)."""
    item = _CURRENT_TEST[-1] if _CURRENT_TEST else None
    if device == "auto" and item is not None and item.get_closest_marker("any_device") is None:
        pytest.fail(f"{item.nodeid} resolves device=auto, which is CUDA on a GPU machine: pin device=cpu "
                    "in its config (or mark it any_device when it holds on every device)", pytrace=False)
    return _resolve_device(device, *args, **kwargs)


fedact_app.train.resolve_device = _pinned_resolve_device

from fedact_app.cli.engine import LocalEngine  # noqa: E402

for _key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "FLWR_DISABLE_UPDATE_CHECK"):
    os.environ[_key] = "1"
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
# torch.compile in the tests (and in the processes they start) compiles in-process: inductor's
# pool of compile workers (one per core) has been reported to keep a process from exiting for
# minutes after a cold compile (pytorch/pytorch#162199).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Partitions drawn by the tests (and by the Flower runs they start) go to a folder of this
# session, not to ~/.cache/fedact.
os.environ["FEDACT_CACHE_DIR"] = tempfile.mkdtemp(prefix="fedact-test-cache-")
atexit.register(shutil.rmtree, os.environ["FEDACT_CACHE_DIR"], ignore_errors=True)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per CPU this process may run on (a container's limit, not the
    host's count), at most 4."""
    return min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _CURRENT_TEST.append(item)
    try:
        return (yield)
    finally:
        _CURRENT_TEST.pop()


def pytest_collection_modifyitems(items):
    """Files that start real Flower processes (a test marked ``e2e``) first: with pytest-xdist's
    ``--dist loadfile --no-loadscope-reorder`` (pyproject.toml) the workers take the files in this
    order, so the long Flower files start at once, each worker's on its own engine (its own
    SuperLink and Ray cluster), and the unit files fill the gaps at the end. (Two engines side by
    side once failed a run now and then: their Ray clusters handed two drivers one port,
    tests/test_ray_cluster.py.)"""
    flower_files = {item.path for item in items if item.get_closest_marker("e2e")}
    items.sort(key=lambda item: item.path not in flower_files)  # stable: the order within is kept


# CPUs of each worker's Ray cluster, whatever the machine: a OneActorEngine's actor holds them all,
# and Ray gives an actor as many torch threads as it holds CPUs.
ENGINE_CPUS = 2


class OneActorEngine(LocalEngine):
    """A :class:`~fedact_app.cli.engine.LocalEngine` whose runs give each client all of the
    cluster's CPUs unless ``num_cpus_per_client`` is passed: Flower then makes one Ray actor,
    and the clients of a round train one after another in it. Each further actor is a process
    that imports torch and the app (about 6 CPU-seconds of a 16-second digits run, measured
    here), for test clients that compute for milliseconds."""

    def run(self, app_dir, overrides="", num_supernodes=2, num_cpus_per_client=None, *args, **kwargs):
        cpus = self.num_cpus if num_cpus_per_client is None else num_cpus_per_client
        return super().run(app_dir, overrides, num_supernodes, cpus, *args, **kwargs)


@pytest.fixture(scope="session")
def flower_engine():
    """One local engine for this test process's end-to-end runs, the one a sweep uses
    (fedact_app.cli.engine.LocalEngine.for_sweep(1): one SuperLink and one Ray cluster, runs
    computing one after another, the next starting while the last shuts down): on 2 cores that
    is faster than runs side by side, each paying for its own SuperLink and Ray. A run's clients
    train in one Ray actor unless the test asks for more (:class:`OneActorEngine`).
    tests/test_launch.py and tests/test_reproducible_e2e.py also run the app alone on a fresh
    SuperLink, with Flower's default of one CPU per client (one actor per CPU of the machine)."""
    with OneActorEngine.for_sweep(1, num_cpus=ENGINE_CPUS) as engine:
        yield engine


@pytest.fixture(scope="session")
def on_flower_engine(flower_engine):
    """``on_flower_engine(job, items)``: ``[job(item) for item in items]``, with as many jobs in
    flight as the session's engine takes, as a sweep runs them: the next run starts while the last
    one's Flower processes shut down."""

    def run_all(job, items):
        pool = ThreadPoolExecutor(flower_engine.max_parallel)
        try:
            return list(pool.map(job, items))
        finally:  # a failed job or an interrupt: the jobs not yet started never start
            pool.shutdown(wait=True, cancel_futures=True)

    return run_all


class FakeEngine:
    """Stands in for fedact_app.cli.engine.LocalEngine: ``run`` calls ``outcome(app_dir, overrides,
    num_supernodes, **kwargs)`` and returns (or raises) what it gives; no Flower process starts."""

    def __init__(self, outcome):
        self.outcome = outcome
        self.max_parallel = 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def close(self):
        return ()

    def run(self, app_dir, overrides="", num_supernodes=2, **kwargs):
        return self.outcome(app_dir, overrides, num_supernodes, **kwargs)


@pytest.fixture
def fake_engine(monkeypatch):
    """``fake_engine(outcome)``: scripts/sweep.py's jobs (and so study.py's and tune.py's) run on a
    :class:`FakeEngine` calling ``outcome``; returns that engine."""
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import sweep

    def install(outcome):
        engine = FakeEngine(outcome)

        def for_options(options):  # the jobs' threads: as many as the options ask (1 by default)
            engine.max_parallel = options.max_parallel
            return engine

        monkeypatch.setattr(sweep.LaunchOptions, "engine", for_options)
        return engine

    return install


@pytest.fixture
def no_torch_compile(monkeypatch):
    """torch.compile failing at every call (as where no compiler or Triton is installed), with no
    failure of it recorded before in this process (fedact_app.optim.topk.compile_failed)."""
    import fedact_app.optim.topk as topk

    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(topk, "_compile_failures", [])
    monkeypatch.setattr(topk.torch, "compile", broken)


@pytest.fixture
def workers(monkeypatch):
    """A private warm-worker folder of a short path (a socket path has at most 107 bytes); every
    worker (fedact_app.node_worker) started in it is stopped afterwards."""
    from fedact_app.node_worker import channel, forward

    folder = Path(tempfile.mkdtemp(prefix="fw-"))
    monkeypatch.setenv(channel.WORKER_DIR_ENV, str(folder / "w"))
    yield folder / "w"
    for info in (folder / "w").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            os.kill(json.loads(info.read_text())["pid"], signal.SIGKILL)
    for started in forward._STARTED:  # reaped here, not warned about at exit
        with contextlib.suppress(subprocess.TimeoutExpired):
            started.wait(timeout=10)
    forward._STARTED.clear()
    shutil.rmtree(folder, ignore_errors=True)
