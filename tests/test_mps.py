"""The private CUDA MPS daemon (fedact_app.cli.mps), and where the launcher, the engine, sweeps,
studies, tuning and bench_round.py start it.

These machines have no GPU and no NVIDIA driver, so a stand-in for ``nvidia-cuda-mps-control``,
put first on PATH, plays its part. Like NVIDIA's, it forks a daemon on ``-d``, which writes its
pid file into ``$CUDA_MPS_PIPE_DIRECTORY``, and it passes on a ``quit`` read from stdin. What MPS
does to the clients' kernels needs a GPU: ``scripts/gpu_checks.sh round-mps`` measures it.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedact_app.cli import engine, launch, mps
from fedact_app.cli.flwr import LaunchError
from fedact_app.cli.procs import pid_alive

REPO_ROOT = Path(__file__).resolve().parents[1]
PAPER = "experiment=paper_vision"

# FAKE_MPS: ok; fail (-d exits 1); nopid (the daemon writes no pid file); stubborn (it ignores
# quit). A client passes quit on and returns once the daemon has taken it, or at once when no
# daemon runs.
FAKE_CONTROL = """#!{python}
import os, sys, time
pipe, log = os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"]
mode = os.environ.get("FAKE_MPS", "ok")
quit_file = os.path.join(pipe, "quit")
def daemon_runs():
    try:
        os.kill(int(open(os.path.join(log, "daemon.pid")).read()), 0)
    except (OSError, ValueError):
        return False
    return True
if sys.argv[1:] != ["-d"]:  # a client of the daemon: pass the command on
    if not daemon_runs():
        print("Cannot find MPS control daemon process")
        sys.exit(1)
    if sys.stdin.read().strip() == "quit":
        open(quit_file, "w").close()
        while os.path.exists(quit_file) and daemon_runs():
            time.sleep(0.02)
    sys.exit(0)
if mode == "fail":
    print("An instance of this daemon is already running")
    sys.exit(1)
if os.fork():
    sys.exit(0)
os.setsid()
with open(os.path.join(log, "daemon.pid"), "w") as f:  # for the test, whatever the mode
    f.write(str(os.getpid()))
with open(os.path.join(log, "control.log"), "a") as f:
    f.write("Starting control daemon\\n")
pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
if mode != "nopid":
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
while mode == "stubborn" or not os.path.exists(quit_file):
    time.sleep(0.02)
if os.path.exists(pid_file):
    os.remove(pid_file)
os.remove(quit_file)
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """``fake_control(mode)``: the stand-in on PATH, in ``mode``; returns its path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(FAKE_CONTROL.format(python=sys.executable))
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")

    def with_mode(mode: str = "ok") -> Path:
        monkeypatch.setenv("FAKE_MPS", mode)
        return control

    return with_mode


def daemon_pid(daemon: mps.MpsDaemon) -> int:
    """The pid the stand-in daemon noted for the test (also where it wrote no pid file)."""
    return int((daemon.root / "log" / "daemon.pid").read_text())


def test_the_daemon_serves_its_own_directories_and_stops_on_quit(fake_control):
    control = fake_control("ok")
    daemon = mps.MpsDaemon.start(dict(os.environ))
    try:
        assert daemon.control == str(control)
        assert daemon.env == {"CUDA_MPS_PIPE_DIRECTORY": str(daemon.root / "pipe"),
                              "CUDA_MPS_LOG_DIRECTORY": str(daemon.root / "log")}
        assert (daemon.root / "pipe").is_dir() and (daemon.root / "log").is_dir()
        assert len(str(daemon.root / "pipe" / mps.PID_FILE)) < 108  # a unix socket's path fits
        assert daemon.pid == daemon_pid(daemon) and daemon.alive()
    finally:
        seen = daemon.stop()
    assert daemon.pid in seen
    assert not pid_alive(daemon.pid) and not daemon.alive()
    assert not daemon.root.exists()


def test_a_missing_binary_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"nvidia-cuda-mps-control is not on PATH .*run without --mps"):
        mps.MpsDaemon.start(dict(os.environ))


def test_a_daemon_that_fails_to_start_is_reported_with_its_output(fake_control):
    fake_control("fail")
    with pytest.raises(LaunchError, match=r"(?s)-d exited with status 1:\nstart.out:\n  An instance of this daemon"):
        mps.MpsDaemon.start(dict(os.environ))


def test_a_daemon_without_pid_file_is_reported_and_stopped(fake_control, monkeypatch, tmp_path):
    fake_control("nopid")
    monkeypatch.setattr(mps, "START_TIMEOUT", 1.0)
    made = []
    real_mkdtemp = mps.tempfile.mkdtemp
    monkeypatch.setattr(mps.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    with pytest.raises(LaunchError, match=r"(?s)wrote no nvidia-cuda-mps-control.pid .* within 1 s:.*"
                                          r"control.log:\n  Starting control daemon"):
        mps.MpsDaemon.start(dict(os.environ))
    assert not Path(made[0]).exists()


def test_a_daemon_without_pid_file_gets_quit_too(fake_control, monkeypatch):
    """The start's clean-up sends ``quit`` although it knows no pid: the daemon ends."""
    fake_control("nopid")
    monkeypatch.setattr(mps, "START_TIMEOUT", 1.0)
    pids = []
    real_stop = mps.MpsDaemon.stop

    def noting_stop(self):
        pids.append(int((self.root / "log" / "daemon.pid").read_text()))
        return real_stop(self)

    monkeypatch.setattr(mps.MpsDaemon, "stop", noting_stop)
    with pytest.raises(LaunchError):
        mps.MpsDaemon.start(dict(os.environ))
    assert pids and wait_gone(pids[0])


def wait_gone(pid: int, seconds: float = 5.0) -> bool:
    import time

    until = time.monotonic() + seconds
    while pid_alive(pid):
        if time.monotonic() > until:
            return False
        time.sleep(0.05)
    return True


def test_a_daemon_that_ignores_quit_is_killed(fake_control, monkeypatch):
    fake_control("stubborn")
    monkeypatch.setattr(mps, "STOP_TIMEOUT", 0.5)
    daemon = mps.MpsDaemon.start(dict(os.environ))
    assert daemon.alive()
    daemon.stop()
    assert not pid_alive(daemon.pid)


class _FakeLink(SimpleNamespace):
    def stop(self, kill_at_once=False):
        return ()

    def remember_children(self):
        return None


def test_the_engine_starts_the_daemon_first_gives_every_process_its_address_and_stops_it_last(
        fake_control, tmp_path, monkeypatch):
    fake_control("ok")
    started: dict[str, dict[str, str]] = {}
    events = []

    def ray_start(num_cpus, num_gpus, env):
        started["ray"] = dict(env)
        return SimpleNamespace(address="127.0.0.1:1", alive=lambda: True,
                               stop=lambda kill_at_once=False: events.append("ray stopped") or (),
                               remember_children=lambda: None)

    def link_start(home, env, cwd, deadline):
        started["superlink"] = dict(env)
        return _FakeLink(port=1, proc=SimpleNamespace(poll=lambda: None))

    monkeypatch.setattr(engine.RayCluster, "start", ray_start)
    monkeypatch.setattr(engine.SimulationSuperLink, "start", link_start)
    monkeypatch.setattr(engine.flwr, "ControlClient", lambda address: SimpleNamespace(close=lambda: None))
    local = engine.LocalEngine(shared_ray=True, flwr_home=tmp_path / "home", mps=True)
    local._start()
    daemon = local.mps_daemon
    assert daemon is not None and daemon.alive()
    for env in started.values():  # the Ray head (so its actors) and the SuperLink (so each run)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.root / "pipe")
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(daemon.root / "log")
    assert local.env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.root / "pipe")
    assert local._healthy()
    os.kill(daemon.pid, signal.SIGKILL)  # a daemon that died: the engine restarts before the next run
    assert wait_gone(daemon.pid)
    assert not local._healthy()
    local._stop_processes()
    assert events == ["ray stopped"] and local.mps_daemon is None
    assert daemon.pid in local.pids and not daemon.root.exists()


def test_the_engine_without_mps_starts_no_daemon(fake_control, tmp_path, monkeypatch):
    fake_control("fail")  # would raise if it were started
    monkeypatch.setattr(engine.SimulationSuperLink, "start",
                        lambda home, env, cwd, deadline: _FakeLink(port=1, env=dict(env)))
    monkeypatch.setattr(engine.flwr, "ControlClient", lambda address: SimpleNamespace(close=lambda: None))
    local = engine.LocalEngine(shared_ray=False, flwr_home=tmp_path / "home")
    local._start()
    assert local.mps_daemon is None and "CUDA_MPS_PIPE_DIRECTORY" not in local.link.env


def test_an_engine_whose_daemon_fails_starts_nothing_else(fake_control, tmp_path, monkeypatch):
    fake_control("fail")
    monkeypatch.setattr(engine.SimulationSuperLink, "start", lambda *a: pytest.fail("the SuperLink started"))
    local = engine.LocalEngine(shared_ray=False, flwr_home=tmp_path / "home", mps=True)
    with pytest.raises(LaunchError, match="exited with status 1"):
        local._start()
    assert local.mps_daemon is None


@pytest.fixture
def gpu_machine(monkeypatch):
    from fedact_app.cli import resources

    monkeypatch.setattr(resources, "visible_gpus", lambda: 1)
    monkeypatch.setattr(resources, "machine_cpus", lambda: 16)


def test_the_launcher_passes_mps_on(gpu_machine, monkeypatch):
    calls = []

    def fake_run(*args, **kwargs):
        calls.append(kwargs)
        raise launch.LaunchError("no run here")

    monkeypatch.setattr(launch, "run_simulation", fake_run)
    assert launch.main(["--app", str(REPO_ROOT), "--overrides", PAPER, "--mps"]) == 2
    assert launch.main(["--app", str(REPO_ROOT), "--overrides", PAPER]) == 2
    assert [c["mps"] for c in calls] == [True, False]


def test_the_launcher_refuses_mps_for_clients_without_a_gpu(gpu_machine, monkeypatch, capsys):
    monkeypatch.setattr(launch, "run_simulation", lambda *a, **k: pytest.fail("a run started"))
    assert launch.main(["--app", str(REPO_ROOT), "--overrides", PAPER, "--mps", "--num-gpus", "0"]) == 2
    assert "config error: --mps shares a GPU between clients, but they get none" in capsys.readouterr().err


def test_run_simulation_gives_the_engine_mps(monkeypatch):
    made = []

    class Engine:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.pids = set()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def run(self, *args, **kwargs):
            return SimpleNamespace(pids=(), seconds=0.0)

    monkeypatch.setattr(launch, "LocalEngine", Engine)
    launch.run_simulation(REPO_ROOT, num_gpus_per_client=0.1, mps=True)
    launch.run_simulation(REPO_ROOT, num_gpus_per_client=0.1)
    assert [m["mps"] for m in made] == [True, False]


def test_sweeps_studies_and_tuning_pass_mps_to_their_engine(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    import study
    import sweep
    import tune

    options, _ = sweep.parse_launch_options(["--mps", "seed=1"])
    assert options.mps and not sweep.parse_launch_options(["seed=1"])[0].mps
    assert sweep.LaunchOptions(mps=True).engine().mps
    assert sweep.LaunchOptions(mps=True, max_parallel=2).engine().mps
    assert not sweep.LaunchOptions().engine().mps

    seen = []
    monkeypatch.setattr(study, "run_jobs", lambda jobs_dir, jobs, launch, rerun=False: seen.append(launch) or [])
    study.main(["run", "--out", str(tmp_path / "study"), "--methods", "fedavg", "--seeds", "0", "--mps"])
    assert seen[-1].mps

    def for_options(launch_options):
        seen.append(launch_options)
        raise RuntimeError("no tuning here")

    monkeypatch.setattr(sweep.LaunchOptions, "engine", for_options)
    with pytest.raises(RuntimeError, match="no tuning here"):
        tune.main(["--out", str(tmp_path / "tune"), "--methods", "fedavg", "--lr-grid", "2", "--mps"])
    assert seen[-1].mps


def test_bench_round_has_mps(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    import bench_round

    assert bench_round.parse_args(["--paper", "--mps"]).mps
    assert not bench_round.parse_args(["--paper"]).mps


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_the_clientapps_of_a_run_find_the_daemon(fake_control, tmp_path):
    """A real run on an engine with ``mps=True``: Flower's ClientApp actors have the daemon's pipe
    directory in their environment, so CUDA in them would connect to the daemon; the daemon is
    stopped with the engine."""
    import threading
    import time

    from fedact_app.cli.procs import descendants

    fake_control("ok")
    environments: dict[int, tuple[str, dict[str, str]]] = {}
    running = threading.Event()

    def watch(local: engine.LocalEngine) -> None:
        while not running.is_set():
            link = local.link
            for pid in descendants(link.proc.pid) if link is not None else ():
                try:
                    cmdline = " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                                       .replace("\0", " ").split())  # (Ray pads its workers' names)
                    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if "ClientAppActor" in cmdline:
                    env = dict(item.decode(errors="replace").partition("=")[::2] for item in raw if b"=" in item)
                    environments[pid] = (cmdline, env)
            time.sleep(0.2)

    with engine.LocalEngine(shared_ray=False, mps=True, flwr_home=tmp_path / "home") as local:
        watcher = threading.Thread(target=watch, args=(local,), daemon=True)
        watcher.start()
        try:
            result = local.run(REPO_ROOT, overrides=f"num_clients=2 fraction_train=1.0 min_train_nodes=2 local_steps=2 "
                                                    f"num_rounds=1 device=cpu output_dir={tmp_path / 'run'}",
                               num_supernodes=2, timeout=300)
        finally:
            running.set()
            watcher.join()
        daemon = local.mps_daemon
        assert result.completed, result.tail(60)
    assert environments, "no ClientApp actor seen"
    for cmdline, env in environments.values():
        assert env.get("CUDA_MPS_PIPE_DIRECTORY") == str(daemon.root / "pipe"), cmdline
    assert not daemon.alive() and not daemon.root.exists()
