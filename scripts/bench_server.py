"""Benchmark: the ServerApp's own work a round, piece by piece, against a floor.

    python scripts/bench_server.py                    # ViT-Tiny at 32 px, 100 classes, 10 FedACT replies, 7 repeats
    python scripts/bench_server.py --device cuda      # the same with the rule's tensors on the GPU
    python scripts/bench_server.py --quick            # cnn_small, 3 clients, 2 repeats (CI smoke)

The replies are ``--clients`` FedACT reply records (``delta`` over the model state, ``v`` over
the trainable parameters, the metrics a client sends) of the model's real shapes (random
values; the server's cost does not depend on them), built once as the ServerApp receives them:
Flower ``RecordDict`` objects. Each repeat times, in turn:

- decode + checks: ``fedact_app.replies.decode_updates`` of the replies, on torch's threads as
  the strategy decodes them (the arrays out of the records into one vector per key, reused from
  round to round as the strategy reuses them; names/shapes/dtypes, finiteness and the norms in
  one pass, v >= 0, the metrics);
- decode, one thread: the same, ``decode_update`` of one reply after the other;
- decode + checks, bfloat16 replies: the first with the replies' arrays in bfloat16
  (``reply_dtype=bfloat16``: half the bytes, widened back to float32 as they are copied out);
- acceptance: the round-relative bounds over the decoded replies (``update_ratios``,
  ``moment_outliers``, from the norms measured in decoding);
- aggregate: the rule's ``FedACTServer.aggregate`` (x + mean(Delta_i), Delta_G, v_bar);
- DC + ||Delta_G||: the round's diagnostics over the accepted updates, as the strategy takes
  them (``vectors_direction_consistency``, ``vector_norms``);
- server round: ``AlgorithmStrategy.aggregate_train`` on the replies as Flower ``Message``
  objects: the pieces above, the check that the aggregate is finite, and the new global state
  made into the ``ArrayRecord`` the next round sends;
- after the last reply: the same with every reply but the last decoded beforehand (untimed), as
  the strategy decodes replies while they arrive (``AlgorithmStrategy.round_arrivals``), and
  without the diagnostics where a run makes them while the next round's clients train (a CPU
  server; on a GPU server ``AlgorithmStrategy.aggregate_round`` makes them at once): what a
  round waits for after its last reply (a run's ``server_seconds``, without the pull);
- floor: one pass reading the S x d floats of the deltas, ``torch.stack(deltas).sum(0)``
  (what any rule that looks at every reply's every coordinate once costs at least).

With ``--device cuda`` the strategy's ``device`` (the run's ``server_device``) is the GPU: the
replies are decoded onto it and every piece runs there (the timings wait for the GPU to finish).

The pieces alternate within every repeat, so a slower or busier stretch of the machine hits them
alike; each figure is the median of ``--repeats`` with its range, and the ratio is to the
floor's median of the same run. The header names the machine (bench_run.py's ``machine()``), the
torch threads and the device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
for _path in (APP_DIR, APP_DIR / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from flwr.app import Message, Metadata, MessageType, MetricRecord, RecordDict  # noqa: E402

from fedact_app.algorithms import ALGORITHMS  # noqa: E402
from fedact_app.diagnostics import vector_norms, vectors_direction_consistency  # noqa: E402
from fedact_app.packing import VectorPool, as_vector  # noqa: E402
from fedact_app.replies import ReplyError, decode_update, decode_updates, moment_outliers, update_ratios  # noqa: E402
from bench_aggregation import fedact_state, updates_of  # noqa: E402  (scripts/)
from bench_run import machine  # noqa: E402  (scripts/)
from interleaved import interleaved, print_medians  # noqa: E402  (scripts/)
from fedact_app.strategy import AlgorithmStrategy  # noqa: E402
from fedact_app.train import resolve_device  # noqa: E402
from fedact_app.wire import packed_record, to_wire  # noqa: E402

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_tiny")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="the server's device (server_device): cpu | cuda | auto")
    parser.add_argument("--quick", action="store_true", help="cnn_small on digits, 3 clients, 2 repeats")
    return parser.parse_args(argv)


def replies_of(state: dict, trainable: list[str], clients: int, reply_dtype: str = "float32") -> list[RecordDict]:
    """The reply records of bench_aggregation.py's ``clients`` FedACT updates (delta, v), their
    arrays in ``reply_dtype``."""
    return [RecordDict({"delta": packed_record(to_wire(u.delta, reply_dtype)),
                        "v": packed_record(to_wire(u.arrays["v"], reply_dtype)),
                        "metrics": MetricRecord({"num-examples": u.num_examples, "num-steps": u.num_steps,
                                                 "lr-sum": u.lr_sum, "train-loss": 1.0})})
            for u in updates_of(state, trainable, clients)]


def message(node: int, content: RecordDict) -> Message:
    """A reply as the SuperLink hands it to the ServerApp."""
    metadata = Metadata(run_id=1, message_id=f"m{node}", src_node_id=node, dst_node_id=0,
                        reply_to_message_id=f"q{node}", group_id="1", created_at=time.time(), ttl=60.0,
                        message_type=MessageType.TRAIN)
    return Message(metadata=metadata, content=content)


class Round:
    """One server round's pieces over the same replies, each timed on its own."""

    def __init__(self, cfg, x: dict, trainable: list[str], replies: list[RecordDict], device: torch.device,
                 replies_bfloat16: list[RecordDict]):
        self.rule = ALGORITHMS["fedact"].server(cfg.algorithm, trainable)
        self.strategy = AlgorithmStrategy(ALGORITHMS["fedact"].server(cfg.algorithm, trainable),
                                          trainable=trainable, local_steps=50, lr_schedule=lambda r: 3e-4,
                                          fraction_train=1.0, min_train_nodes=1, device=device)
        self.strategy.load_state_dict({"model": x, "rule": {}, "empty_rounds": 0})
        self.x = self.strategy.state
        self.trainable, self.replies, self.replies_bfloat16 = trainable, replies, replies_bfloat16
        self.messages = [message(node + 1, content) for node, content in enumerate(replies)]
        # the pieces after decoding read replies of their own: the strategy's vectors are rewritten
        # by every piece that decodes
        self.updates = self.decode(pool=VectorPool(pin=device.type == "cuda"))

    def decode(self, pool: VectorPool | None = None, reply_dtype: str = "float32"):
        if pool is None:
            pool = self.strategy.vectors
            pool.recycle()  # as the strategy does: each round into the last round's vectors
        replies = self.replies_bfloat16 if reply_dtype == "bfloat16" else self.replies
        updates = decode_updates(replies, self.x, self.rule.reply_keys, self.trainable,
                                 self.rule.nonnegative_keys, pool=pool, reply_dtype=reply_dtype)
        if refused := [u for u in updates if isinstance(u, ReplyError)]:
            raise RuntimeError(f"a reply was refused: {refused[0]}")
        return updates

    def decode_one_thread(self):
        self.strategy.vectors.recycle()
        return [decode_update(c, self.x, self.rule.reply_keys, self.trainable, self.rule.nonnegative_keys,
                              pool=self.strategy.vectors) for c in self.replies]

    def accept(self):
        moment_outliers(self.updates, self.rule.nonnegative_keys, self.rule.broadcast(), 1e6)
        return update_ratios(self.updates, self.trainable)

    def aggregate(self):
        return self.rule.aggregate(self.x, self.updates)

    def diagnostics(self):
        dc = vectors_direction_consistency([as_vector(u.delta, self.trainable) for u in self.updates])
        return dc, vector_norms([as_vector(self.rule.broadcast()["delta_g"], self.trainable)])[0]

    def whole(self, arrivals=None, diagnostics=True):
        self.strategy.messages_sent = len(self.messages)
        _, metrics, diagnose = self.strategy.aggregate_round(1, self.messages, arrivals)
        if diagnostics:
            diagnose()
        if metrics["clients"] != len(self.messages):
            raise RuntimeError(f"the round accepted {metrics['clients']} of {len(self.messages)} replies")

    def all_but_the_last_arrived(self):
        self.arrivals = self.strategy.round_arrivals(1)
        self.arrivals.feed(self.messages[:-1])

    def after_last_reply(self):
        self.whole(self.arrivals, diagnostics=False)  # as a run: beside the next round (CPU server) or already made


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.quick:
        args.model, args.clients, args.repeats = "cnn_small", 3, 2
    cfg, x, trainable = fedact_state(args.model, num_classes=100)
    device = resolve_device(args.device, "server_device")
    run = Round(cfg, x, trainable, replies_of(x, trainable, args.clients), device,
                replies_of(x, trainable, args.clients, "bfloat16"))
    deltas = [as_vector(u.delta, trainable) for u in run.updates]
    pieces = {"decode + checks": run.decode, "decode, one thread": run.decode_one_thread,
              "decode + checks, bfloat16": lambda: run.decode(reply_dtype="bfloat16"), "acceptance": run.accept,
              "aggregate": run.aggregate, "DC + ||Delta_G||": run.diagnostics, "server round": run.whole,
              "after the last reply": (run.all_but_the_last_arrived, run.after_last_reply),
              "floor: stack(S x d).sum(0)": lambda: torch.stack(deltas).sum(0)}
    times = interleaved(pieces, args.repeats, device)
    d = sum(x[n].numel() for n in trainable)
    print(f"{args.model}: {d:,} trainable parameters in {len(trainable)} tensors; {args.clients} FedACT replies "
          f"(delta, v); {machine()}, {torch.get_num_threads()} threads; device {device}; median of "
          f"{args.repeats} [min-max]")
    print_medians(times, "floor: stack(S x d).sum(0)", ("piece", 28), "ms", 21, ("ratio to floor", 15))

if __name__ == "__main__":
    main(sys.argv[1:])
