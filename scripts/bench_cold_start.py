"""Benchmark: what a fresh ClientApp process pays before its round's work is done.

    python scripts/bench_cold_start.py                      # digits / cnn_small, 3 fresh processes
    python scripts/bench_cold_start.py --overrides "dataset=cifar100 dataset.path=/data/c100 \\
        model=vit_tiny num_clients=100 partition.alpha=0.1"

A Flower 1.41 deployment starts a new ``flwr-clientapp`` process for every message a SuperNode
receives, so a SuperNode's client is cold in every round; a simulation client (a Ray actor) is
cold only in its first. Each repeat here runs a fresh Python process that does what the
ClientApp's train handler does for partition 0 in round 1 and times its phases:

- imports: ``fedact_app.client_work`` (torch, Flower; not what Flower itself imports before it
  loads the app);
- trainer: the run config, the task, the model (timm's import for the ViT, Swin and ResNet-18)
  and the optimizer (``trainer_for``);
- data: the splits, the partition and the client's rows (Hugging Face datasets' import and the
  images' decoding for hub data; for local image files only in the first process, which decodes
  them whole into the cache);
- round: the K local steps and the reply's arrays (``ClientTrainer.train_round``);
- warm round: the same round again in the same process, what a simulation client pays from
  its second round on.

The first process starts with an empty cache (``FEDACT_CACHE_DIR`` in a new temporary folder),
the others find the partition (and the digits split, or the decoded images of local files) there,
as a SuperNode does from its second message on.
Medians are over those others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
PHASES = ("imports", "trainer", "data", "round", "warm round")


def child(overrides: str) -> dict[str, float]:
    """The phases of one cold ClientApp round in this (fresh) process, in seconds."""
    sys.path.insert(0, str(APP_DIR))
    times, mark = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        times[name], mark = now - mark, now

    import fedact_app.client_work  # noqa: F401  (what a process that does the work imports)
    from fedact_app.tasks.vision import data
    from fedact_app.client_trainer import trainer_for
    lap("imports")
    trainer = trainer_for(overrides)
    cfg = trainer.cfg
    lap("trainer")
    if cfg.task == "vision":
        data.load_client_train(cfg, 0, cfg.num_clients)
    lap("data")
    state = {name: t.detach().clone() for name, t in trainer.model.state_dict().items() if name in trainer.shared}
    for phase in ("round", "warm round"):
        trainer.train_round(state, {}, partition_id=0, num_partitions=cfg.num_clients, server_round=1,
                            lr=cfg.algorithm.lr, local_steps=cfg.local_steps, global_step=0)
        lap(phase)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overrides", default="", help="the run's Hydra overrides (as in flwr run)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes (>= 2: one cold cache)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.overrides)))
        return 0
    if args.repeats < 2:
        parser.error(f"--repeats {args.repeats}: need >= 2 (one with an empty cache, one with it filled)")
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedact-cold-") as cache:
        env = {**os.environ, "FEDACT_CACHE_DIR": cache}
        for _ in range(args.repeats):
            proc = subprocess.run([sys.executable, __file__, "--child", "--overrides", args.overrides],
                                  capture_output=True, text=True, env=env, cwd=APP_DIR)
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"a fresh ClientApp process, partition 0, round 1 ({args.overrides or 'defaults'}); "
          f"{args.repeats} processes")
    print(f"{'phase':<12}{'cache empty s':>15}{'cache filled s':>16}")
    for phase in PHASES:
        print(f"{phase:<12}{runs[0][phase]:>15.2f}{statistics.median(r[phase] for r in runs[1:]):>16.2f}")
    cold = [sum(r[p] for p in PHASES[:-1]) for r in runs]
    warm = statistics.median(r["warm round"] for r in runs[1:])
    print(f"cold round (imports to reply): {cold[0]:.2f} s with an empty cache, "
          f"{statistics.median(cold[1:]):.2f} s with it filled; warm round {warm:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
