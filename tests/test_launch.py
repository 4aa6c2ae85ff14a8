"""Tests for fedact_app.cli.launch (and the flwr-CLI helpers of fedact_app.cli.flwr) against a tiny throw-away Flower app (imports only flwr).

The e2e tests start a real private SuperLink each (~15-25 s on a 2-core machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedact_app.cli import engine, flwr, launch, procs
from fedact_app.cli.launch import pid_alive, run_simulation

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_NODES = 3

TINY_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "tinyapp"
version = "0.1.0"
dependencies = ["flwr"]

[tool.hatch.build.targets.wheel]
packages = ["tinyapp"]

[tool.flwr.app]
publisher = "fedact-tests"

[tool.flwr.app.components]
serverapp = "tinyapp.server_app:app"
clientapp = "tinyapp.client_app:app"

[tool.flwr.app.config]
overrides = ""
expected-nodes = 0
"""

# The ServerApp's behaviour is picked by words in `overrides`: "fail" raises, "sleep" hangs.
TINY_SERVER_APP = '''\
import os
import time

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    words = str(context.run_config["overrides"]).split()
    expected = int(context.run_config["expected-nodes"])
    print(f"TINYAPP words={words} expected={expected}", flush=True)
    print(f"TINYAPP cwd={os.getcwd()} mark={os.environ.get('TINYAPP_MARK')}", flush=True)
    if "fail" in words:
        raise RuntimeError("TINYAPP deliberate failure")
    if "sleep" in words:
        time.sleep(600)
    # Simulated SuperNodes register asynchronously: wait (bounded) until all are there.
    deadline = time.monotonic() + 30
    while len(node_ids := list(grid.get_node_ids())) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    if len(node_ids) != expected:
        raise RuntimeError(f"TINYAPP expected {expected} nodes, saw {len(node_ids)}")
    messages = [
        Message(RecordDict({"cfg": ConfigRecord({"x": 1})}), dst_node_id=node,
                message_type=MessageType.TRAIN)
        for node in node_ids
    ]
    replies = [r for r in grid.send_and_receive(messages, timeout=30) if r.has_content()]
    if len(replies) != expected:
        raise RuntimeError(f"TINYAPP got {len(replies)} replies from {expected} nodes")
    total = sum(int(r.content["metrics"]["y"]) for r in replies)
    print(f"TINYAPP success nodes={len(node_ids)} total={total}", flush=True)
'''

TINY_CLIENT_APP = '''\
import os

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    x = int(msg.content["cfg"]["x"])
    y = x + len(os.environ.get("TINYAPP_MARK", ""))  # shows `env` reaches the ClientApps
    return Message(RecordDict({"metrics": MetricRecord({"y": y})}), reply_to=msg)
'''


@pytest.fixture(scope="module")
def tiny_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tinyapp")
    (root / "tinyapp").mkdir()
    (root / "pyproject.toml").write_text(TINY_PYPROJECT)
    (root / "tinyapp" / "__init__.py").write_text("")
    (root / "tinyapp" / "server_app.py").write_text(TINY_SERVER_APP)
    (root / "tinyapp" / "client_app.py").write_text(TINY_CLIENT_APP)
    return root


@pytest.fixture
def user_flwr_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Stands in for the user's ~/.flwr: the launcher must never write there."""
    home = tmp_path / "user-flwr-home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setenv("FLWR_DISABLE_UPDATE_CHECK", "1")
    return home


def _assert_cleaned_up(result: launch.RunResult) -> None:
    assert result.superlink_pid > 0
    assert result.superlink_pid in result.pids
    assert len(result.pids) >= 2  # SuperLink + SuperExec at least
    assert not pid_alive(result.superlink_pid)
    assert [p for p in result.pids if pid_alive(p)] == []


# --------------------------------------------------------------------------------------------
# End to end: real SuperLink, real simulation
# --------------------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_completed_run(tiny_app: Path, user_flwr_home: Path, tmp_path: Path) -> None:
    home = tmp_path / "private-home"
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    result = run_simulation(
        tiny_app,
        overrides="ok a=1 b='x y'",
        num_supernodes=NUM_NODES,
        run_config={"expected-nodes": NUM_NODES},
        timeout=150,
        flwr_home=home,
        env={"TINYAPP_MARK": "abc"},
        cwd=workdir,
    )
    assert result.completed, result.log
    assert result.status == "finished:completed"  # Flower's: this app never says it ended (serverapp_done)
    assert not result.timed_out
    # 3 nodes answered, each with 1 + len("abc"): `env` reached the ClientApps.
    assert f"TINYAPP success nodes={NUM_NODES} total={4 * NUM_NODES}" in result.log
    assert f"TINYAPP cwd={workdir} mark=abc" in result.log
    assert """words=['ok', 'a=1', "b='x", "y'"]""" in result.log  # overrides arrived verbatim
    assert "\x1b[" not in result.log
    _assert_cleaned_up(result)
    # Private FLWR_HOME: our connection only; the app was installed there; the user's untouched.
    config = (home / "config.toml").read_text()
    assert f"[superlink.{launch.CONNECTION}]" in config and ":local:" not in config
    assert any((home / "apps").iterdir())
    assert not user_flwr_home.exists()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_failed_run(tiny_app: Path, user_flwr_home: Path) -> None:
    result = run_simulation(
        tiny_app,
        overrides="fail",
        num_supernodes=NUM_NODES,
        run_config={"expected-nodes": NUM_NODES},
        timeout=150,
    )
    assert not result.completed
    assert result.status == "finished:failed"
    assert "TINYAPP deliberate failure" in result.details
    assert "RuntimeError: TINYAPP deliberate failure" in result.log
    _assert_cleaned_up(result)
    assert not user_flwr_home.exists()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_timeout_stops_everything(tiny_app: Path, user_flwr_home: Path) -> None:
    # The ServerApp hangs; the flwr-simulation process and its Ray cluster outlive a SIGTERM'd
    # SuperLink, so this checks the whole process tree is taken down.
    result = run_simulation(
        tiny_app,
        overrides="sleep",
        num_supernodes=NUM_NODES,
        run_config={"expected-nodes": NUM_NODES},
        timeout=20,
    )
    assert result.timed_out
    assert not result.completed
    assert not result.status.startswith("finished")
    assert result.seconds < 120  # the ServerApp sleeps 600 s: the 20 s timeout cut it (slack for a loaded machine)
    assert "TINYAPP words=['sleep']" in result.log
    _assert_cleaned_up(result)


@pytest.mark.e2e
@pytest.mark.timeout(150)
def test_rejected_run_raises_and_stops_superlink(
    tiny_app: Path, user_flwr_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `flwr run --format json` exits 0 here too; the launcher must notice and raise.
    stopped: list[tuple[int, ...]] = []
    real_stop = engine.SimulationSuperLink.stop

    def spy(self: engine.SimulationSuperLink, *args: object) -> tuple[int, ...]:
        stopped.append(real_stop(self, *args))
        return stopped[-1]

    monkeypatch.setattr(engine.SimulationSuperLink, "stop", spy)
    with pytest.raises(launch.LaunchError, match="no-such-key"):
        run_simulation(tiny_app, run_config={"no-such-key": 1}, timeout=120)
    assert len(stopped) == 1
    assert [p for p in stopped[0] if pid_alive(p)] == []
    assert not user_flwr_home.exists()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_cli_exit_code_reports_failure(tiny_app: Path, user_flwr_home: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fedact_app.cli.launch", "--app", str(tiny_app),
         "--overrides", "fail", "--num-supernodes", str(NUM_NODES),
         "--run-config", f"expected-nodes={NUM_NODES}", "--timeout", "150"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "finished:failed" in proc.stdout
    assert "TINYAPP deliberate failure" in proc.stdout


# --------------------------------------------------------------------------------------------
# Fast unit tests (no SuperLink)
# --------------------------------------------------------------------------------------------
def test_run_config_toml_escapes_and_flattens() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    config = {"overrides": "a=1 b='x y' c=\"q\" d=\\", "n": 3, "f": 0.5, "on": True, "x": {"y": 2}}
    parsed = tomllib.loads(flwr.toml_table(config))
    assert parsed == {"overrides": config["overrides"], "n": 3, "f": 0.5, "on": True, "x.y": 2}
    assert flwr.toml_value(0.0) == "0.0" and flwr.toml_value(False) == "false"
    with pytest.raises(TypeError):
        flwr.toml_value([1])


def test_cli_run_config_values() -> None:
    parsed = launch._parse_run_config(["n=3", "f=0.5", "on=true", "s=plain words", 's2="q"'])
    assert parsed == {"n": 3, "f": 0.5, "on": True, "s": "plain words", "s2": "q"}


class _FakeStream:
    """A log stream that writes ``text`` into ``path`` and has ended at once, with ``error`` (or
    stays open, ``live``)."""

    def __init__(self, path: Path, text: str, error: str = "", live: bool = False) -> None:
        path.write_text(text, encoding="utf-8")
        self.error = error
        self.live = live
        self.stopped = False

    def ended(self) -> bool:
        return not self.live

    def wait(self, timeout: float) -> None:
        return None

    def stop(self) -> None:
        self.stopped = True


def test_follow_run_reads_the_finished_runs_log_from_its_stream(tmp_path: Path) -> None:
    log_path, streams = tmp_path / "run.log", []

    def open_stream() -> _FakeStream:
        streams.append(_FakeStream(log_path, "\x1b[92mINFO\x1b[0m: round 1\n"))
        return streams[-1]

    run = flwr.follow_run(tmp_path, "c", 7, log_path, deadline=time.monotonic() + 30, poll_interval=0.1,
                          status_of=lambda run_id: ("finished:completed", ""), open_stream=open_stream)
    assert (run.status, run.finished, run.timed_out, run.log) == ("finished:completed", True, False, "INFO: round 1\n")
    assert len(streams) == 1 and streams[0].stopped


def test_follow_run_reopens_a_broken_stream_and_names_why_when_the_run_does_not_finish(tmp_path: Path) -> None:
    log_path, streams = tmp_path / "run.log", []

    def open_stream() -> _FakeStream:
        streams.append(_FakeStream(log_path, "", error="ReadError: reset"))
        return streams[-1]

    run = flwr.follow_run(tmp_path, "c", 7, log_path, deadline=time.monotonic() + 2.5, poll_interval=0.1,
                          status_of=lambda run_id: ("running", ""), open_stream=open_stream)
    assert run.timed_out and not run.finished and run.status == "running"
    assert run.details == "log stream: ReadError: reset"
    assert len(streams) >= 2 and all(stream.stopped for stream in streams[-1:])


@pytest.mark.parametrize("live", [False, True], ids=["stream-reopened", "stream-open"])
def test_follow_run_stops_once_the_app_says_it_ended_without_waiting_for_flowers_status(
        tmp_path: Path, live: bool) -> None:
    log_path, calls, streams = tmp_path / "run.log", [], []

    def ended() -> str | None:
        calls.append(time.monotonic())
        return "\x1b[92mINFO\x1b[0m: the end\n" if len(calls) >= 3 else None

    def open_stream() -> _FakeStream:  # a reopened stream starts its file again: not the log returned
        streams.append(_FakeStream(log_path, "", live=live))
        return streams[-1]

    run = flwr.follow_run(tmp_path, "c", 7, log_path, deadline=time.monotonic() + 30, poll_interval=0.1,
                          status_of=lambda run_id: ("running", ""), ended=ended, open_stream=open_stream)
    assert (run.status, run.details, run.timed_out, run.finished) == (flwr.ENDED, flwr.ENDED_DETAILS, False, False)
    assert run.log == "INFO: the end\n" and len(calls) == 3 and streams[-1].stopped
    assert len(streams) == (1 if live else 3)
    # an app that never says so: Flower's status and log, as without `ended`
    run = flwr.follow_run(tmp_path, "c", 7, log_path, deadline=time.monotonic() + 30, poll_interval=0.1,
                          status_of=lambda run_id: ("finished:failed", "boom"), ended=lambda: None,
                          open_stream=lambda: _FakeStream(log_path, "INFO: round 1\n"))
    assert (run.status, run.details, run.timed_out, run.log) == ("finished:failed", "boom", False, "INFO: round 1\n")


def test_a_serverapp_has_ended_once_its_file_is_written_and_its_line_has_reached_the_log(tmp_path: Path) -> None:
    from fedact_app.serverapp_done import done_line

    log_path, done_dir = tmp_path / "run.log", tmp_path / "done"
    done_dir.mkdir()
    ended = engine.serverapp_ended(done_dir, 12, log_path)
    assert ended() is None  # neither
    log_path.write_text(f"INFO: \x1b[92m{done_line(12, 'a1')}\x1b[0m\n")
    assert ended() is None  # the line, not the file
    (done_dir / "12").write_text("")
    assert ended() is None  # a file without its token
    (done_dir / "12").write_text("a1")
    log_path.write_text(f"INFO: {done_line(1, 'a1')}\nINFO: {done_line(123, 'a1')}\nINFO: {done_line(12, 'b2')}\n")
    assert ended() is None  # the file, and only other runs' lines or another token (a line printed by a client)
    log = f"INFO: round 3\nINFO: \x1b[92m{done_line(12, 'a1')}\x1b[0m\n"
    log_path.write_text(log)
    assert ended() == log


def test_a_shared_cluster_engine_admits_a_run_once_the_others_ended_and_caps_the_runs_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LocalEngine._claim with its processes faked healthy: a second run waits while the first is
    unsubmitted or its ServerApp has not written its file, a third waits while two are in flight."""
    import threading

    from fedact_app.serverapp_done import DONE_DIR_ENV

    eng = engine.LocalEngine(max_parallel=2, shared_ray=True)
    monkeypatch.setattr(eng, "_healthy", lambda: True)
    eng.env = {DONE_DIR_ENV: str(tmp_path)}
    first, _ = eng._claim()
    claimed: list[object] = []

    def claim() -> None:
        try:
            claimed.append(eng._claim()[0])
        except launch.LaunchError:
            claimed.append(None)

    second = threading.Thread(target=claim)
    second.start()
    second.join(0.6)
    assert second.is_alive() and not claimed  # the first is not even submitted
    eng._in_flight[first] = 5
    second.join(0.6)
    assert second.is_alive()  # submitted, its ServerApp still running
    (tmp_path / "5").touch()
    second.join(10)
    assert not second.is_alive() and claimed[0] is not None
    eng._in_flight[claimed[0]] = 6
    (tmp_path / "6").touch()
    third = threading.Thread(target=claim)
    third.start()
    third.join(0.6)
    assert third.is_alive()  # max_parallel=2 in flight, both ended: still capped
    eng._closed = True
    third.join(10)
    assert not third.is_alive() and claimed[1:] == [None]


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pyproject.toml"):
        run_simulation(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    with pytest.raises(ValueError, match="num_cpus_per_client"):
        run_simulation(tmp_path, num_cpus_per_client=0.5)  # type: ignore[arg-type]
    assert launch.main(["--app", str(tmp_path / "missing")]) == 2


def test_fedact_config_is_checked_before_anything_starts(tmp_path: Path, capsys) -> None:
    """For this app (its conf/config.yaml) the launcher composes the overrides itself: a bad value
    or a SuperNode count other than num_clients fails at once, naming them; the count defaults
    to num_clients. Another app keeps the given count (default 2)."""
    assert launch.clients_of(launch.app_config(REPO_ROOT, "num_clients=4"), None) == 4
    assert launch.clients_of(launch.app_config(REPO_ROOT, "num_clients=4"), 4) == 4
    with pytest.raises(ValueError, match=r"--num-supernodes 3 differs from num_clients=4.*--num-supernodes 4"):
        launch.clients_of(launch.app_config(REPO_ROOT, "num_clients=4"), 3)
    with pytest.raises(ValueError, match=r"algorithm.lr=abc.*could not be converted to Float"):
        launch.clients_of(launch.app_config(REPO_ROOT, "algorithm.lr=abc"), None)
    app = tmp_path / "other-checkout"  # the app's own conf/ is read, not the installed package's
    shutil.copytree(REPO_ROOT / "conf", app / "conf")
    config = app / "conf" / "config.yaml"
    config.write_text(config.read_text().replace("\nnum_clients: 10", "\nnum_clients: 7"))
    (app / "fedact_app").mkdir()
    (app / "fedact_app" / "config.py").write_text("")
    assert launch.clients_of(launch.app_config(app, ""), None) == 7
    assert launch.clients_of(launch.app_config(tmp_path, "anything at all"), None) == 2
    other = tmp_path / "another-hydra-app"  # a conf/config.yaml of its own is not FedACT's
    (other / "conf").mkdir(parents=True)
    (other / "conf" / "config.yaml").write_text("lr: 0.1\n")
    assert launch.clients_of(launch.app_config(other, "lr=abc"), None) == 2
    assert launch.clients_of(launch.app_config(tmp_path, ""), 5) == 5
    assert launch.main(["--app", str(REPO_ROOT), "--overrides", "algorithm.tau=0"]) == 2
    assert "config error: Invalid config value algorithm.tau=0.0" in capsys.readouterr().err
    # overrides given as a --run-config key are what the run gets, so they are what is checked
    assert launch.main(["--app", str(REPO_ROOT), "--run-config", 'overrides="num_clients=4"',
                        "--num-supernodes", "3"]) == 2
    assert "--num-supernodes 3 differs from num_clients=4" in capsys.readouterr().err


def _data_folders(root: Path) -> None:
    """Under ``root``: good/ and broken/ (train.parquet and test.parquet, broken's test file cut off
    before its footer), empty/, and images/ (train/cat/ and test/cat/, no image in them)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("good", "broken"):
        (root / name).mkdir()
        for split in ("train", "test"):
            pq.write_table(pa.table({"image": [b"", b""], "label": [0, 1]}), root / name / f"{split}.parquet")
    data = (root / "broken" / "test.parquet").read_bytes()
    (root / "broken" / "test.parquet").write_bytes(data[: len(data) // 2])
    (root / "empty").mkdir()
    for split in ("train", "test"):
        (root / "images" / split / "cat").mkdir(parents=True)


@pytest.mark.parametrize("bad, why", [
    ("resume=no-run", "does not exist"),
    ("dataset.path=missing", "does not exist"),
    ("dataset.path=broken", "test.parquet is not a readable parquet file"),
    ("dataset.path=empty", "no parquet files"),
    ("dataset.path=images", "'train' split holds no files"),
])
def test_a_path_the_run_cannot_read_fails_before_anything_starts(bad: str, why: str, tmp_path: Path,
                                                                 monkeypatch, capsys) -> None:
    """The launcher refuses it naming the key and value (exit 2) and starts no SuperLink, where
    the run would fail only after its start (20-36 s) with the library's message."""
    _data_folders(tmp_path)
    key, _, name = bad.partition("=")
    value = tmp_path / name
    monkeypatch.setattr(launch, "run_simulation", lambda *a, **k: pytest.fail("a run was started"))
    overrides = f"{key}={value}" if key == "resume" else f"dataset=cifar10 {key}={value}"
    assert launch.main(["--app", str(REPO_ROOT), "--overrides", overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: Invalid config value {key}='{value}': allowed ") and why in err


def test_readable_dataset_paths_pass_the_launchers_check(tmp_path: Path) -> None:
    _data_folders(tmp_path)
    for split in ("train", "test"):
        (tmp_path / "images" / split / "cat" / "a.png").write_bytes(b"")
    for path in ("good", "good/train.parquet", "images"):
        cfg = launch.app_config(REPO_ROOT, f"dataset=cifar10 dataset.path={tmp_path / path}")
        assert launch.clients_of(cfg, None) == 10


def test_pid_alive() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    assert pid_alive(proc.pid) or proc.poll() is not None
    proc.wait()
    assert not pid_alive(proc.pid)
    assert pid_alive(os.getpid())


def test_stop_tree_kills_what_it_noted_and_spares_a_process_given_a_noted_pid_later() -> None:
    """Linux reuses pids (pid_max is often 32768, threads included): a pid noted as part of a
    tree may belong to another process when the tree is stopped, and must not be signalled."""
    import time

    from fedact_app.cli import procs

    daemon = "import subprocess, time; subprocess.Popen(['sleep', '60'], start_new_session=True); time.sleep(60)"
    root = subprocess.Popen([sys.executable, "-c", daemon])
    other = subprocess.Popen(["sleep", "60"])  # stands for a process that got a noted pid later
    try:
        deadline = time.monotonic() + 30
        while not (tree := procs.descendants(root.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = tree  # in its own session: it outlives root unless stop_tree finds it
        procs._START_TIMES[other.pid] = procs.start_time(other.pid) - 1  # noted: an earlier process
        procs.stop_tree(root, tree | {other.pid}, grace=2.0)
        assert root.poll() is not None and not pid_alive(child)
        assert other.poll() is None, "a process holding a reused pid was signalled"
    finally:
        for proc in (root, other):
            proc.kill()
            proc.wait()


def test_stop_tree_without_grace_kills_the_whole_tree_without_a_sigterm(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """grace 0 (a run whose ServerApp has ended): no process gets the SIGTERM it would handle,
    not even one in a session of its own, and all are gone when stop_tree returns."""
    from fedact_app.cli import procs

    handler = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: "
               "pathlib.Path(sys.argv[1] + '.sigterm').touch()); pathlib.Path(sys.argv[1] + '.ready').touch(); "
               "time.sleep(60)")
    daemon = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {handler!r}, "
              f"sys.argv[1] + '-child'], start_new_session=True); exec({handler!r})")
    root = subprocess.Popen([sys.executable, "-c", daemon, str(tmp_path / "root")])
    sent = []  # every signal os.kill and os.killpg send, processes' handlers or not
    for name in ("kill", "killpg"):
        monkeypatch.setattr(os, name, lambda pid, sig, send=getattr(os, name): (sent.append(sig), send(pid, sig))[1])
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.ready"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # both handle SIGTERM from here on
        tree = procs.descendants(root.pid)
        pids = procs.stop_tree(root, set(), grace=0)
        assert len(tree) == 1 and set(tree) <= set(pids) and root.poll() is not None
        assert [p for p in pids if pid_alive(p)] == []
        assert signal.SIGKILL in sent and signal.SIGTERM not in sent, sent
        assert sorted(p.name for p in tmp_path.iterdir()) == ["root-child.ready", "root.ready"], "SIGTERM sent"
    finally:
        for pid in procs.descendants(root.pid) if root.poll() is None else ():
            procs.kill_quietly(pid, 9)
        root.kill()
        root.wait()


def test_sigterm_becomes_system_exit_during_a_run() -> None:
    import signal

    session_handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the session's engine set one
    try:
        restore = engine.exit_on_termination()
        try:
            with pytest.raises(SystemExit) as info:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(100):  # the handler runs between bytecodes
                    launch.time.sleep(0.01)
            assert info.value.code == 128 + signal.SIGTERM
        finally:
            restore()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, session_handler)


@pytest.mark.parametrize("shared_ray", [True, False])
@pytest.mark.parametrize("given", [{}, {"RAY_prestart_worker_first_driver": "1"}])
def test_the_engine_starts_ray_without_idle_workers_ahead_of_flowers_actors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_ray: bool, given: dict[str, str]) -> None:
    """The SuperLink (so each run's own Ray cluster) and a shared Ray head get the Ray setting that
    turns off the idle workers Ray starts for its first driver, which Flower's runtime-env actors
    never use; a value the caller gives wins."""
    from types import SimpleNamespace

    started: dict[str, dict[str, str]] = {}

    def ray_start(num_cpus, num_gpus, env):
        started["ray"] = dict(env)
        return SimpleNamespace(address="127.0.0.1:1", stop=lambda **_: None)

    def link_start(home, env, cwd, deadline):
        started["superlink"] = dict(env)
        return SimpleNamespace(port=1, stop=lambda **_: None)

    monkeypatch.setattr(engine.RayCluster, "start", ray_start)
    monkeypatch.setattr(engine.SimulationSuperLink, "start", link_start)
    monkeypatch.setattr(engine.flwr, "ControlClient", lambda address: None)
    monkeypatch.delenv("RAY_prestart_worker_first_driver", raising=False)
    engine.LocalEngine(shared_ray=shared_ray, flwr_home=tmp_path, env=given)._start()
    assert set(started) == ({"ray", "superlink"} if shared_ray else {"superlink"})
    for env in started.values():
        assert env["RAY_prestart_worker_first_driver"] == given.get("RAY_prestart_worker_first_driver", "0")


@pytest.mark.parametrize("users", [{}, {"MALLOC_TRIM_THRESHOLD_": "131072"}])
def test_the_engine_has_its_processes_keep_freed_memory_unless_the_user_says_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, users: dict[str, str]) -> None:
    """Every process the engine starts (the SuperLink, so the ServerApps and Ray's actors, and a
    shared Ray head) gets glibc's malloc settings that keep freed memory for the next message
    (thresholds of 4 GiB, 2**32) on glibc 2.36, and nothing of them where the user set one."""
    from types import SimpleNamespace

    started: dict[str, dict[str, str]] = {}
    monkeypatch.setattr(engine.RayCluster, "start", lambda num_cpus, num_gpus, env: (
        started.setdefault("ray", dict(env)), SimpleNamespace(address="127.0.0.1:1", stop=lambda **_: None))[1])
    monkeypatch.setattr(engine.SimulationSuperLink, "start", lambda home, env, cwd, deadline: (
        started.setdefault("superlink", dict(env)), SimpleNamespace(port=1, stop=lambda **_: None))[1])
    monkeypatch.setattr(engine.flwr, "ControlClient", lambda address: None)
    monkeypatch.setattr(procs, "glibc_version", lambda: (2, 36))
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in users.items():
        monkeypatch.setenv(name, value)
    engine.LocalEngine(shared_ray=True, flwr_home=tmp_path)._start()
    assert set(started) == {"ray", "superlink"}
    for env in started.values():
        assert env.get("MALLOC_MMAP_THRESHOLD_") == (None if users else "4294967296")
        assert env.get("MALLOC_TRIM_THRESHOLD_") == users.get("MALLOC_TRIM_THRESHOLD_", "4294967296")


@pytest.mark.parametrize("version, environ, wanted", [
    ((2, 36), {}, True),
    ((2, 39), {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"}, True),  # another tunable: not malloc's
    ((2, 34), {}, False),  # refuses a 4 GiB mmap threshold: only the trim would stay
    (None, {}, False),  # musl, macOS: not glibc
    ((2, 36), {"MALLOC_MMAP_THRESHOLD_": "131072"}, False),  # the user's choice, kept whole
    ((2, 36), {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, False),
])
def test_the_malloc_settings_go_only_where_they_work_and_the_user_set_none(monkeypatch, version, environ, wanted):
    monkeypatch.setattr(procs, "glibc_version", lambda: version)
    assert procs.malloc_env(environ) == (
        {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"} if wanted else {})


def test_the_control_clients_requests_are_not_logged_at_info_unless_the_caller_set_httpx_s_level():
    """A followed run's status is asked for twice a second; at INFO (Hydra's logging in a sweep)
    httpx would log each request. A level the caller gave the ``httpx`` logger stays."""
    import logging

    httpx_logger = logging.getLogger("httpx")
    before = httpx_logger.level
    try:
        httpx_logger.setLevel(logging.NOTSET)
        flwr._control_http_client("127.0.0.1:9").close()  # no connection is made until a call
        assert httpx_logger.level == logging.WARNING
        httpx_logger.setLevel(logging.DEBUG)
        flwr._control_http_client("127.0.0.1:9").close()
        assert httpx_logger.level == logging.DEBUG
    finally:
        httpx_logger.setLevel(before)
