"""End to end: a hung client costs its own replies only. Flower's simulation engine (1.41) gives a
node's next message to any free actor while its earlier one still runs and runs queued messages
however late; without the ClientApp's guards (one message at a time per node, none started past
its deadline) a client that sleeps through several rounds holds both actors of a 2-core machine
and every other client's replies miss the rounds' deadlines.

A real `flwr run` simulation on digits, CPU, 5 clients that train every round, the launcher's
default actors; partition 0 sleeps 25 s in every round, round_timeout is 10 s. And the two guards
on their own.
"""

import json
import os
import stat
import tempfile
import time
from pathlib import Path

import pytest
from flwr.app import Context, Message, Metadata, RecordDict

from fedact_app.client_work import handle
from fedact_app.node_slot import STALE_AFTER, node_slot, remove_run_locks, remove_stale_locks, run_locks

pytestmark = pytest.mark.timeout(600)
APP_DIR = Path(__file__).resolve().parents[1]
HUNG = ("num_rounds=3 num_clients=5 fraction_train=1.0 min_train_nodes=4 local_steps=2 batch_size=16 "
        "device=cpu round_timeout=10 debug.fail_partitions=[0] debug.fail_rounds=[1,2,3] "
        "debug.hang_seconds=25")


@pytest.mark.e2e
def test_a_hung_client_does_not_hold_the_others(tmp_path, flower_engine):
    # one CPU per client: several actors, so the others train while one hangs
    result = flower_engine.run(APP_DIR, overrides=f"{HUNG} output_dir={tmp_path}", num_supernodes=5,
                               num_cpus_per_client=1, timeout=300)
    assert result.completed, f"{result.status} {result.details}\n{result.tail(60)}"
    (folder,) = list(tmp_path.iterdir())
    assert not run_locks(result.run_id).exists()  # removed with the hung node's lock still held
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    # round 1 may also lose replies to the actors' cold start; by round 2 the 4 others reply in
    # time and the hung node's new messages are answered at once ("node busy"), not queued
    for row in rows[2:]:
        assert row["clients"] == 4, row
        assert row["failed"] + row["missing"] == 1, row


@pytest.fixture
def own_tmp(tmp_path, monkeypatch) -> Path:
    """The lock files go to this test's folder, not the machine's temporary directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def message(created_at: float, ttl: float = 43200.0) -> Message:
    metadata = Metadata(run_id=1, message_id="m", src_node_id=0, dst_node_id=7, reply_to_message_id="",
                        group_id="1", created_at=created_at, ttl=ttl, message_type="train")
    return Message(metadata=metadata, content=RecordDict())


def test_a_message_past_its_deadline_or_for_a_busy_node_gets_an_error_reply_without_work(own_tmp):
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(),
                      run_config={"overrides": "round_timeout=15"})
    work = []
    reply = handle(message(time.time() - 16), context, lambda msg, ctx: work.append(1) or RecordDict())
    assert reply.has_error() and "deadline" in reply.error.reason and not work
    reply = handle(message(time.time() - 12, ttl=10), context, lambda msg, ctx: work.append(1) or RecordDict())
    assert reply.has_error() and not work  # ttl < round_timeout: the message's own deadline
    fresh = message(time.time())
    with node_slot(1, 7) as free:  # an earlier message of node 7 still runs
        assert free
        reply = handle(fresh, context, lambda msg, ctx: work.append(1) or RecordDict())
    assert reply.has_error() and "still working" in reply.error.reason and not work
    reply = handle(fresh, context, lambda msg, ctx: work.append(1) or RecordDict())
    assert not reply.has_error() and work == [1]


def test_a_node_slot_is_a_lock_file_in_its_runs_folder_which_the_run_end_removes(own_tmp):
    with node_slot(5, 3) as free:
        assert free
        assert (own_tmp / f"fedact-node-locks-{os.getuid()}" / "5" / "3.lock").is_file()
        assert stat.S_IMODE((own_tmp / f"fedact-node-locks-{os.getuid()}").stat().st_mode) == 0o700
        with node_slot(5, 3) as again, node_slot(5, 4) as other, node_slot(6, 3) as other_run:
            assert not again and other and other_run  # node 3 of run 5 is busy, nothing else
    with node_slot(5, 3) as free:  # released on leaving
        assert free
    remove_run_locks(5)
    assert not (own_tmp / f"fedact-node-locks-{os.getuid()}" / "5").exists()
    assert (own_tmp / f"fedact-node-locks-{os.getuid()}" / "6").exists()
    remove_run_locks(5)  # a run without lock files (a deployment's ServerApp machine): nothing to do


def test_stale_lock_folders_go_and_a_slot_without_a_lock_file_still_works(own_tmp, caplog):
    for run_id in (1, 2):
        with node_slot(run_id, 0):
            pass
    os.utime(run_locks(1), (0, time.time() - STALE_AFTER - 60))
    remove_stale_locks()
    assert not run_locks(1).exists() and run_locks(2).exists()
    run_locks(7).write_text("")  # a file where run 7's folder goes: no lock file can be made
    with node_slot(7, 9) as free:
        assert free  # the work goes on without the guard
    assert "node 9: no lock file" in caplog.text
