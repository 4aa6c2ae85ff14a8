"""Benchmark: what the client-side diagnostics cost a local round (the aim: at most 5 % at their
default sampling, ``diagnostics.trust_every=10``).

    python scripts/bench_diagnostics.py                      # ViT-Tiny, 3x32x32 inputs, batch 50, K = 20
    python scripts/bench_diagnostics.py --model resnet18 --steps 50
    python scripts/bench_diagnostics.py --quick              # cnn_small on digits, seconds (CI smoke)

One warm ``ClientTrainer`` per setting runs the same FedACT round (same x^r, v_bar, Delta_G,
batches) with the diagnostics off (``trust_every=0``, the baseline) and at each ``--every``;
rounds alternate between the settings and the figure is the median of ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
if str(APP_DIR) not in sys.path:
    sys.path.insert(0, str(APP_DIR))

import torch  # noqa: E402

from fedact_app.client_trainer import ClientTrainer  # noqa: E402
from fedact_app.config import compose  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_tiny")
    parser.add_argument("--steps", type=int, default=20, help="local steps K per round")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--every", type=int, nargs="+", default=[10, 5, 1], help="trust_every values")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quick", action="store_true", help="cnn_small on digits, K = 10, 2 repeats")
    return parser.parse_args(argv)


def overrides(args: argparse.Namespace, every: int) -> list[str]:
    data = (["dataset=digits", "model=cnn_small"] if args.quick else
            ["dataset=synthetic", "dataset.image_size=32", "dataset.channels=3", "dataset.mean=[0,0,0]",
             "dataset.std=[1,1,1]", "dataset.num_classes=10", "dataset.num_train=1000", f"model={args.model}"])
    return [*data, "algorithm=fedact", "num_clients=2", f"batch_size={args.batch_size}",
            f"device={args.device}", f"diagnostics.trust_every={every}"]


def round_inputs(trainer: ClientTrainer) -> tuple[dict, dict]:
    """A fixed x^r and a warm v_bar, Delta_G (a round after the first)."""
    state = {n: t.detach().cpu().clone() for n, t in trainer.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    names = [n for n, _ in trainer.named_params]
    received = {"v_bar": {n: torch.rand(state[n].shape, generator=gen) * 1e-4 for n in names},
                "delta_g": {n: torch.randn(state[n].shape, generator=gen) * 1e-3 for n in names}}
    return state, received


def timed_round(trainer: ClientTrainer, state: dict, received: dict, steps: int) -> float:
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    trainer.train_round(state, received, partition_id=0, num_partitions=2, server_round=2, lr=1e-4,
                        local_steps=steps, global_step=steps)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.every = 10, 2, [10]
    settings = [0, *args.every]
    trainers = {every: ClientTrainer(compose(overrides(args, every))) for every in settings}
    state, received = round_inputs(trainers[0])
    for trainer in trainers.values():  # warm-up: data on the device, workspaces, allocator
        timed_round(trainer, state, received, args.steps)
    times = {every: [] for every in settings}
    for _ in range(args.repeats):
        for every in settings:
            times[every].append(timed_round(trainers[every], state, received, args.steps))
    trainer = trainers[0]
    d = sum(p.numel() for _, p in trainer.named_params)
    print(f"{args.model if not args.quick else 'cnn_small'}: {d:,} trainable parameters; {trainer.device}; "
          f"K = {args.steps}, batch {args.batch_size}, median of {args.repeats} rounds, "
          f"{torch.get_num_threads()} threads")
    base = statistics.median(times[0])
    print(f"{'diagnostics':<22}{'round s':>10}{'ratio':>8}")
    print(f"{'off (trust_every=0)':<22}{base:>10.3f}{1.0:>8.3f}")
    for every in args.every:
        median = statistics.median(times[every])
        print(f"{f'trust_every={every}':<22}{median:>10.3f}{median / base:>8.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
