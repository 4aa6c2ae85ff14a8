"""Benchmark: what a robust aggregation costs the server a round, against the mean.

    python scripts/bench_aggregation.py                   # ViT-Tiny (model=vit_tiny), 10 clients, 7 repeats
    python scripts/bench_aggregation.py --model resnet18 --clients 20
    python scripts/bench_aggregation.py --quick           # cnn_small, 3 clients, 2 repeats (CI smoke)

One FedACT server round (fedact_app.algorithms.FedACTServer.aggregate: x + agg(Delta_i),
Delta_G = -agg(Delta_i / lr_sum_i), v_bar = agg(v_i)) over ``--clients`` updates of the model's
real shapes (random values; the rules' cost does not depend on them), on the server's CPU, for
each ``aggregation``. The rules alternate within every repeat (mean, trimmed_mean, median, mean,
...), so a slower or busier stretch of the machine hits them alike; each figure is the median of
``--repeats`` rounds with its range, and the ratio is to the mean's median of the same run.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
for _path in (APP_DIR, APP_DIR / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

from fedact_app.aggregation import Aggregation  # noqa: E402
from fedact_app.algorithms import ALGORITHMS, ClientUpdate  # noqa: E402
from fedact_app.config import Config, compose  # noqa: E402
from fedact_app.registry import AGGREGATIONS  # noqa: E402
from fedact_app.server_app import initial_model  # noqa: E402
from interleaved import interleaved, print_medians  # noqa: E402  (scripts/)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_tiny")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="cnn_small on digits, 3 clients, 2 repeats")
    return parser.parse_args(argv)


def fedact_state(model: str, num_classes: int) -> tuple[Config, dict, list[str]]:
    """A FedACT config of ``model`` (cnn_small on digits, another on 32 x 32 synthetic images of
    ``num_classes`` classes), its initial global state and its trainable parameters' names."""
    data = ["dataset=digits"] if model == "cnn_small" else [
        "dataset=synthetic", "dataset.image_size=32", f"dataset.num_classes={num_classes}"]
    cfg = compose([*data, f"model={model}", "algorithm=fedact", "device=cpu"])
    _, _, x, trainable = initial_model(cfg)
    return cfg, x, trainable


def updates_of(state: dict, trainable: list[str], clients: int) -> list[ClientUpdate]:
    """``clients`` FedACT replies of the state's shapes: Delta_i ~ 1e-3 N(0, 1), v_i ~ U(0, 1e-4)."""
    gen = torch.Generator().manual_seed(0)
    updates = []
    for _ in range(clients):
        delta = {n: (torch.randn(t.shape, generator=gen) * 1e-3).to(t.dtype) if t.is_floating_point()
                 else torch.zeros_like(t) for n, t in state.items()}
        v = {n: torch.rand(state[n].shape, generator=gen) * 1e-4 for n in trainable}
        updates.append(ClientUpdate(delta=delta, num_steps=50, lr_sum=50 * 3e-4, num_examples=2500,
                                    arrays={"v": v}))
    return updates


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.quick:
        args.model, args.clients, args.repeats = "cnn_small", 3, 2
    cfg, x, trainable = fedact_state(args.model, num_classes=10)
    updates = updates_of(x, trainable, args.clients)
    rules = {name: ALGORITHMS["fedact"].server(cfg.algorithm, trainable, aggregation=Aggregation(name))
             for name in AGGREGATIONS}
    times = interleaved({name: functools.partial(rule.aggregate, x, updates) for name, rule in rules.items()},
                        args.repeats)
    d = sum(x[n].numel() for n in trainable)
    print(f"{args.model}: {d:,} trainable parameters in {len(trainable)} tensors; {args.clients} clients; "
          f"cpu, {torch.get_num_threads()} threads; FedACT round (x, Delta_G, v_bar); median of {args.repeats} "
          f"[min-max]")
    print_medians(times, "mean", ("aggregation", 14), "round ms", 19, ("ratio to mean", 14))

if __name__ == "__main__":
    main(sys.argv[1:])
