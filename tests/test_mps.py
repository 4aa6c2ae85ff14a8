"""The private CUDA MPS daemon (fedact_app.cli.mps), and where the launcher, the engine, sweeps,
studies, tuning and bench_round.py start it.

These machines have no GPU and no NVIDIA driver, so a stand-in for ``nvidia-cuda-mps-control``,
put first on PATH, plays its part. Like NVIDIA's, with ``-f`` it runs the daemon in the
foreground, which makes its socket and pid file in ``$CUDA_MPS_PIPE_DIRECTORY``; without it, it
passes on a ``quit`` read from stdin. What MPS
does to the clients' kernels needs a GPU: ``scripts/gpu_checks.sh round-mps`` measures it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedact_app.cli import engine, launch, mps
from fedact_app.cli.flwr import LaunchError
from fedact_app.cli.procs import pid_alive

REPO_ROOT = Path(__file__).resolve().parents[1]
PAPER = "experiment=paper_vision"

# FAKE_MPS: ok; fail (it exits 1 at once); silent (it never listens); stubborn (it ignores quit);
# server (it also starts a "server" that leaves its session, as a re-parented MPS server would).
# A client passes quit on and returns once the daemon has taken it, or at once when no daemon
# runs. The daemon ends by itself once its pipe directory is gone or after 120 s.
FAKE_CONTROL = """#!{python}
import json, os, signal, socket, sys, time
pipe, log = os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"]
mode = os.environ.get("FAKE_MPS", "ok")
quit_file = os.path.join(pipe, "quit")
def daemon_runs():
    try:
        os.kill(int(open(os.path.join(log, "daemon.pid")).read()), 0)
    except (OSError, ValueError):
        return False
    return True
if sys.argv[1:] != ["-f"]:  # a client of the daemon: pass the command on
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
with open(os.path.join(log, "daemon.pid"), "w") as f:
    f.write(str(os.getpid()))
with open(os.path.join(log, "env.json"), "w") as f:
    json.dump({{k: v for k, v in os.environ.items() if k.startswith("CUDA_MPS_") or k == "CUDA_VISIBLE_DEVICES"}}, f)
with open(os.path.join(log, "control.log"), "a") as f:
    f.write("Starting control daemon\\n")
if mode == "server" and os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(os.path.join(log, "server.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    os._exit(0)
if mode != "silent":
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(pipe, "control"))
    with open(os.path.join(pipe, "nvidia-cuda-mps-control.pid"), "w") as f:
        f.write(str(os.getpid()))
deadline = time.monotonic() + 120
while time.monotonic() < deadline and os.path.isdir(pipe) and (mode == "stubborn" or not os.path.exists(quit_file)):
    time.sleep(0.02)
for name in ("nvidia-cuda-mps-control.pid", "quit"):
    if os.path.exists(os.path.join(pipe, name)):
        os.remove(os.path.join(pipe, name))
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """``fake_control(mode)``: the stand-in on PATH, in ``mode``; returns its path. Every daemon
    started meanwhile is stopped when the test ends, also a test that failed half-way."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / mps.CONTROL
    control.write_text(FAKE_CONTROL.format(python=sys.executable))
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    started: list[mps.MpsDaemon] = []
    wait_ready = mps.MpsDaemon._wait_ready

    def noted(self, until):
        started.append(self)
        return wait_ready(self, until)

    monkeypatch.setattr(mps.MpsDaemon, "_wait_ready", noted)

    def with_mode(mode: str = "ok") -> Path:
        monkeypatch.setenv("FAKE_MPS", mode)
        return control

    yield with_mode
    for daemon in started:
        daemon.stop()


def test_the_daemon_serves_its_own_directories_and_stops_on_quit(fake_control, monkeypatch):
    control = fake_control("ok")
    monkeypatch.setattr(mps, "STOP_TIMEOUT", 5.0)
    daemon = mps.MpsDaemon.start({**os.environ, "CUDA_VISIBLE_DEVICES": "1"})
    assert daemon.control == str(control)
    assert daemon.env == {"CUDA_MPS_PIPE_DIRECTORY": str(daemon.root / "pipe"),
                          "CUDA_MPS_LOG_DIRECTORY": str(daemon.root / "log")}
    assert len(str(daemon.root / "pipe" / "control")) < 108  # a unix socket's path fits
    assert daemon.alive() and int((daemon.root / "log" / "daemon.pid").read_text()) == daemon.proc.pid
    seen_env = json.loads((daemon.root / "log" / "env.json").read_text())
    assert seen_env == daemon.env  # and no CUDA_VISIBLE_DEVICES: the daemon sees every GPU
    began = time.monotonic()
    seen = daemon.stop()
    assert time.monotonic() - began < 2.0  # quit was taken (no wait for STOP_TIMEOUT, no SIGKILL)
    assert daemon.proc.returncode == 0 and daemon.proc.pid in seen
    assert not daemon.alive() and not daemon.root.exists()
    assert daemon.stop() == seen  # a second stop does nothing


def test_a_missing_binary_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LaunchError, match=r"nvidia-cuda-mps-control is not on PATH .*run without --mps"):
        mps.MpsDaemon.start(dict(os.environ))


def test_a_binary_that_cannot_run_is_named(monkeypatch, tmp_path):
    control = tmp_path / mps.CONTROL
    control.write_text("#!/nonexistent/interpreter\n")
    control.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    made = []
    real_mkdtemp = mps.tempfile.mkdtemp
    monkeypatch.setattr(mps.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    with pytest.raises(LaunchError, match=r"nvidia-cuda-mps-control -f cannot run: .*No such file"):
        mps.MpsDaemon.start(dict(os.environ))
    assert not Path(made[0]).exists()


def test_a_daemon_that_ends_at_once_is_reported_with_its_output(fake_control):
    fake_control("fail")
    with pytest.raises(LaunchError, match=r"(?s)-f ended with status 1:\ncontrol.out:\n  An instance of this daemon"):
        mps.MpsDaemon.start(dict(os.environ))


def test_a_daemon_that_never_listens_is_reported_and_stopped(fake_control, monkeypatch):
    fake_control("silent")
    monkeypatch.setattr(mps, "START_TIMEOUT", 1.0)
    daemons = []
    monkeypatch.setattr(mps.MpsDaemon, "log_tail", lambda self, lines=20: daemons.append(self) or ": its log")
    with pytest.raises(LaunchError, match=r"-f did not listen in .*/pipe within 1 s: its log"):
        mps.MpsDaemon.start(dict(os.environ))
    (daemon,) = daemons
    assert daemon.proc.returncode is not None and not daemon.root.exists()


def test_a_daemon_that_ignores_quit_is_killed(fake_control, monkeypatch):
    fake_control("stubborn")
    monkeypatch.setattr(mps, "STOP_TIMEOUT", 0.5)
    daemon = mps.MpsDaemon.start(dict(os.environ))
    assert daemon.alive()
    daemon.stop()
    assert daemon.proc.returncode == -signal.SIGKILL and not daemon.root.exists()


def test_a_server_that_left_the_daemons_session_is_killed_too(fake_control):
    fake_control("server")
    daemon = mps.MpsDaemon.start(dict(os.environ))
    server_pid = wait_for_pid(daemon.root / "log" / "server.pid")
    daemon.remember_children()  # what the engine does whenever it checks its processes
    assert server_pid in daemon.servers
    assert server_pid in daemon.stop()
    assert wait_gone(server_pid)


def wait_for_pid(path: Path, seconds: float = 10.0) -> int:
    until = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert time.monotonic() < until, f"no {path}"
        time.sleep(0.02)
    return int(path.read_text())


def wait_gone(pid: int, seconds: float = 5.0) -> bool:
    until = time.monotonic() + seconds
    while pid_alive(pid):
        if time.monotonic() > until:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def fake_processes(monkeypatch):
    """The engine's SuperLink and Ray head as stand-ins: ``events`` says what they saw (their
    environments, and whether the MPS daemon still ran when they were stopped)."""
    events: dict[str, object] = {"stopped": []}
    holder: dict[str, engine.LocalEngine] = {}

    def stopping(name, fail=False):
        def stop(kill_at_once=False):
            daemon = holder["engine"].mps_daemon
            events["stopped"].append((name, daemon is not None and daemon.alive()))
            if fail:
                raise RuntimeError(f"{name} could not be stopped")
            return ()
        return stop

    def ray_start(num_cpus, num_gpus, env):
        events["ray"] = dict(env)
        return SimpleNamespace(address="127.0.0.1:1", alive=lambda: True, remember_children=lambda: None,
                               stop=stopping("ray", fail=events.get("ray fails", False)))

    def link_start(home, env, cwd, deadline):
        events["superlink"] = dict(env)
        return SimpleNamespace(port=1, proc=SimpleNamespace(poll=lambda: None), remember_children=lambda: None,
                               stop=stopping("superlink"))

    monkeypatch.setattr(engine.RayCluster, "start", ray_start)
    monkeypatch.setattr(engine.SimulationSuperLink, "start", link_start)
    monkeypatch.setattr(engine.flwr, "ControlClient", lambda address: SimpleNamespace(close=lambda: None))

    def make(**kwargs) -> engine.LocalEngine:
        holder["engine"] = engine.LocalEngine(**kwargs)
        return holder["engine"]

    events["make"] = make
    return events


def test_the_engine_starts_the_daemon_first_gives_every_process_its_address_and_stops_it_last(
        fake_control, fake_processes, tmp_path):
    fake_control("ok")
    local = fake_processes["make"](shared_ray=True, flwr_home=tmp_path / "home", mps=True)
    local._start()
    daemon = local.mps_daemon
    assert daemon is not None and daemon.alive()
    for name in ("ray", "superlink"):  # the Ray head (so its actors) and the SuperLink (so each run)
        assert fake_processes[name]["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.root / "pipe")
        assert fake_processes[name]["CUDA_MPS_LOG_DIRECTORY"] == str(daemon.root / "log")
    assert local.env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemon.root / "pipe")
    assert local._healthy()
    local._stop_processes()
    assert fake_processes["stopped"] == [("superlink", True), ("ray", True)]  # the daemon outlived both
    assert local.mps_daemon is None and not daemon.alive() and not daemon.root.exists()
    assert daemon.proc.pid in local.pids


def test_an_engine_whose_daemon_died_is_restarted_before_the_next_run(fake_control, fake_processes, tmp_path):
    fake_control("ok")
    local = fake_processes["make"](shared_ray=False, flwr_home=tmp_path / "home", mps=True)
    local._start()
    daemon = local.mps_daemon
    daemon.proc.kill()
    daemon.proc.wait()
    assert not local._healthy()
    local._stop_processes()
    assert not daemon.root.exists()


def test_the_daemon_is_stopped_when_stopping_the_cluster_fails(fake_control, fake_processes, tmp_path):
    fake_control("ok")
    fake_processes["ray fails"] = True
    local = fake_processes["make"](shared_ray=True, flwr_home=tmp_path / "home", mps=True)
    local._start()
    daemon = local.mps_daemon
    with pytest.raises(RuntimeError, match="ray could not be stopped"):
        local._stop_processes()
    assert not daemon.alive() and not daemon.root.exists() and local.mps_daemon is None


def test_the_engine_without_mps_starts_no_daemon(fake_control, fake_processes, tmp_path):
    fake_control("fail")  # would raise if it were started
    local = fake_processes["make"](shared_ray=False, flwr_home=tmp_path / "home")
    local._start()
    assert local.mps_daemon is None and "CUDA_MPS_PIPE_DIRECTORY" not in fake_processes["superlink"]


def test_an_engine_whose_daemon_fails_starts_nothing_else(fake_control, fake_processes, tmp_path):
    fake_control("fail")
    local = fake_processes["make"](shared_ray=True, flwr_home=tmp_path / "home", mps=True)
    with pytest.raises(LaunchError, match="ended with status 1"):
        local._start()
    assert local.mps_daemon is None and "ray" not in fake_processes and "superlink" not in fake_processes


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
