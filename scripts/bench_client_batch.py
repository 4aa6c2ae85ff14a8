"""Benchmark: a round's clients trained at once (``ClientBatch``) against one after another.

    python scripts/bench_client_batch.py                # ViT-Tiny at 32 px, 4 clients x K = 5, batch 8, CPU-sized
    python scripts/bench_client_batch.py --paper        # the seed's round: 10 clients x K = 50 x batch 50 (GPU)
    python scripts/bench_client_batch.py --paper --overrides "precision=bf16" --profile
    python scripts/bench_client_batch.py --paper --overrides "compile_model=reduce-overhead precision=bf16"

Both sides train the same clients from the same x^r, v̄^r and Δ_G^{r-1} on the same batches: the
loop with one model and one FedACTAdamW, a client after another (``plain_client_round`` of
``bench_round.py``, as a Flower client trains), and :class:`fedact_app.client_batch.ClientBatch`,
all C clients in one vmapped forward and backward and one FedACTAdamW step. Between rounds the
method's server rule aggregates the loop's replies, so every round after the first has a v̄ and
a Δ_G. Each round runs both, in alternating order, timed between two synchronizations of the
device; the first round (allocations, kernel choice, compilation) is left out, and the figures
are medians over the rest, with their range. ``compile_model`` compiles both sides: the loop's
model (``compiled_for_training``, as a client's) and the batch's vmapped loss
(``ClientBatch(compile_mode=...)``).

On CUDA it prints each side's peak of device memory a round, above what was allocated when the
side began (the data, the models, the other side's state). It prints how far the batched
replies are from the loop's: the largest |Δ_batched − Δ_loop| over
all coordinates, as a fraction of the largest |Δ_loop|, and the share of coordinates that differ
by more than 1e-3 of it. They differ by the rounding of batched products, and where that
rounding decides a top-k (scores equal in exact arithmetic, such as the key bias's 0 gradients)
by a factor α/γ on those coordinates.

It then times the batched optimizer's step alone (``ClientBatch.optimizer.step()`` on the
gradients the last step left, between two synchronizations of the device, median of
``OPTIMIZER_REPEATS``) and prints it beside the batched step (a round over K). Timed alone, the
step's launches overlap no other work, so on a GPU it is at most its share within the round. The
rest of a step, an estimate, is the clients' forward and backward, their batches, the
accumulation into the gradients, and the round's own work (x^r loaded, the replies made) spread
over its K steps.

``--profile`` counts the PyTorch operations of a step (``aten::`` events of ``torch.profiler``,
nested ones and views included; a round of K = 3 less one of K = 1, halved) and on CUDA its
kernels and copies as the profiler lists them (``bench_optimizer.own_time_events``), for the
loop's C single-client steps and for the batched step: on a GPU, where a client's step is bound by
launching kernels, that ratio bounds what batching can gain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
for _path in (APP_DIR, APP_DIR / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from fedact_app.algorithms import ALGORITHMS, ClientUpdate, TensorDict  # noqa: E402
from bench_optimizer import own_time_events  # noqa: E402  (scripts/)
from bench_round import PAPER_OVERRIDES, plain_client_round  # noqa: E402  (scripts/)
from fedact_app.client_batch import ClientBatch  # noqa: E402
from fedact_app.config import Config, compose  # noqa: E402
from fedact_app.registry import FEDACT_FAMILY  # noqa: E402
from fedact_app.tasks.vision.batches import BatchStream  # noqa: E402
from fedact_app.tasks.vision.data import load_client_train  # noqa: E402
from fedact_app.tasks.vision.models import build_model  # noqa: E402
from fedact_app.train import (batch_generator, classification_loss, compiled_for_training, cosine_lr,  # noqa: E402
                              resolve_device)

SMALL_OVERRIDES = ("dataset=synthetic dataset.num_classes=100 dataset.image_size=32 dataset.channels=3 "
                   "dataset.mean=[0.5,0.5,0.5] dataset.std=[0.25,0.25,0.25] dataset.num_train=2000 "
                   "dataset.num_test=100 model=vit_tiny batch_size=8")
SMALL = dict(clients=4, local_steps=5, rounds=4)
PAPER = dict(clients=10, local_steps=50, rounds=6)  # with bench_round.py's PAPER_OVERRIDES: the seed's round
OPTIMIZER_REPEATS = 20


class Clients:
    """The benchmark's C clients: their data on the device, the loop's model and optimizer, the
    batched trainer, and the server rule between rounds."""

    def __init__(self, cfg: Config, clients: int) -> None:
        self.cfg, self.clients = cfg, clients
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg.model, cfg.dataset).to(self.device)
        self.named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        algorithm = cfg.algorithm
        self.rule = ALGORITHMS[algorithm.name].local(algorithm)
        self.optimizer = self.rule.make_optimizer(self.named)
        # compile_model: the loop's model and the batch's vmapped loss each through torch.compile
        self.train_module = compiled_for_training(self.model, cfg.compile_model)
        self.batched = ClientBatch(self.model, algorithm, clients, classification_loss, cfg.precision,
                                   compile_mode=cfg.compile_model)
        self.server = ALGORITHMS[algorithm.name].server(algorithm, [n for n, _ in self.named],
                                                        num_clients=cfg.num_clients)
        self.data = [load_client_train(cfg, i, cfg.num_clients).to(self.device) for i in range(clients)]
        self.x: TensorDict = {name: t.detach().cpu().clone() for name, t in self.model.state_dict().items()}

    def streams(self, server_round: int) -> list[BatchStream]:
        return [BatchStream(self.data[c], self.cfg.batch_size, self.cfg.dataset.augment,
                            batch_generator(self.cfg.seed, server_round, c, self.device))
                for c in range(self.clients)]

    def loop(self, server_round: int, lr: float, steps: int) -> list[ClientUpdate]:
        """The clients one after another, as ``ClientTrainer.train_round`` trains each."""
        broadcast = self.server.broadcast()
        return [plain_client_round(self.model, self.optimizer, self.named, self.x, broadcast, stream, lr=lr,
                                   server_round=server_round, local_steps=steps, precision=self.cfg.precision,
                                   train_module=self.train_module)
                for stream in self.streams(server_round)]

    def at_once(self, server_round: int, lr: float, steps: int) -> list[ClientUpdate]:
        results = self.batched.train_round(self.x, self.server.broadcast(), self.streams(server_round), lr=lr,
                                           local_steps=steps, global_step=(server_round - 1) * steps)
        return [r.update for r in results]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def timed(fn, clients: Clients, *args) -> tuple[float, list[ClientUpdate], int]:
    """Seconds of ``fn(*args)``, its replies, and on CUDA its peak of device memory above what
    was allocated when it began (0 elsewhere): the other side's memory, its CUDA graphs' pools
    included, is not counted."""
    cuda = clients.device.type == "cuda"
    clients.synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats(clients.device)
        allocated = torch.cuda.memory_allocated(clients.device)
    started = time.perf_counter()
    updates = fn(*args)
    clients.synchronize()
    seconds = time.perf_counter() - started
    return seconds, updates, torch.cuda.max_memory_allocated(clients.device) - allocated if cuda else 0


def optimizer_step_seconds(clients: Clients, repeats: int = OPTIMIZER_REPEATS) -> float:
    """Median seconds of the batched optimizer's step alone, each between two synchronizations of
    the device, on the gradients the last step left (it moves the batch's parameters: run it
    after the rounds)."""
    seconds = []
    for _ in range(repeats):
        clients.synchronize()
        started = time.perf_counter()
        clients.batched.optimizer.step()
        clients.synchronize()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def difference(batched: list[ClientUpdate], loop: list[ClientUpdate]) -> tuple[float, float]:
    """(max |Δ_b − Δ_l| / max |Δ_l|, share of coordinates differing by more than 1e-3 of max |Δ_l|)."""
    b = torch.cat([t.reshape(-1).double() for u in batched for t in u.delta.values()])
    l = torch.cat([t.reshape(-1).double() for u in loop for t in u.delta.values()])
    scale = float(l.abs().max()) or 1.0
    gap = (b - l).abs()
    return float(gap.max()) / scale, float((gap > 1e-3 * scale).double().mean())


def operation_counts(clients: Clients) -> dict[str, tuple[float, float]]:
    """(aten:: events, CUDA kernels and copies) a step of each side: a round of K = 3 less one of K = 1,
    halved, so that what a round does once (loading x^r, making the replies) is left out."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if clients.device.type == "cuda" else [])

    def counted(fn, steps: int) -> tuple[int, int]:
        with profile(activities=activities) as prof:
            fn(2, 1e-3, steps)
            clients.synchronize()
        events = prof.events()
        device_events = own_time_events(events, cuda=True) if clients.device.type == "cuda" else []
        return sum(1 for e in events if e.name.startswith("aten::")), len(device_events)

    counts = {}
    for name, fn in (("loop", clients.loop), ("batched", clients.at_once)):
        fn(1, 1e-3, 1)  # warm: allocations, first-step layouts
        (ops1, kernels1), (ops3, kernels3) = counted(fn, 1), counted(fn, 3)
        counts[name] = ((ops3 - ops1) / 2, (kernels3 - kernels1) / 2)
    return counts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overrides", default="", help="Hydra overrides after the benchmark's own")
    parser.add_argument("--clients", type=int, help=f"C, the clients of a round (default {SMALL['clients']})")
    parser.add_argument("--local-steps", type=int, help=f"K (default {SMALL['local_steps']})")
    parser.add_argument("--rounds", type=int,
                        help=f"rounds, the first one left out of the figures (default {SMALL['rounds']})")
    parser.add_argument("--paper", action="store_true",
                        help=f"the seed's round: {PAPER} on CUDA (flags given take precedence)")
    parser.add_argument("--profile", action="store_true", help="count one step's operations and kernels")
    args = parser.parse_args(argv)
    for name, value in (PAPER if args.paper else SMALL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    base = PAPER_OVERRIDES if args.paper else SMALL_OVERRIDES
    args.overrides = f"{base} num_clients={args.clients} local_steps={args.local_steps} {args.overrides}".strip()
    if args.rounds < 2:
        parser.error(f"--rounds {args.rounds}: at least 2 (the first is left out)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = compose(args.overrides)
    if cfg.task != "vision" or cfg.algorithm.name not in FEDACT_FAMILY:
        raise SystemExit(f"bench_client_batch runs task=vision with the FedACT family {FEDACT_FAMILY}, "
                         f"not task={cfg.task} algorithm={cfg.algorithm.name}")
    if cfg.channels_last:
        raise SystemExit("bench_client_batch trains in the contiguous memory format: leave channels_last=false")
    clients = Clients(cfg, args.clients)
    d = sum(p.numel() for _, p in clients.named)
    name = torch.cuda.get_device_name(clients.device) if clients.device.type == "cuda" else "CPU"
    print(f"{cfg.model.name}, d = {d:,}; {args.clients} clients x K = {args.local_steps} x batch "
          f"{cfg.batch_size}; {cfg.algorithm.name} (trust_scope={cfg.algorithm.trust_scope}), "
          f"precision={cfg.precision}, compile_model={cfg.compile_model}; on {clients.device} ({name}), "
          f"{torch.get_num_threads()} CPU threads")
    times: dict[str, list[float]] = {"loop": [], "batched": []}
    peaks = {"loop": 0, "batched": 0}
    gaps = []
    for server_round in range(1, args.rounds + 1):
        lr = cosine_lr(server_round, args.rounds, cfg.algorithm.lr, cfg.algorithm.lr_min)
        sides = [("loop", clients.loop), ("batched", clients.at_once)]
        updates = {}
        for side, fn in sides if server_round % 2 else sides[::-1]:
            seconds, updates[side], peak = timed(fn, clients, server_round, lr, args.local_steps)
            peaks[side] = max(peaks[side], peak)
            if server_round > 1:
                times[side].append(seconds)
        gaps.append(difference(updates["batched"], updates["loop"]))
        clients.x = clients.server.aggregate(clients.x, updates["loop"])
    steps = args.local_steps
    loop, batched = (statistics.median(times[side]) for side in ("loop", "batched"))
    print(f"rounds 2-{args.rounds}, s a round (median [range]); ms a step of all {args.clients} clients:")
    for side, label in (("loop", "clients one after another"), ("batched", "clients at once (ClientBatch)")):
        values = times[side]
        median = statistics.median(values)
        print(f"  {label:<32}{median:8.3f}  [{min(values):.3f}-{max(values):.3f}]  {1e3 * median / steps:8.2f}")
    print(f"  loop / batched: {loop / batched:.2f}x")
    step_ms, optimizer_ms = 1e3 * batched / steps, 1e3 * optimizer_step_seconds(clients)
    print(f"of a batched step: the optimizer's step alone {optimizer_ms:.2f} ms (median of {OPTIMIZER_REPEATS}), "
          f"the rest (forward, backward, batches, the round's own work over K) about {step_ms - optimizer_ms:.2f} ms")
    if clients.device.type == "cuda":
        print(f"peak GPU memory a round above its start (torch's allocator), MiB: loop {peaks['loop'] / 2**20:,.0f} / "
              f"batched {peaks['batched'] / 2**20:,.0f}")
    worst = max(g[0] for g in gaps)
    share = max(g[1] for g in gaps)
    print(f"batched against loop replies: max |dDelta| / max |Delta| = {worst:.2e}; coordinates off by more "
          f"than 1e-3 of it: {100 * share:.3f} % (worst round)")
    if args.profile:
        counts = operation_counts(clients)
        (loop_ops, loop_kernels), (batched_ops, batched_kernels) = counts["loop"], counts["batched"]
        print(f"a step of all {args.clients} clients: aten ops loop {loop_ops:,.0f} / batched {batched_ops:,.0f} = "
              f"{loop_ops / batched_ops:.2f}x", end="")
        if clients.device.type == "cuda":
            print(f"; CUDA kernels and copies loop {loop_kernels:,.0f} / batched {batched_kernels:,.0f} = "
                  f"{loop_kernels / max(batched_kernels, 1):.2f}x", end="")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
