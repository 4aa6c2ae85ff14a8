"""``client_batch=true`` without Flower's processes: the gathering of a round's training messages
(``node_worker.gather``), their replies trained at once (``client_work.train_contents``), and the
machine's batching worker that the ClientApps hand them to. tests/test_reproducible_e2e.py runs
it through a real simulation."""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, Metadata, RecordDict

from fedact_app import client_app, client_work
from fedact_app.client_work import InjectedFault
from fedact_app.config import compose
from fedact_app.node_worker import forward
from fedact_app.node_worker.gather import CLIENT_BATCH_KEY, ROUND_CLIENTS_KEY, Gather
from fedact_app.tasks.vision.models import build_model
from fedact_app.wire import packed_record, unpacked

pytestmark = pytest.mark.timeout(300)
RUN = "algorithm=fedact num_clients=3 local_steps=3 batch_size=16 device=cpu client_batch=true"


# ---------------------------------------------------------------- Gather, on plain items


class Recorder:
    """A batch's training function that records its batches and how many ran at once."""

    def __init__(self, fail_on=None, seconds=0.05):
        self.batches, self.running, self.most, self.threads = [], 0, 0, set()
        self.lock, self.fail_on, self.seconds = threading.Lock(), fail_on, seconds

    def __call__(self, items):
        with self.lock:
            self.batches.append(sorted(items))
            self.threads.add(threading.get_ident())
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        if self.fail_on in items:
            raise RuntimeError(f"batch with {self.fail_on}")
        return [ValueError(f"item {item}") if item < 0 else item * 10 for item in items]


def submit_all(gather, requests, spacing=0.0):
    """Submit (group, expected, wait, item) requests from threads of their own, ``spacing`` seconds
    apart; their outcomes (a result or the exception raised) and seconds from the first submit."""
    start = time.monotonic()

    def one(request):
        try:
            outcome = gather.submit(*request)
        except Exception as ex:  # noqa: BLE001
            outcome = ex
        return outcome, time.monotonic() - start

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = []
        for request in requests:
            futures.append(pool.submit(one, request))
            time.sleep(spacing)
        return [future.result() for future in futures]


def test_a_round_whose_messages_all_arrive_trains_them_in_one_batch_without_waiting():
    train = Recorder()
    outcomes = submit_all(Gather(train), [("r1", 4, 30.0, item) for item in (3, 1, 4, 2)], spacing=0.02)
    assert [result for result, _ in outcomes] == [30, 10, 40, 20]
    assert train.batches == [[1, 2, 3, 4]]
    assert max(seconds for _, seconds in outcomes) < 5  # far below the 30 s wait


def test_the_messages_that_came_train_after_the_wait_and_the_rest_of_the_round_later():
    """A round of 3 whose third message comes 1.5 s after the first two (a ClientApp busy with one
    of them): the two train after the 0.5 s wait, the third alone, without waiting again."""
    train = Recorder()
    gather = Gather(train)
    with ThreadPoolExecutor(1) as late:
        third = late.submit(lambda: (time.sleep(1.5), submit_all(gather, [("r", 3, 0.5, 7)]))[1][0])
        first_two = submit_all(gather, [("r", 3, 0.5, 5), ("r", 3, 0.5, 6)])
        assert [result for result, _ in first_two] == [50, 60]
        assert all(0.5 <= seconds < 1.4 for _, seconds in first_two)
        result, seconds = third.result()
    assert result == 70 and seconds < 1.0  # no second wait: the round is complete
    assert train.batches == [[5, 6], [7]]


def test_a_message_still_being_read_holds_the_partial_batch_back_and_a_dropped_one_does_not():
    """The worker takes a ticket as it accepts a connection: reading a large message can outlast
    the wait, and the message belongs in the batch."""
    train = Recorder()
    gather = Gather(train)

    def read_slowly(item, submit=True):
        with gather.arrival() as ticket:
            time.sleep(1.0)  # reading and decoding the message
            return gather.submit("r", 3, 0.2, item, ticket) if submit else None

    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(read_slowly, 2)
        time.sleep(0.05)
        (fast, seconds), = submit_all(gather, [("r", 3, 0.2, 1)])
        assert (fast, slow.result()) == (10, 20) and seconds >= 1.0
        assert train.batches == [[1, 2]]
        dropped = pool.submit(read_slowly, 4, submit=False)
        time.sleep(0.05)
        (alone, seconds), = submit_all(gather, [("q", 3, 0.2, 3)])
        # held back until the ticket closes, 0.95 s after this submit, not for ever
        assert dropped.result() is None and alone == 30 and 0.8 <= seconds < 3.0
    assert train.batches == [[1, 2], [3]]


def test_rounds_batch_apart_one_batch_at_a_time_on_one_thread_and_errors_stay_with_their_messages():
    train = Recorder(fail_on=99, seconds=0.2)
    gather = Gather(train)
    outcomes = submit_all(gather, [("a", 2, 30.0, 1), ("b", 2, 30.0, 2), ("a", 2, 30.0, -1), ("b", 2, 30.0, 3)])
    results = [outcome for outcome, _ in outcomes]
    assert results[0] == 10 and results[1] == 20 and results[3] == 30
    assert isinstance(results[2], ValueError) and str(results[2]) == "item -1"
    assert sorted(train.batches) == [[-1, 1], [2, 3]] and train.most == 1
    assert len(train.threads) == 1 and threading.get_ident() not in train.threads  # one thread of its own
    failed = submit_all(gather, [("c", 2, 30.0, 99), ("c", 2, 30.0, 8)])
    assert all(isinstance(outcome, RuntimeError) and "batch with 99" in str(outcome) for outcome, _ in failed)


def test_a_bad_round_size_or_wait_is_refused():
    gather = Gather(Recorder())
    with pytest.raises(ValueError, match="expected=0, wait=1"):
        gather.submit("r", 0, 1, 1)
    with pytest.raises(ValueError, match="expected=2, wait=0"):
        gather.submit("r", 2, 0, 1)


# ---------------------------------------------------------------- a round's messages trained at once


def context(partition_id, overrides=RUN):
    return Context(run_id=7, node_id=100 + partition_id, state=RecordDict(),
                   node_config={"partition-id": partition_id, "num-partitions": 3},
                   run_config={"overrides": overrides})


def train_message(partition_id, clients=3, overrides=RUN, server_round=2):
    """Round 2 of a FedACT run: x, v_bar and Delta_G from the server."""
    cfg = compose(overrides)
    torch.manual_seed(server_round)
    model = build_model(cfg.model, cfg.dataset)
    x = model.state_dict()
    named = list(model.named_parameters())
    metadata = Metadata(run_id=7, message_id=f"m{partition_id}", src_node_id=0, dst_node_id=100 + partition_id,
                        reply_to_message_id="", group_id=str(server_round), created_at=time.time(), ttl=43200.0,
                        message_type="train")
    content = RecordDict({
        "model": packed_record(x),
        "v_bar": packed_record({n: torch.rand_like(p) * 1e-4 for n, p in named}),
        "delta_g": packed_record({n: torch.randn_like(p) * 1e-2 for n, p in named}),
        "config": ConfigRecord({"server-round": server_round, "local-steps": 3, "lr": 3e-3, "global-step": 3,
                                CLIENT_BATCH_KEY: True, ROUND_CLIENTS_KEY: clients})})
    return Message(metadata=metadata, content=content)


def assert_close_replies(batched: RecordDict, alone: RecordDict, same_seconds: float | None = None):
    """The batched reply against the client's alone (``run_message``): the same records and
    metrics; Δ and v equal within float32's rounding of the batched products (measured on
    cnn_small: 1.6e-6 of the largest |Δ|)."""
    assert batched.array_records.keys() == alone.array_records.keys() == {"delta", "v"}
    for key in ("delta", "v"):
        got, want = unpacked(batched[key]), unpacked(alone[key])
        assert got.keys() == want.keys()
        scale = max(t.abs().max().item() for t in want.values())
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5 * scale, msg=lambda m: f"{key} {name}: {m}")
    got, want = dict(batched["metrics"]), dict(alone["metrics"])
    if same_seconds is not None:
        assert got["train-seconds"] == same_seconds
    for clock in ("train-seconds", "work-start"):
        assert got.pop(clock) > 0 and want.pop(clock) > 0
    assert got.pop("train-loss") == pytest.approx(want.pop("train-loss"), rel=1e-5)
    assert got == want


def test_a_rounds_messages_trained_at_once_reply_as_each_client_alone():
    items = [(train_message(p).content, context(p), time.time() + 600) for p in (2, 0, 1)]
    replies = client_work.train_contents(items)
    seconds = dict(replies[0]["metrics"])["train-seconds"]
    for p, reply in zip((2, 0, 1), replies):
        alone = client_work.run_message("train", train_message(p), context(p))
        assert not alone.has_error()
        assert dict(reply["metrics"])["partition-id"] == p
        assert_close_replies(reply, alone.content, same_seconds=seconds)


def test_a_bfloat16_run_replies_with_each_float32_value_rounded_to_bfloat16_alone_and_in_a_batch():
    """reply_dtype=bfloat16: the client trains as in float32 and sends each floating value of its
    reply rounded to bfloat16, as bfloat16's bits (int16: fedact_app.wire)."""
    in_bf16 = f"{RUN} reply_dtype=bfloat16"
    float32 = client_work.run_message("train", train_message(0), context(0)).content
    alone = client_work.run_message("train", train_message(0, overrides=in_bf16), context(0, in_bf16)).content
    batched = client_work.train_contents([(train_message(p, overrides=in_bf16).content, context(p, in_bf16),
                                           time.time() + 600) for p in (1, 0)])[1]
    for key in ("delta", "v"):
        want = unpacked(float32[key])
        assert all(t.dtype == torch.float32 for t in want.values())
        for reply in (alone, batched):
            got = unpacked(reply[key])
            assert got.keys() == want.keys() and all(t.dtype == torch.int16 for t in got.values())
        for name, t in want.items():
            assert torch.equal(unpacked(alone[key])[name].view(torch.bfloat16), t.to(torch.bfloat16)), (key, name)
            # batched: within float32's rounding of the batched products, then bfloat16's (2^-8 relative)
            scale = t.abs().max().item()
            torch.testing.assert_close(unpacked(batched[key])[name].view(torch.bfloat16).float(), t, rtol=2 ** -8,
                                       atol=1e-5 * scale)


def test_a_client_whose_round_fails_or_whose_deadline_passed_fails_alone():
    overrides = f"{RUN} debug.fail_partitions=[1] debug.fail_rounds=[2]"
    deadlines = {0: time.time() + 600, 1: time.time() + 600, 2: time.time() - 5}
    items = [(train_message(p, overrides=overrides).content, context(p, overrides), deadlines[p]) for p in range(3)]
    outcomes = client_work.train_contents(items)
    assert isinstance(outcomes[1], InjectedFault)
    assert isinstance(outcomes[2], client_work.MessageLate) and "deadline passed" in str(outcomes[2])
    assert dict(outcomes[0]["metrics"])["partition-id"] == 0


def test_a_training_message_without_the_rounds_size_is_refused_naming_the_key():
    message = train_message(0)
    message.content["config"] = ConfigRecord({k: v for k, v in dict(message.content["config"]).items()
                                              if k != ROUND_CLIENTS_KEY})
    with pytest.raises(ValueError, match="lacks 'round-clients'"):
        client_work.run_batched_train(message, context(0), Gather(Recorder()))


# ---------------------------------------------------------------- the machine's batching worker


def test_the_clientapps_hand_a_rounds_messages_to_one_worker_that_trains_them_at_once(workers):
    """Three nodes' ClientApps (threads here, Ray actors in a simulation) forward their training
    messages; one worker of the run serves them all, in one batch (one train-seconds), and each
    reply is the client's alone; the Context comes back with each reply."""
    contexts = {p: context(p) for p in range(3)}
    messages = {p: train_message(p) for p in range(3)}  # composed here: Hydra's composition is not thread-safe
    with ThreadPoolExecutor(3) as pool:
        replies = dict(zip(range(3), pool.map(lambda p: client_app.reply("train", messages[p], contexts[p]),
                                              range(3))))
    infos = [json.loads(path.read_text()) for path in workers.glob("*.json")]
    assert len(infos) == 1 and infos[0]["batched"]
    seconds = {dict(reply.content["metrics"])["train-seconds"] for reply in replies.values()}
    assert len(seconds) == 1
    for p, reply in replies.items():
        assert not reply.has_error(), reply.error
        assert reply.metadata.reply_to_message_id == f"m{p}"
        alone = client_work.run_message("train", train_message(p), context(p))
        assert_close_replies(reply.content, alone.content)
        assert contexts[p].state is not None


def test_a_rounds_broadcast_crosses_to_the_worker_once_and_each_reply_is_the_clients_own(workers, monkeypatch):
    """The first ClientApp of a round sends its whole message; once the worker holds it, the
    round's later ClientApps send theirs without the model and the server's arrays (the worker
    puts its own back), and every reply is still its client's alone."""
    sent, acks = [], threading.Event()
    send, recv = forward.send_frames, forward.recv_frames

    def sending(sock, header, *blobs):
        sent.append((header, sum(map(len, blobs))))
        return send(sock, header, *blobs)

    def receiving(sock):
        header, blobs = recv(sock)
        if header.get("ack"):
            acks.set()
        return header, blobs

    monkeypatch.setattr(forward, "send_frames", sending)
    monkeypatch.setattr(forward, "recv_frames", receiving)
    contexts = {p: context(p) for p in range(3)}
    messages = {p: train_message(p) for p in range(3)}
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(client_app.reply, "train", messages[0], contexts[0])
        assert acks.wait(120)  # the worker (started: its imports) has read the first message and kept its records
        later = [pool.submit(client_app.reply, "train", messages[p], contexts[p]) for p in (1, 2)]
        replies = dict(zip(range(3), [first.result(), *(future.result() for future in later)]))
    messages_sent = [(header["omitted"], size) for header, size in sent if "omitted" in header]
    broadcast = sum(record.count_bytes() for record in messages[0].content.array_records.values())
    assert messages_sent[0][0] == [] and messages_sent[0][1] > broadcast
    assert [sorted(omitted) for omitted, _ in messages_sent[1:]] == [["delta_g", "model", "v_bar"]] * 2
    assert all(size < 4096 for _, size in messages_sent[1:])
    for p, reply in replies.items():
        assert not reply.has_error(), reply.error
        assert_close_replies(reply.content, client_work.run_message("train", train_message(p), context(p)).content)


def test_a_run_without_client_batch_is_not_forwarded(monkeypatch):
    message = train_message(0)
    message.content["config"] = ConfigRecord({**dict(message.content["config"]), CLIENT_BATCH_KEY: False})
    monkeypatch.setattr(forward, "forward", lambda *a, **kw: pytest.fail("forwarded"))
    assert client_app.batched(train_message(0)) and not client_app.batched(message)
    overrides = RUN.replace("client_batch=true", "client_batch=false")
    assert not client_app.reply("train", message, context(0, overrides)).has_error()


def test_the_batching_worker_trains_with_the_machines_cpus(monkeypatch):
    """It inherits a ClientApp's environment, where Ray sets OMP_NUM_THREADS to the ClientApp's
    share, but it is the machine's one training process."""
    started = {}

    class Recorded:
        def __init__(self, command, env, **kwargs):
            started.update(command=command, env=env)

    monkeypatch.setattr(forward.subprocess, "Popen", Recorded)
    monkeypatch.setattr(forward, "_STARTED", [])
    monkeypatch.setattr(forward, "machine_cpus", lambda: 12)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    forward._start(Path("/tmp/none.sock"), "key", context(0), (os.getpid(), 0), batched=True)
    assert started["env"]["OMP_NUM_THREADS"] == "12" and "--batched" in started["command"]
    forward._start(Path("/tmp/none.sock"), "key", context(0), (os.getpid(), 0))
    assert started["env"]["OMP_NUM_THREADS"] == "1" and "--batched" not in started["command"]


def test_a_batch_ended_by_a_base_exception_fails_its_messages_and_the_next_batch_trains():
    calls = []

    def train(items):
        calls.append(items)
        if len(calls) == 1:
            raise SystemExit("stopped")
        return [item * 10 for item in items]

    gather = Gather(train)
    (outcome, _), = submit_all(gather, [("r", 1, 30.0, 1)])
    assert isinstance(outcome, RuntimeError) and "interrupted" in str(outcome)
    (outcome, _), = submit_all(gather, [("s", 1, 30.0, 2)])
    assert outcome == 20


def test_a_nodes_own_warm_worker_prepares_nothing_where_the_batching_worker_trains(monkeypatch):
    """Its identity query would otherwise have each node's warm worker build a trainer (a model
    on the GPU) that gets no message: only evaluation messages go there."""
    monkeypatch.setattr(client_work, "node_trainer", lambda context: pytest.fail("built a trainer"))
    client_work.prepare(context(0))
    monkeypatch.undo()
    built = []

    def record(context):
        built.append(context.node_id)
        raise RuntimeError("stop here")

    monkeypatch.setattr(client_work, "node_trainer", record)
    with pytest.raises(RuntimeError, match="stop here"):
        client_work.prepare(context(0, f"{RUN} fraction_evaluate=0.5"))
    assert built == [100]
