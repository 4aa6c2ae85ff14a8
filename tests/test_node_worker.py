"""The warm worker (fedact_app.node_worker) as the ClientApp process uses it, without Flower's
processes: replies equal to the cold ones, its ends, its faults, and what it refuses.
tests/test_deploy.py runs it through real SuperNodes."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict

from fedact_app import client_app, client_work
from fedact_app.cli import procs
from fedact_app.cli.procs import pid_alive, start_time
from fedact_app.config import compose
from fedact_app.node_config import switch, worker_idle_timeout
from fedact_app.node_worker import channel, forward
from fedact_app.tasks.vision.models import build_model
from fedact_app.wire import packed_record, unpacked

pytestmark = pytest.mark.timeout(300)
# SCAFFOLD: the client keeps c_i in its Context.state, which must travel to the worker and back
RUN = "algorithm=scaffold num_clients=2 local_steps=3 batch_size=16 device=cpu"


def context(run_id=5, partition_id=0, overrides=RUN, **node_config):
    return Context(run_id=run_id, node_id=100 + partition_id, state=RecordDict(),
                   node_config={"partition-id": partition_id, "num-partitions": 2, **node_config},
                   run_config={"overrides": overrides})


def train_message(server_round, overrides=RUN, run_id=5, partition_id=0):
    cfg = compose(overrides)
    torch.manual_seed(server_round)
    model = build_model(cfg.model, cfg.dataset)
    trainable = [n for n, _ in model.named_parameters()]
    x = model.state_dict()
    c = {n: torch.full_like(x[n], 0.01 * server_round) for n in trainable}
    metadata = Metadata(run_id=run_id, message_id=f"m{server_round}", src_node_id=0,
                        dst_node_id=100 + partition_id, reply_to_message_id="", group_id=str(server_round),
                        created_at=time.time(), ttl=43200.0, message_type="train")
    content = RecordDict({"model": packed_record(x), "c": packed_record(c), "config": ConfigRecord(
        {"server-round": server_round, "local-steps": 3, "lr": 0.05, "global-step": 3 * (server_round - 1)})})
    return Message(metadata=metadata, content=content)


def arrays(record_dict):
    return {key: unpacked(record) for key, record in record_dict.array_records.items()}


def assert_same_reply(warm, cold):
    assert not warm.has_error() and not cold.has_error(), (warm.error if warm.has_error() else cold.error)
    a, b = arrays(warm.content), arrays(cold.content)
    assert a.keys() == b.keys() == {"delta", "delta_c"}
    for key in a:
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), (key, name)
    wm, cm = dict(warm.content["metrics"]), dict(cold.content["metrics"])
    for clock in ("train-seconds", "work-start"):  # each message's own clock
        assert wm.pop(clock) >= 0 and cm.pop(clock) >= 0
    assert wm == cm
    assert warm.metadata.reply_to_message_id == cold.metadata.reply_to_message_id


def worker_pids(folder: Path) -> list[int]:
    return sorted(json.loads(p.read_text())["pid"] for p in folder.glob("*.json"))


def test_the_clientapp_imports_neither_torch_nor_timm_nor_hydra():
    code = ("import sys, fedact_app.client_app; "
            "print([m for m in ('torch', 'timm', 'hydra', 'fedact_app.client_work') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_warm_replies_and_kept_state_equal_the_cold_ones_round_after_round(workers):
    warm, cold = context(), context()
    forward.prepare(warm)
    for server_round in (1, 2, 3):
        warm_reply = forward.forward("train", train_message(server_round), warm)
        cold_reply = client_work.run_message("train", train_message(server_round), cold)
        assert_same_reply(warm_reply, cold_reply)
        kept_warm, kept_cold = arrays(warm.state), arrays(cold.state)  # SCAFFOLD's c_i
        assert kept_warm.keys() == kept_cold.keys() == {"client_state.c_i"}
        for name, tensor in kept_warm["client_state.c_i"].items():
            assert torch.equal(tensor, kept_cold["client_state.c_i"][name])
    assert len(worker_pids(workers)) == 1  # one worker served all three rounds
    ev_warm = forward.forward("evaluate", train_message(4), warm)
    ev_cold = client_work.run_message("evaluate", train_message(4), cold)
    assert dict(ev_warm.content["metrics"]) == dict(ev_cold.content["metrics"])


def test_the_clientapp_falls_back_to_cold_where_the_folder_is_unsafe(workers, monkeypatch):
    monkeypatch.setattr(forward, "wanted", lambda ctx: True)  # as in a flwr-clientapp process
    workers.mkdir(mode=0o755)
    os.chmod(workers, 0o755)
    with pytest.raises(channel.UnsafeChannel, match=rf"{workers} has mode 755.*chmod 700 {workers}"):
        channel.private_dir()
    reply = client_app.train(train_message(1), context())
    assert_same_reply(reply, client_work.run_message("train", train_message(1), context()))
    assert not list(workers.iterdir())  # no worker, no socket

    os.chmod(workers, 0o700)
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    with pytest.raises(channel.UnsafeChannel, match=rf"{workers} belongs to uid \d+, not to this user \(uid 4242\)"):
        channel.private_dir()


def test_a_link_a_file_or_a_foreign_socket_is_refused_naming_its_path(workers, monkeypatch):
    target = workers.parent / "elsewhere"
    target.mkdir(mode=0o700)
    workers.symlink_to(target)
    with pytest.raises(channel.UnsafeChannel, match=f"{workers} is not a folder"):
        channel.private_dir()
    workers.unlink()
    workers.mkdir(mode=0o700)
    fake = workers / "fake.sock"
    fake.write_text("")
    with pytest.raises(channel.UnsafeChannel, match=f"{fake} is not a socket"):
        channel.check_socket(fake)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(workers / "real.sock"))
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    with pytest.raises(channel.UnsafeChannel, match=f"{workers / 'real.sock'} belongs to uid"):
        channel.check_socket(workers / "real.sock")
    listener.close()


def test_two_runs_on_one_node_get_two_workers_and_a_request_for_another_is_refused(workers):
    first, second = context(run_id=5), context(run_id=6)
    for ctx, run_id in ((first, 5), (second, 6)):
        reply = forward.forward("train", train_message(1, run_id=run_id), ctx)
        assert not reply.has_error(), reply.error
    assert len(worker_pids(workers)) == 2
    (sock_path, *_) = sorted(workers.glob("*.sock"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(sock_path))
        channel.send_frames(sock, {"key": "another-run", "kind": "train"}, b"", b"")
        header, _ = channel.recv_frames(sock)
    assert "serves another run or node" in header["refused"]


def test_a_worker_killed_mid_message_fails_that_message_and_the_next_starts_a_new_one(workers, monkeypatch):
    hang = f"{RUN} debug.fail_partitions=[0] debug.fail_rounds=[1] debug.hang_seconds=60"
    warm, cold = context(overrides=hang), context(overrides=hang)
    forward.forward("train", train_message(2, hang), warm)  # a worker, warm
    client_work.run_message("train", train_message(2, hang), cold)
    (first,) = worker_pids(workers)
    outcome = {}

    def round_one():
        try:
            outcome["reply"] = forward.forward("train", train_message(1, hang), warm)
        except forward.WorkerLost as err:
            outcome["lost"] = str(err)

    taken = threading.Event()  # the worker acknowledged the message: it is working on it

    def recv_and_tell(sock):
        frames = receive(sock)
        taken.set()
        return frames

    receive = forward.recv_frames
    monkeypatch.setattr(forward, "recv_frames", recv_and_tell)
    thread = threading.Thread(target=round_one)
    thread.start()
    assert taken.wait(timeout=60)
    time.sleep(0.5)  # in the message's debug.hang_seconds
    os.kill(first, signal.SIGKILL)
    thread.join(timeout=30)
    assert f"warm worker (pid {first}) ended while working on the message" in outcome.get("lost", ""), outcome
    assert list(workers.glob("*.sock"))  # the killed worker's socket file is left: stale
    reply = forward.forward("train", train_message(3, hang), warm)
    assert_same_reply(reply, client_work.run_message("train", train_message(3, hang), cold))
    (second,) = [pid for pid in worker_pids(workers) if pid_alive(pid)]
    assert second != first


def test_a_hung_worker_is_stopped_after_the_messages_deadline(workers, monkeypatch):
    monkeypatch.setattr(forward, "REPLY_GRACE", 0.5)
    hang = f"{RUN} round_timeout=4 debug.fail_partitions=[0] debug.fail_rounds=[1] debug.hang_seconds=60"
    warm = context(overrides=hang)
    warm_up = forward.forward("train", train_message(2, hang), warm)  # the worker starts, and stays warm
    # where its start outlasts the 4 s round_timeout (a loaded machine), it skips this first message
    assert not warm_up.has_error() or "reached the node" in warm_up.error.reason, warm_up.error
    started = time.monotonic()
    with pytest.raises(forward.WorkerLost, match="still working on the message 0.5 s after its deadline"):
        forward.forward("train", train_message(1, hang), warm)
    assert time.monotonic() - started < 30
    time.sleep(0.5)
    assert not any(pid_alive(pid) for pid in worker_pids(workers))


def serve(folder: Path, watch_pid: int, idle: float) -> tuple[subprocess.Popen, Path]:
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / "w.sock"
    proc = subprocess.Popen([sys.executable, "-m", "fedact_app.node_worker.serve", "--socket", str(path),
                             "--key", "k", "--run-id", "1", "--node-id", "2", "--watch-pid", str(watch_pid),
                             "--watch-start", str(start_time(watch_pid)), "--idle", str(idle)])
    deadline = time.monotonic() + 30
    while not channel.info_path(path).exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return proc, path


def test_a_worker_ends_with_its_supernode_and_after_its_idle_time(workers):
    supernode = subprocess.Popen(["sleep", "120"])
    proc, path = serve(workers, supernode.pid, idle=600)
    supernode.kill()
    supernode.wait()
    assert proc.wait(timeout=15) == 0
    assert not path.exists() and not channel.info_path(path).exists()

    proc, path = serve(workers, os.getpid(), idle=1.0)
    assert proc.wait(timeout=15) == 0
    assert not path.exists()


def test_a_second_worker_for_a_taken_socket_leaves_the_first_serving(workers):
    proc, path = serve(workers, os.getpid(), idle=600)
    second = subprocess.run([sys.executable, "-m", "fedact_app.node_worker.serve", "--socket", str(path),
                             "--key", "k", "--run-id", "1", "--node-id", "2", "--watch-pid", str(os.getpid()), "--watch-start",
                             str(start_time(os.getpid())), "--idle", "600"], capture_output=True, text=True,
                            timeout=60)
    assert second.returncode == 0 and "not started" in second.stderr
    assert proc.poll() is None and path.exists()
    proc.terminate()
    assert proc.wait(timeout=15) == 0 and not path.exists()  # SIGTERM: it removes its socket


def test_the_switches_and_the_idle_time_are_checked(monkeypatch):
    assert not forward.wanted(context())  # not a flwr-clientapp process: simulation, tests
    monkeypatch.setattr(sys, "argv", ["/usr/bin/flwr-clientapp", "--token", "t"])
    assert forward.wanted(context())
    assert not forward.wanted(context(**{"warm-worker": False}))
    assert not forward.wanted(context(**{"warm-worker": "off"}))
    monkeypatch.setenv(forward.WARM_WORKER_ENV, "0")
    assert not forward.wanted(context())
    monkeypatch.setenv(forward.WARM_WORKER_ENV, "maybe")
    with pytest.raises(ValueError, match="FEDACT_WARM_WORKER='maybe': expected true/false"):
        forward.wanted(context())
    assert switch(1, "x") and not switch("No", "x")
    assert worker_idle_timeout({}) == 600.0 and worker_idle_timeout({"warm-worker-idle": 30}) == 30.0
    for bad in (0, -1, "soon", float("inf")):
        with pytest.raises(ValueError, match="warm-worker-idle=.*expected a number of seconds > 0"):
            worker_idle_timeout({"warm-worker-idle": bad})


def test_a_socket_path_too_long_is_refused_with_the_setting_to_change(tmp_path):
    with pytest.raises(ValueError, match=f"longer than a Unix socket path may be.*{channel.WORKER_DIR_ENV}"):
        channel.socket_path(tmp_path / ("x" * 120), "k" * 32)


@pytest.mark.parametrize("users", [{}, {"MALLOC_MMAP_THRESHOLD_": "131072"}])
def test_a_warm_worker_keeps_freed_memory_unless_the_nodes_environment_says_otherwise(monkeypatch, users):
    """The worker a ClientApp starts gets glibc's malloc settings that keep freed memory for the
    next message (4 GiB thresholds) on glibc 2.36, and nothing of them where the SuperNode's
    environment set one."""
    started = {}

    class Recorded:
        def __init__(self, command, env, **kwargs):
            started.update(env)

    monkeypatch.setattr(forward.subprocess, "Popen", Recorded)
    monkeypatch.setattr(forward, "_STARTED", [])
    monkeypatch.setattr(procs, "glibc_version", lambda: (2, 36))
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in users.items():
        monkeypatch.setenv(name, value)
    forward._start(Path("/tmp/none.sock"), "key", context(), (os.getpid(), 0))
    assert started.get("MALLOC_TRIM_THRESHOLD_") == (None if users else "4294967296")
    assert started.get("MALLOC_MMAP_THRESHOLD_") == users.get("MALLOC_MMAP_THRESHOLD_", "4294967296")


def test_a_message_crosses_the_socket_as_its_protobuf_and_its_arrays_bytes_unchanged():
    """frames.message_blobs: the protobuf holds no array's bytes; the message read back equals
    the one sent (metadata, records in order, every array's dtype, shape and bytes), an error
    message too; blobs that do not match its arrays are refused."""
    from flwr.app import Error
    from fedact_app.node_worker.frames import message_blobs, message_from_blobs

    msg = train_message(2)
    blobs = message_blobs(msg)
    sizes = [len(array.data) for record in msg.content.array_records.values() for array in record.values()]
    assert [len(blob) for blob in blobs[1:]] == sizes and len(blobs[0]) < 4096 < sum(sizes)
    back = message_from_blobs(blobs)
    assert back.metadata == msg.metadata and list(back.content.keys()) == list(msg.content.keys())
    for key, record in msg.content.array_records.items():
        assert list(back.content[key].keys()) == list(record.keys())
        for name, array in record.items():
            got = back.content[key][name]
            assert (got.dtype, got.shape, got.stype, got.data) == (array.dtype, array.shape, array.stype, array.data)
    assert dict(back.content["config"]) == dict(msg.content["config"])
    failed = Message(Error(7, "it failed"), reply_to=msg)
    assert message_from_blobs(message_blobs(failed)).error.reason == "it failed"
    with pytest.raises(ValueError, match=r"of \d+ arrays came with 1 array blobs"):
        message_from_blobs(blobs[:2])


def test_records_the_other_end_holds_cross_empty_and_come_back_from_it():
    """frames.message_blobs(omit=...): the model goes without its bytes; the receiving end puts
    back the record it holds, in its place; a record to be put back that came with arrays, or
    did not come, is refused."""
    from fedact_app.node_worker.frames import message_blobs, message_from_blobs

    msg = train_message(2)
    blobs = message_blobs(msg, omit=["model"])
    c_bytes = len(msg.content["c"]["float32"].data)
    assert len(blobs) == 1 + len(msg.content["c"]) and sum(map(len, blobs)) < 4096 + c_bytes
    back = message_from_blobs(blobs, shared={"model": msg.content["model"]})
    assert list(back.content.keys()) == list(msg.content.keys()) and back.content["model"] is msg.content["model"]
    assert [a.data for a in back.content["c"].values()] == [a.data for a in msg.content["c"].values()]
    with pytest.raises(ValueError, match=r"\['c'\] were to be left out, and are missing or came with arrays"):
        message_from_blobs(blobs, shared={"model": msg.content["model"], "c": msg.content["c"]})
    with pytest.raises(ValueError, match=r"\['v_bar'\] were to be left out"):
        message_from_blobs(blobs, shared={"model": msg.content["model"], "v_bar": msg.content["c"]})
    with pytest.raises(ValueError, match=r"\['config'\] to leave out are not array records of the message"):
        message_blobs(msg, omit=["config"])


def test_the_batching_worker_takes_an_offered_message_only_with_records_of_its_own_round(workers):
    """The offer's checks (fedact_app.node_worker.worker): a round that is not [run, round], or
    records left out that the worker does not hold, are refused with the reason; a message sent
    without the records of the round it was offered for, but of another round, raises; the
    worker keeps the latest rounds' records, the same objects as the message's."""
    from flwr.common.serde import context_to_proto

    from fedact_app.node_worker.frames import message_blobs
    from fedact_app.node_worker.worker import KEPT_BROADCASTS, Worker

    workers.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = workers / "w.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    worker = Worker(listener, path, "k", "test", (os.getpid(), 0), 60.0, batched=True)

    def exchange(*frame_sets):
        """Serve one connection that sends ``frame_sets`` in turn: what the worker answered."""
        ours, theirs = socket.socketpair()
        serving = threading.Thread(target=worker._serve_one, args=(theirs, None))
        serving.start()
        answers = []
        with ours:
            for header, *blobs in frame_sets:
                channel.send_frames(ours, header, *blobs)
                answers.append(channel.recv_frames(ours)[0])
                if "have" not in answers[-1]:
                    break
        serving.join(10)
        return answers

    assert exchange(({"key": "k", "kind": "train", "round": [5, [2]]},))[0]["refused"].endswith(
        "not [run, server-round]")
    second, third = train_message(2), train_message(3)
    worker._keep_broadcast(second)
    assert worker.broadcasts[(5, 2)]["model"] is second.content["model"]
    context_blob = context_to_proto(context()).SerializeToString()
    answers = exchange(({"key": "k", "kind": "train", "round": [5, 3]},),
                       ({"omitted": ["model"]}, context_blob, *message_blobs(third, ["model"])))
    assert answers[0] == {"have": []} and "does not hold: ['model']" in answers[1]["refused"]
    answers = exchange(({"key": "k", "kind": "train", "round": [5, 2]},),
                       ({"omitted": ["model"]}, context_blob, *message_blobs(third, ["model"])))
    assert sorted(answers[0]["have"]) == ["c", "model"]
    assert answers[1]["raised"] == "ValueError: a message of round (5, 3) was offered for round (5, 2)"
    for server_round in (3, 4, 1):  # a straggler of an older round does not push a newer one out
        worker._keep_broadcast(train_message(server_round))
    assert sorted(worker.broadcasts) == [(5, 4 - n) for n in reversed(range(KEPT_BROADCASTS))]
    listener.close()
