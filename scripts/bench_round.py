"""Benchmark: one Flower simulation round against a plain single-process PyTorch loop.

    python scripts/bench_round.py                     # digits / cnn_small, 4 clients x 50 steps, 5 rounds
    python scripts/bench_round.py --quick             # ~30 s: 2 clients x 5 steps, 2 rounds (CI smoke)
    python scripts/bench_round.py --overrides "dataset=synthetic model=resnet18" --num-gpus 1
    python scripts/bench_round.py --paper             # the seed's round on a GPU (below)
    python scripts/bench_round.py --paper --overrides "precision=bf16"   # ... with settings of yours
    python scripts/bench_round.py --paper --num-gpus 0.5 --rounds 8      # ... and flags of yours
    python scripts/bench_round.py --paper --mps       # ... the clients under a private CUDA MPS daemon

``--paper`` is the seed's vision round at CIFAR-100's shape, on synthetic data (no download):
ViT-Tiny, 100 classes at 32 x 32, 50,000 training images, batch 50, 10 clients x K = 50 steps,
all on CUDA, one CPU and 0.1 GPU per simulated client (``PAPER``), 5 rounds; it also prints how
busy the GPU was during the measured rounds (``nvidia-smi``: gpu_busy.py) and what a 300-round
run takes at the measured round (``--project-rounds``).

Both sides do the same work per round: all S clients (``fraction_train=1``) run K local FedACT
steps on their own partition, then the server aggregates (x, v_bar, Delta_G).

- Flower: ``fedact_app.cli.launch.run_simulation`` runs the app on a private SuperLink; a round's
  wall time is the ``seconds`` of its row in the run's ``metrics.jsonl`` (the ServerApp's
  round loop: messages out, client work, replies in, aggregation).
- Plain loop: the same pieces in this process (``fedact_app.tasks.vision`` partitions and batches,
  ``fedact_app.tasks.vision.models``, ``fedact_app.optim.FedACTAdamW``, ``fedact_app.train.train_steps``,
  the method's server rule from ``fedact_app.algorithms``), clients one after the other.

Round 1 (process and data start-up) and the last round (it also evaluates the global model)
are left out; the figures are medians over the rounds in between (with fewer than three rounds,
the last round, as a smoke run). The Flower round is split into
local compute (the clients' ``train-seconds``, each timed by its own clock, summed:
``client_train_seconds`` in metrics.jsonl), (de)serialization (measured here: every message of
a round taken torch -> ArrayRecord -> pickle -> ArrayRecord -> torch, as the app and the
simulation engine's Ray transport handle it), the server's reply checks and direction
consistency (measured here), aggregation (the plain loop's) and the rest, idle time and
overhead (scheduling, transport, waiting). The split assumes the clients run one at a time, as
they do with the default ``--num-cpus`` (all of them); where they run side by side (fewer CPUs,
or a share of a GPU, each) it is left out. Either way the round's critical path follows: the
path of its last reply, from the push of the round's messages to its pull (dispatch, the
client's work, the return; the columns of ``fedact_app.timeline``), then ``server_seconds``.
The same local work takes longer in a
simulated client than in the plain loop when Flower's and Ray's processes share its CPUs: the
line "client compute, Flower / plain loop" says by how much. The clients' trust-score
diagnostics are off in the Flower run (``diagnostics.trust_every=0``), so both sides train the
same; ``bench_diagnostics.py`` measures them. The plain loop trains as the clients do with the
run's ``precision``, ``channels_last`` and ``compile_model``. It also prints the median
``server_seconds`` (metrics.jsonl): the ServerApp's work after a round's last reply, which no
client overlaps (the other replies were decoded as they came), and how long the ServerApp's
evaluation of the initial model took, which runs while round 1's clients train.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

APP_DIR = Path(__file__).resolve().parents[1]
for _path in (APP_DIR, APP_DIR / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from flwr.app import MetricRecord, RecordDict  # noqa: E402

from fedact_app import timeline  # noqa: E402
from fedact_app.algorithms import ALGORITHMS, ClientUpdate, ServerRule, TensorDict  # noqa: E402
from fedact_app.config import Config, compose  # noqa: E402
from fedact_app.tasks.vision.batches import BatchStream  # noqa: E402
from fedact_app.tasks.vision.data import load_client_train  # noqa: E402
from fedact_app.diagnostics import direction_consistency, global_norm  # noqa: E402
from fedact_app.cli.launch import automatic_gpus, run_simulation  # noqa: E402
from fedact_app.cli.mps import HELP as MPS_HELP  # noqa: E402
from fedact_app.tasks.vision.models import build_model  # noqa: E402
from fedact_app.optim import FedACTAdamW  # noqa: E402
from fedact_app.registry import FEDACT_FAMILY  # noqa: E402
from fedact_app.replies import decode_update  # noqa: E402
from fedact_app.train import (batch_generator, compiled_for_training, cosine_lr, memory_format,  # noqa: E402
                              resolve_device, train_steps)
from fedact_app.wire import packed_record, unpacked  # noqa: E402
from gpu_busy import GpuBusy  # noqa: E402  (scripts/)

PAPER_OVERRIDES = ("dataset=synthetic dataset.num_classes=100 dataset.image_size=32 dataset.channels=3 "
                   "dataset.mean=[0.5,0.5,0.5] dataset.std=[0.25,0.25,0.25] dataset.num_train=50000 "
                   "dataset.num_test=10000 model=vit_tiny batch_size=50 device=cuda algorithm=fedact")
PAPER = dict(clients=10, local_steps=50, rounds=5, num_cpus=1, num_gpus=0.1)  # --paper's flags, unless given


def round_overrides(args: argparse.Namespace, output_dir: Path) -> str:
    """The run's overrides: every client in every round, no evaluation but at the end."""
    return " ".join([
        args.overrides,
        f"num_clients={args.clients} fraction_train=1.0 min_train_nodes={args.clients}",
        f"local_steps={args.local_steps} num_rounds={args.rounds} eval_every={args.rounds}",
        f"fraction_evaluate=0.0 diagnostics.trust_every=0 output_dir={output_dir}",
    ]).strip()


def flower_rounds(overrides: str, args: argparse.Namespace, output_dir: Path) -> tuple[list[dict], dict]:
    """The rows of metrics.jsonl of one simulation run (round 1 on), and its times: ``wall`` (the
    whole run), ``startup`` (seconds from the launch to each start-up phase of summary.json's
    ``startup``, None for a phase it lacks; ``first_round``: round 1's start), ``round_ends``
    (Unix time at the end of each row's round), ``round0_seconds`` (the initial evaluation's,
    None where the row does not say) and ``batches`` ((round, text) of each batch the batching
    worker logged, ``BATCH_LINE``: a ``client_batch`` run's)."""
    # RAY_DEDUP_LOGS=0: Ray folds lines of one pattern (numbers aside) from several processes into one
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "RAY_DEDUP_LOGS": "0"}
    begun = time.time()
    result = run_simulation(APP_DIR, overrides=overrides, num_supernodes=args.clients,
                            num_cpus_per_client=args.num_cpus, num_gpus_per_client=args.num_gpus,
                            timeout=args.timeout, env=env, cwd=output_dir, mps=args.mps)
    if not result.completed:
        raise RuntimeError(f"the Flower run did not complete ({result.status}; {result.details}):\n"
                           f"{result.tail()}")
    metrics = sorted(output_dir.glob("*/metrics.jsonl"))
    if not metrics:
        raise RuntimeError(f"no metrics.jsonl under {output_dir}:\n{result.tail()}")
    rows = [json.loads(line) for line in metrics[-1].read_text().splitlines() if line.strip()]
    initial = next((row for row in rows if row["round"] == 0), {})
    rows = [row for row in rows if row["round"] >= 1]
    startup = json.loads((metrics[-1].parent / "summary.json").read_text())["startup"]
    ends, clock = [], startup["first_round"]  # each round runs to the next one's start
    for row in rows:
        clock += row["seconds"]
        ends.append(clock)
    batches = [(int(m[1]), m[2]) for m in BATCH_LINE.finditer(result.log)]
    return rows, {"wall": result.seconds, "round_ends": ends, "round0_seconds": initial.get("seconds"),
                  "startup": {phase: None if at is None else at - begun for phase, at in startup.items()},
                  "batches": batches}


def serde_seconds(messages: list[dict[str, TensorDict]]) -> float:
    """Seconds to take every message torch -> ArrayRecord -> pickle -> ArrayRecord -> torch: the
    app's conversions on both ends and, between them, what the simulation engine does with a
    message (Flower 1.41 hands it to the client's Ray actor and back, pickled)."""
    start = time.perf_counter()
    for arrays in messages:
        content = RecordDict({key: packed_record(tensors) for key, tensors in arrays.items()})
        received = pickle.loads(pickle.dumps(content, protocol=pickle.HIGHEST_PROTOCOL))
        for key in arrays:
            unpacked(received[key])
    return time.perf_counter() - start


def server_check_seconds(updates: list[ClientUpdate], x: TensorDict, trainable: list[str],
                         server: ServerRule) -> float:
    """Seconds the ServerApp spends on the replies besides the rule's aggregation: each reply's
    checks (``decode_update``) and the round's diagnostics (DC, ||Delta_G||)."""
    contents = [RecordDict({"delta": packed_record(u.delta), **{k: packed_record(a) for k, a in u.arrays.items()},
                            "metrics": MetricRecord({"num-examples": u.num_examples, "num-steps": u.num_steps,
                                                     "lr-sum": u.lr_sum, "train-loss": 0.0})})
                for u in updates]
    start = time.perf_counter()
    decoded = [decode_update(c, x, server.reply_keys, trainable, server.nonnegative_keys) for c in contents]
    direction_consistency([u.delta for u in decoded], trainable)
    if "delta_g" in (broadcast := server.broadcast()):
        global_norm(broadcast["delta_g"])
    return time.perf_counter() - start


def plain_client_round(model: torch.nn.Module, optimizer: FedACTAdamW, named: list, x: TensorDict,
                       broadcast: dict[str, TensorDict], batches, *, lr: float, server_round: int,
                       local_steps: int, precision: str, channels_last: bool = False,
                       train_module: torch.nn.Module | None = None) -> ClientUpdate:
    """One client's round in the plain loop, as ``ClientTrainer.train_round`` takes it: from x^r
    with the server's ``broadcast`` (CPU tensors), K = ``local_steps`` steps on ``batches``."""
    device = next(model.parameters()).device
    model.load_state_dict(x)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.begin_round(
        **{key: [broadcast[key][name].to(device) for name, _ in named] if key in broadcast else None
           for key in ("v_bar", "delta_g")},
        global_step=(server_round - 1) * local_steps)
    stats = train_steps(model, optimizer, batches, local_steps, precision, channels_last, train_module=train_module)
    state = model.state_dict()
    delta = {name: state[name].detach().cpu() - x[name] for name in x}
    v = {name: t.detach().cpu().clone() for (name, _), t in zip(named, optimizer.second_moments())}
    return ClientUpdate(delta=delta, num_steps=local_steps, lr_sum=lr * local_steps,
                        num_examples=stats.num_examples, arrays={"v": v})


def plain_rounds(cfg: Config, rounds: int) -> list[dict]:
    """The same rounds in one process: seconds of client compute, aggregation and
    (de)serialization (what Flower adds to the round's messages) per round."""
    if cfg.algorithm.name not in FEDACT_FAMILY:
        raise ValueError(f"bench_round runs the FedACT family {FEDACT_FAMILY}, not {cfg.algorithm.name!r}")
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.dataset).to(device, memory_format=memory_format(cfg.channels_last))
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    a = cfg.algorithm
    optimizer = FedACTAdamW([p for _, p in named], lr=a.lr, betas=tuple(a.betas), eps=a.eps,
                            weight_decay=a.weight_decay, rho=a.rho, tau=a.tau, alpha=a.alpha, gamma=a.gamma,
                            trust_scope=a.trust_scope, trust_signal=a.trust_signal,
                            scale_matched=a.scale_matched)
    train_module = compiled_for_training(model, cfg.compile_model)  # the clients' compile_model
    trainable = [name for name, _ in named]
    server = ALGORITHMS[a.name].server(a, trainable, num_clients=cfg.num_clients)
    x = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    data = [load_client_train(cfg, i, cfg.num_clients).to(device) for i in range(cfg.num_clients)]
    rows = []
    for server_round in range(1, rounds + 1):
        lr = cosine_lr(server_round, rounds, a.lr, a.lr_min)
        broadcast = {key: dict(arrays) for key, arrays in server.broadcast().items()}
        started = time.perf_counter()
        updates = []
        for client in range(cfg.num_clients):
            batches = BatchStream(data[client], cfg.batch_size, cfg.dataset.augment,
                                  batch_generator(cfg.seed, server_round, client, device))
            updates.append(plain_client_round(model, optimizer, named, x, broadcast, batches, lr=lr,
                                              server_round=server_round, local_steps=cfg.local_steps,
                                              precision=cfg.precision, channels_last=cfg.channels_last,
                                              train_module=train_module))
        computed = time.perf_counter()
        checks = server_check_seconds(updates, x, trainable, server)
        x = server.aggregate(x, updates)
        aggregated = time.perf_counter()
        messages = [m for u in updates for m in ({"model": x, **broadcast}, {"delta": u.delta, **u.arrays})]
        rows.append(dict(round=server_round, compute=computed - started, checks=checks,
                         aggregation=aggregated - computed - checks, serde=serde_seconds(messages)))
    return rows


def measured(rows: list[dict], rounds: int) -> list[dict]:
    """Rows of rounds 2 .. rounds - 1 (or the last one when there are fewer than three)."""
    inner = [r for r in rows if 1 < r["round"] < rounds]
    return inner or rows[-1:]


STARTUP = (("process", "the simulation process (ServerApp and clients' dispatch) started"),
           ("serverapp", "the ServerApp began"),
           ("data", "its data checked"),
           ("model", "its model built"),
           ("task", "the model on its device"),
           ("first_round", "round 1 began"))
BATCH_LINE = re.compile(r"run \d+ round (\d+): (\d+ of \d+ messages trained at once in .*)$", re.M)  # gather's
PATH = (("push_seconds", "the ServerApp pushes the round's messages"),
        ("last_reply_start_seconds", "then the last reply's client starts"),
        ("last_reply_work_seconds", "its work: read the message, train, reply"),
        ("last_reply_return_seconds", "the reply reaches the ServerApp's pull"),
        ("server_seconds", "the ServerApp's work after it"))


def print_path(rows: list[dict]) -> None:
    """The round's critical path: the last reply's, from the push to the new state
    (fedact_app.timeline), median of the rounds, and what of the round lies outside it."""
    median = statistics.median
    print("the round's last reply, from the push to the new state (fedact_app.timeline; median of the rounds):")
    for key, name in PATH:
        print(f"  {name:44} {median(r[key] for r in rows):>7.3f} s")
    training = median(r["last_reply_train_seconds"] for r in rows)
    print(f"  {'of its work, training (its train-seconds)':44} {training:>7.3f} s")
    print(f"  {'the round outside this path':44} "
          f"{median(r['seconds'] - sum(r[key] for key, _ in PATH) for r in rows):>7.3f} s "
          "(sampling, making the messages, waits for work overlapping the round)")
    print(f"  the round's clients started {median(r['start_seconds_min'] for r in rows):.3f} to "
          f"{median(r['start_seconds_max'] for r in rows):.3f} s after the push")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``--quick``'s and ``--paper``'s settings applied (``--paper``'s only
    where the option was not given)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overrides", default="", help="Hydra overrides for both sides, e.g. 'model=resnet18'")
    parser.add_argument("--clients", type=int, default=4, help="S: clients, all sampled every round")
    parser.add_argument("--local-steps", type=int, default=50, help="K")
    parser.add_argument("--rounds", type=int, default=5, help="rounds 2 .. rounds-1 are measured")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1,
                        help="CPUs per simulated client (default: all, so clients run one at a time as in "
                             "the plain loop); also the plain loop's torch threads")
    parser.add_argument("--num-gpus", type=float, default=None,
                        help="GPUs per simulated client (default: the launcher's automatic share)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the Flower run")
    parser.add_argument("--mps", action="store_true", help=MPS_HELP)
    parser.add_argument("--quick", action="store_true", help="2 clients x 5 steps, 2 rounds (a smoke run)")
    parser.add_argument("--paper", action="store_true",
                        help="the seed's round on a GPU (module docstring); --overrides are added to its own")
    parser.add_argument("--project-rounds", type=int, default=300,
                        help="rounds of the run projected from the measured round (default 300, the seed's)")
    args = parser.parse_args(argv)
    given = {name for name in PAPER if getattr(args, name) != parser.get_default(name)}
    if args.quick and args.paper:
        parser.error("--quick and --paper exclude each other")
    if args.quick:
        args.clients, args.local_steps, args.rounds = 2, 5, 2
    if args.paper:
        vars(args).update({name: value for name, value in PAPER.items() if name not in given})
        args.overrides = f"{PAPER_OVERRIDES} {args.overrides}".strip()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.num_cpus)

    with tempfile.TemporaryDirectory(prefix="bench-round-") as tmp:
        output_dir = Path(tmp).resolve()
        overrides = round_overrides(args, output_dir)
        cfg = compose(overrides)
        if args.num_gpus is None:
            args.num_gpus = automatic_gpus(APP_DIR, overrides, args.num_cpus)
        plain = measured(plain_rounds(cfg, args.rounds), args.rounds)
        with GpuBusy() as busy:
            flower_rows, times = flower_rounds(overrides, args, output_dir)
    flower = measured(flower_rows, args.rounds)
    flower_wall = times["wall"]

    def median(rows: list[dict], key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    compute, aggregation = median(plain, "compute"), median(plain, "aggregation")
    serde, checks = median(plain, "serde"), median(plain, "checks")
    flower_round, plain_round = median(flower, "seconds"), compute + aggregation
    client_compute = median(flower, "client_train_seconds")
    rest = flower_round - client_compute - aggregation - serde - checks
    device = resolve_device(cfg.device)
    mps = ", --mps" if args.mps else ""
    print(f"\n{cfg.algorithm.name} on {cfg.dataset.name} / {cfg.model.name}: S={cfg.num_clients} clients x "
          f"K={cfg.local_steps} steps, batch {cfg.batch_size}, {device} ({args.num_cpus} CPUs per client, "
          f"{args.num_gpus:g} GPUs{mps}); rounds {flower[0]['round']}..{flower[-1]['round']} of {args.rounds} "
          f"(median); Flower run {flower_wall:.1f} s in all, start-up included")
    print(f"{'':38} {'s/round':>9} {'share':>7}")
    print(f"{'Flower simulation round':38} {flower_round:>9.3f} {'100%':>7}")
    side_by_side = args.clients > 1 and (args.num_cpus < (os.cpu_count() or 1) or 0 < args.num_gpus < 1)
    if side_by_side:  # summed clocks exceed the round: its last reply's path below splits it instead
        print("  (the clients ran side by side, fewer CPUs or GPUs each than the machine has: the round's "
              "last reply below says where its time went)")
    else:
        for name, seconds in (("  local compute (the clients' clocks)", client_compute),
                              ("  (de)serialization (measured here)", serde),
                              ("  reply checks, DC (measured here)", checks),
                              ("  aggregation (plain loop's)", aggregation),
                              ("  idle / overhead (the rest)", rest)):
            print(f"{name:38} {seconds:>9.3f} {100 * seconds / flower_round:>6.0f}%")
    print(f"{'plain PyTorch loop round':38} {plain_round:>9.3f}")
    print(f"{'  local compute':38} {compute:>9.3f}")
    print(f"client compute, Flower / plain loop: {client_compute / compute:.2f}"
          + (" (summed over clients side by side)" if side_by_side else ""))
    bytes_round = median(flower, "bytes_sent") + median(flower, "bytes_received") if "bytes_sent" in flower[0] else 0
    print(f"bytes per round (sent + received): {bytes_round / 2**20:.1f} MiB")
    print(f"ratio Flower / plain loop: {flower_round / plain_round:.2f}")
    if all("server_seconds" in row for row in flower):
        print(f"the ServerApp's work after a round's last reply (server_seconds: that reply's decode, the "
              f"checks, the rule, the next state's record): {median(flower, 'server_seconds'):.3f} s")
    if all(key in row for row in flower for key in (*timeline.COLUMNS, "server_seconds")):
        print_path(flower)
    if device.type == "cuda":
        ends = times["round_ends"]
        first, last = flower[0]["round"], flower[-1]["round"]
        share = busy.mean(ends[first - 2] if first > 1 else ends[0] - flower_rows[0]["seconds"], ends[last - 1])
        # nvidia-smi's utilization is the share of time some kernel ran: times the round, that time
        print(f"GPU busy during rounds {first}..{last} (nvidia-smi utilization, mean of "
              f"{busy.period_ms} ms samples): " + ("n/a (no samples)" if share is None else
                                                   f"{share:.0f}%, a kernel running {share / 100 * flower_round:.2f} s "
                                                   f"of the {flower_round:.2f} s round"))
    if cfg.client_batch:
        print("the batching worker's batches (fedact_app.node_worker.gather's log):")
        batches = [(r, text) for r, text in times["batches"] if flower[0]["round"] <= r <= flower[-1]["round"]]
        for server_round, text in batches:
            print(f"  round {server_round}: {text}")
        if not batches:
            print("  none in the run's log: its messages were trained in the ClientApps")
    rounds_done = flower_rows[-1]["round"]
    startup = times["startup"]
    projected = startup["first_round"] + flower_rows[0]["seconds"] + (args.project_rounds - 1) * flower_round
    evaluation = ("" if times["round0_seconds"] is None else
                  f" (the ServerApp's evaluation of the initial model, {times['round0_seconds']:.1f} s, ran while "
                  f"round 1's clients trained)")
    print(f"round 1 started {startup['first_round']:.1f} s after the launch{evaluation}; this {rounds_done}-round "
          f"run took {flower_wall:.1f} s; a {args.project_rounds}-round run at this round: {projected:.0f} s "
          f"({projected / 60:.1f} min)")
    phases = [f"{name} {startup[phase]:.1f} s" for phase, name in STARTUP if startup.get(phase) is not None]
    print("start-up, after the launch: " + ", ".join(phases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
