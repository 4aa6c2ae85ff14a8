"""Benchmark: a whole app run, and a sweep's jobs, against a plain PyTorch loop doing the same work.

    python scripts/bench_run.py                          # the README's digits run, 2 repeats, 3 sweep jobs
    python scripts/bench_run.py --setting vit --data /work/data/fmnist   # the tiny-ViT Fashion-MNIST run of docs/RESULTS.md
    python scripts/bench_run.py --quick                  # a smoke run (2 rounds, 1 repeat, 2 jobs)

Four parts, measured in one go, with ratios to the plain loop measured in the same go:

1. **Whole run**: what ``python -m fedact_app.cli.launch`` does, called in this process
   (``run_simulation``: a fresh SuperLink, Ray started inside the run, start to return; the
   launcher's own start, about 1.5 s of imports, is not in it) against the plain loop as its own Python
   process (spawn to exit: imports, data, model, every round, evaluation). The app run's wall time
   is split with its ``summary.json`` clocks: start-up (SuperLink, the run's submission, the simulation
   process, imports, task and model) until the run folder exists; the ServerApp outside its
   rounds (its start and its writes: the identification queries and the initial model's
   evaluation are in round 1, the evaluation beside round 1's clients), its rounds, and shutdown
   (after the final model is written: the launcher's stop of the processes; it does not wait for
   Flower's own shutdown of a run whose ServerApp has ended).
2. **Rounds**: the app's rounds 1..R (``metrics.jsonl`` ``seconds``, evaluation included) against
   the plain loop's, summed (its round 1 with the initial evaluation, as the app's), and the median
   round of each.
3. **Sweep jobs**: N runs (seeds 1..N) on one engine as ``scripts/sweep.py`` makes it
   (:meth:`fedact_app.cli.engine.LocalEngine.for_sweep`: one SuperLink, one Ray cluster, a job
   starting while the last one shuts down); the wall time per job after the first (the time
   between two jobs' ends), and the fixed cost per job (that minus the plain loop's whole run).
   With ``--max-parallel P`` the same jobs run again P at a time (``scripts/sweep.py
   --max-parallel``: each run its own Ray cluster), and the two sweeps' wall times are compared.
4. **Flower's floor** (``--no-floor`` skips it): the same, for a Flower app that computes
   nothing (``scripts/flower_floor``: the run's nodes, clients per round and rounds, float32
   messages of the app's shapes, the app's reply loop), run alone and as sweep jobs on the same
   engine. Its rounds 2..R are Flower's message path alone; "floor + plain" puts the plain loop's
   rounds in their place: what the app would cost if Flower cost it no more than the floor (whole
   run: floor run - its rounds 2..R + plain rounds; fixed cost per job: floor job - its rounds 2..R
   + plain rounds - plain run). A round of the floor locks to the 0.1 s poll of Flower's
   dispatch loop; a job of :data:`SINGLE_ROUNDS` rounds of one message each, started at a random
   phase of that poll, measures the wait a computing round has (their mean), and "plain round +
   that" the round it leaves; "floor + plain + that wait" adds that wait to each of rounds 2..R, since a
   round whose clients compute starts at a random point of the poll (the floor's own rounds do
   not wait it: they lock to the poll). Where "floor + plain" (or, stricter, "+ that wait")
   misses a target, the app cannot meet it on this engine by changes to its own computing.

The plain loop uses the app's own pieces (the ServerApp's ``initial_model`` and
``CentralEvaluator``, ``ClientTrainer``, the method's server rule, ``sample_clients``), clients one after another in one process with the
machine's torch threads; the app runs its clients in Ray actors of ``--num-cpus`` CPUs each (default 1). The repeats are
interleaved (plain, app, plain, app, ...); figures are medians with the range over repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

APP_DIR = Path(__file__).resolve().parents[1]
FLOOR_DIR = APP_DIR / "scripts" / "flower_floor"  # the app's federation and messages, no compute
DISPATCH_POLL = 0.1  # seconds between two polls of Flower 1.41's simulation dispatch loop (vce_api)
SINGLE_ROUNDS = 30  # rounds of the floor's job of one message a round
if str(APP_DIR) not in sys.path:
    sys.path.insert(0, str(APP_DIR))

SETTINGS = {
    "digits": "",  # the README's main run: the config's defaults
    "vit": ("dataset=fashion_mnist dataset.augment=false model=vit_tiny model.kwargs.patch_size=7 "
            "model.kwargs.embed_dim=64 model.kwargs.depth=2 model.kwargs.num_heads=2 "
            "model.kwargs.mlp_ratio=2.0 partition.alpha=0.1 num_clients=20 fraction_train=0.25 "
            "min_train_nodes=5 local_steps=10 batch_size=32 num_rounds=60 eval_every=5 algorithm.lr=1e-3"),
}
ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


# ------------------------------------------------------------------ the plain loop (its own process)


def plain_run(overrides: str) -> dict:
    """The run's rounds in this process with the app's pieces; per-round seconds and accuracy."""
    from fedact_app.algorithms import ALGORITHMS
    from fedact_app.client_trainer import ClientTrainer
    from fedact_app.config import compose
    from fedact_app.sampling import sample_clients, sample_count
    from fedact_app.server_app import CentralEvaluator, initial_model
    from fedact_app.train import cosine_lr

    cfg = compose(overrides)
    task, model, x, trainable = initial_model(cfg)
    a = cfg.algorithm
    rule = ALGORITHMS[a.name].server(a, trainable, num_clients=cfg.num_clients)
    evaluator = CentralEvaluator(cfg, task, model)
    trainer = ClientTrainer(cfg)
    kept: dict[int, dict] = {}
    evaluating = time.perf_counter()
    evaluator(0, x)
    initial_evaluation = time.perf_counter() - evaluating  # the app's round 1 holds it (its clients train meanwhile)
    rounds, accuracy = [], None
    count = sample_count(cfg.num_clients, cfg.fraction_train, cfg.min_train_nodes)
    for server_round in range(1, cfg.num_rounds + 1):
        started = time.perf_counter()
        clients = sorted(sample_clients(range(cfg.num_clients), count, seed=cfg.seed,
                                        server_round=server_round, purpose="train"))
        lr = cosine_lr(server_round, cfg.num_rounds, a.lr, a.lr_min)
        received = rule.broadcast()
        updates = []
        for client in clients:
            result = trainer.train_round(x, received, partition_id=client, num_partitions=cfg.num_clients,
                                         server_round=server_round, lr=lr, local_steps=cfg.local_steps,
                                         global_step=(server_round - 1) * cfg.local_steps,
                                         client_state=kept.get(client))
            kept[client] = result.client_state
            updates.append(result.update)
        x = rule.aggregate(x, updates)
        if (metrics := evaluator(server_round, x)) is not None:
            accuracy = metrics.get("test_accuracy", accuracy)
        rounds.append(time.perf_counter() - started)
    rounds[0] += initial_evaluation
    # what a training message carries (the global model, the broadcast arrays) and a reply (the
    # delta, the method's reply arrays), for the floor app's messages of the same size: one array
    # a record, as fedact_app.wire packs them
    out = [x, *rule.broadcast().values()]
    back = [updates[-1].delta, *updates[-1].arrays.values()]
    return {"rounds": rounds, "final_test_accuracy": accuracy,
            "shapes_out": [[sum(t.numel() for t in arrays.values())] for arrays in out],
            "shapes_back": [[sum(t.numel() for t in arrays.values())] for arrays in back],
            "clients_per_round": count,
            "num_clients": cfg.num_clients, "num_rounds": cfg.num_rounds}


def plain_process(overrides: str) -> dict:
    """:func:`plain_run` as its own Python process; its wall time from spawn to exit added."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "--plain-child", overrides], capture_output=True,
                          text=True, env={**os.environ, **ENV}, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the plain loop failed:\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "wall": time.monotonic() - started}


# ------------------------------------------------------------------ the app


def run_record(output: Path) -> dict:
    """The rounds' seconds and the summary of the one run under ``output``."""
    (folder,) = [p for p in output.iterdir() if (p / "summary.json").is_file()]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((folder / "summary.json").read_text())
    return {"rounds": [r["seconds"] for r in rows if r["round"] >= 1], "summary": summary}


def completed(result, what: str):
    """``result`` (a RunResult), or RuntimeError naming ``what`` when the run did not complete."""
    if not result.completed:
        raise RuntimeError(f"{what} did not complete: {result.status} {result.details}\n{result.tail()}")
    return result


def app_alone(overrides: str, output: Path, num_cpus: int) -> dict:
    """One launcher run, as ``python -m fedact_app.cli.launch`` makes it; its wall time split."""
    from fedact_app.cli.launch import run_simulation
    from fedact_app.config import compose

    cfg = compose(overrides)
    begun = time.time()
    result = completed(run_simulation(APP_DIR, overrides=f"{overrides} output_dir={output}".strip(),
                                      num_supernodes=cfg.num_clients, num_cpus_per_client=num_cpus,
                                      timeout=3600, env=ENV), "the app run")
    ended = time.time()
    record = run_record(output)
    summary = record["summary"]
    rounds = sum(record["rounds"])
    return {**record, "wall": result.seconds, "startup": summary["started_at"] - begun,
            "round0": summary["seconds"] - rounds, "shutdown": ended - summary["finished_at"],
            "final_test_accuracy": summary["final_test_accuracy"]}


def floor_config(plain: dict, output: Path, clients_per_round: int | None = None, phase_jitter: float = 0.0,
                 num_rounds: int | None = None, distinct_arrays: bool = False) -> dict:
    """The floor app's run config (scripts/flower_floor): the plain run's nodes, clients per round,
    rounds and message shapes unless given; its rounds' seconds go to ``output``."""
    return {"num-rounds": num_rounds or plain["num_rounds"], "num-nodes": plain["num_clients"],
            "clients-per-round": clients_per_round or plain["clients_per_round"], "seed": 0,
            "phase-jitter": float(phase_jitter), "distinct-arrays": distinct_arrays,
            "shapes-out": json.dumps(plain["shapes_out"]), "shapes-back": json.dumps(plain["shapes_back"]),
            "output": str(output)}


def floor_record(result, output: Path) -> dict:
    """A floor run's wall time and rounds' seconds; RuntimeError if it did not complete or a
    message of it had no reply."""
    completed(result, "a floor run")
    record = json.loads(output.read_text())
    if not record["answered"]:
        raise RuntimeError(f"a floor run had messages without a reply:\n{result.tail()}")
    return {**record, "wall": result.seconds}


def floor_alone(plain: dict, output: Path, num_cpus: int) -> dict:
    """One launcher run of the floor app."""
    from fedact_app.cli.launch import run_simulation

    return floor_record(run_simulation(FLOOR_DIR, run_config=floor_config(plain, output),
                                       num_supernodes=plain["num_clients"], num_cpus_per_client=num_cpus,
                                       timeout=3600, env=ENV), output)


def app_job(overrides: str, seed: int, output: Path, num_cpus: int) -> Callable:
    """A sweep job of the app (seed ``seed``): a function of the engine returning its record."""
    from fedact_app.config import compose

    num_clients = compose(overrides).num_clients

    def run(engine) -> dict:
        result = completed(engine.run(APP_DIR, overrides=f"{overrides} seed={seed} output_dir={output}".strip(),
                                      num_supernodes=num_clients, num_cpus_per_client=num_cpus, timeout=3600),
                           f"sweep job {seed}")
        return {**run_record(output), "wall": result.seconds}

    return run


def floor_job(plain: dict, output: Path, num_cpus: int, **config: Any) -> Callable:
    """A sweep job of the floor app (``config``: :func:`floor_config`'s keywords): a function of
    the engine returning its record."""
    def run(engine) -> dict:
        return floor_record(engine.run(FLOOR_DIR, run_config=floor_config(plain, output, **config),
                                       num_supernodes=plain["num_clients"], num_cpus_per_client=num_cpus,
                                       timeout=3600), output)

    return run


def sweep(jobs: list[Callable], max_parallel: int = 1) -> list[dict]:
    """``jobs`` (functions of the engine) on one engine as ``scripts/sweep.py --max-parallel
    max_parallel`` runs them; each job's record with its end (seconds after the sweep's start)."""
    from fedact_app.cli.engine import LocalEngine

    with LocalEngine.for_sweep(max_parallel, env=ENV) as engine:
        def job(run: Callable) -> dict:
            return {**run(engine), "end": time.monotonic() - started}

        started = time.monotonic()
        pool = ThreadPoolExecutor(engine.max_parallel)
        try:
            return list(pool.map(job, jobs))
        except BaseException:  # a failed job, Ctrl-C: stop the runs in flight, not wait for the queue
            engine.close()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


# ------------------------------------------------------------------ report


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """median [min-max]"""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"{os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}"


def report(setting: str, overrides: str, plain: list[dict], alone: list[dict], jobs: list[dict],
           num_cpus: int, sweeps: dict[int, tuple[float, list[float]]] | None = None,
           floor: dict | None = None) -> str:
    """The table; ``sweeps``: per --max-parallel value (1 and the asked one) the sweep's wall time
    and its jobs' own wall times; ``floor``: the floor app's runs alone (``"alone"``), its sweep
    jobs (``"jobs"``) and its job of one message a round (``"single"``)."""
    import torch

    med = statistics.median
    plain_rounds = [sum(p["rounds"]) for p in plain]
    lines = [f"bench_run: setting {setting!r} ({overrides or 'the config defaults'})",
             f"machine: {machine()}; torch {torch.__version__}, {torch.get_num_threads()} threads in the "
             f"plain loop, {num_cpus} CPU(s) per simulated client",
             f"{len(plain)} repeats, interleaved; median [min-max] in seconds", "",
             f"{'':44} {'seconds':>22} {'/ plain':>8}",
             f"{'plain loop, whole process':44} {spread([p['wall'] for p in plain]):>22}",
             f"{'  its rounds (1..R)':44} {spread(plain_rounds):>22}"]
    walls = [a["wall"] for a in alone]
    lines.append(f"{'1. app run alone (launcher, start to exit)':44} {spread(walls):>22} "
                 f"{med(walls) / med([p['wall'] for p in plain]):>7.2f}x")
    for name, key in (("start-up until the run folder", "startup"),
                      ("ServerApp outside rounds 1..R", "round0")):
        lines.append(f"{'  ' + name:44} {spread([a[key] for a in alone]):>22}")
    app_rounds = [sum(a["rounds"]) for a in alone]
    lines.append(f"{'  round 1 (Ray, actors, ids, initial eval)':44} {spread([a['rounds'][0] for a in alone]):>22}")
    lines.append(f"{'  rounds 2..R':44} {spread([sum(a['rounds'][1:]) for a in alone]):>22}")
    lines.append(f"{'  shutdown after the final model':44} {spread([a['shutdown'] for a in alone]):>22}")
    lines.append(f"{'2. app rounds 1..R, summed':44} {spread(app_rounds):>22} {med(app_rounds) / med(plain_rounds):>7.2f}x")
    steady_app = [med(a["rounds"][1:]) for a in alone if len(a["rounds"]) > 1]
    steady_plain = [med(p["rounds"][1:]) for p in plain if len(p["rounds"]) > 1]
    if steady_app and steady_plain:
        lines.append(f"{'   median round 2..R: app / plain':44} {spread(steady_app, '{:.3f}'):>22} "
                     f"{med(steady_app) / med(steady_plain):>7.2f}x  (plain {spread(steady_plain, '{:.3f}')})")
    if jobs:
        ends = sorted(j["end"] for j in jobs)
        gaps = [later - earlier for earlier, later in zip(ends, ends[1:])] or ends
        plain_wall = med([p["wall"] for p in plain])
        lines.append(f"{'3. sweep, wall per job after the first':44} {spread(gaps):>22} "
                     f"{med(gaps) / plain_wall:>7.2f}x")
        lines.append(f"{'   first job (starts SuperLink and Ray)':44} {ends[0]:>22.1f}")
        lines.append(f"{'   fixed cost per job (wall per job - plain run)':44} {spread([g - plain_wall for g in gaps]):>22}")
        lines.append(f"{'   its rounds 1..R':44} {spread([sum(j['rounds']) for j in jobs[1:] or jobs]):>22}")
    if sweeps and len(sweeps) > 1:
        sequential = sweeps[1][0]
        for parallel, (wall, walls) in sorted(sweeps.items()):
            own = f" (a job's own wall {spread(walls)})" if parallel > 1 else ""
            lines.append(f"{f'   --max-parallel {parallel}: sweep wall / {len(jobs)} jobs':44} {wall / len(jobs):>22.1f} "
                         f"{wall / sequential:>7.2f}x of --max-parallel 1{own}")
    if floor and floor["alone"]:
        lines += floor_report(plain, floor)
    accuracy = {round(p["final_test_accuracy"], 4) for p in plain} | {round(a["final_test_accuracy"], 4) for a in alone}
    lines += ["", f"final test accuracy, plain loop and app runs (one seed): {sorted(accuracy)}"]
    return "\n".join(lines)


def floor_report(plain: list[dict], floor: dict) -> list[str]:
    """The floor app's rows, and what each leaves the app: the floor with the plain loop's compute
    in place of its rounds 2..R (which, computing nothing, are Flower's message path alone)."""
    med = statistics.median
    plain_wall = med([p["wall"] for p in plain])
    plain_rounds = med([sum(p["rounds"]) for p in plain])
    plain_round = med([med(p["rounds"][1:] or p["rounds"]) for p in plain])

    def row(name: str, seconds: str, ratio: float | None = None) -> str:
        return f"{name:44} {seconds:>22}" + ("" if ratio is None else f" {ratio:>7.2f}x")

    walls = [f["wall"] for f in floor["alone"]]
    floor_with_plain = med([f["wall"] - sum(f["rounds"][1:]) for f in floor["alone"]]) + plain_rounds
    floor_round = med([med(f["rounds"][1:] or f["rounds"]) for f in floor["alone"]])
    lines = ["", "Flower's floor: scripts/flower_floor, the same nodes, clients a round, rounds and message",
             "sizes, nothing computed; 'floor + plain': its rounds 2..R replaced by the plain loop's rounds",
             row("F1. floor run alone (launcher, start to exit)", spread(walls), med(walls) / plain_wall),
             row("   floor + plain rounds", f"{floor_with_plain:.1f}", floor_with_plain / plain_wall),
             row(f"F2. floor median round, {plain[0]['clients_per_round']} messages, locked",
                 f"{floor_round:.3f}")]
    waits = 0.0  # what computing rounds 2..R wait for Flower's dispatch poll, which the floor's locked rounds do not
    if floor.get("single"):
        # the mean, not the median: the reply loop's pulls (fedact_app.strategy.poll_cap) come at
        # fixed times after the push, so these rounds fall on a few levels and their median jumps
        # between them from go to go, while the mean is the expected wait
        latency = statistics.fmean(floor["single"]["rounds"][1:] or floor["single"]["rounds"])
        waits = latency * (len(plain[0]["rounds"]) - 1)
        lines += [row("   1 message a round at a random phase, mean", f"{latency:.3f}"),
                  row("   plain round + that", f"{plain_round + latency:.3f}", (plain_round + latency) / plain_round),
                  row("   floor + plain + that wait, rounds 2..R", f"{floor_with_plain + waits:.1f}",
                      (floor_with_plain + waits) / plain_wall)]
    if len(floor.get("jobs", ())) > 1:
        ends = sorted(j["end"] for j in floor["jobs"])
        gaps = [later - earlier for earlier, later in zip(ends, ends[1:])]
        fixed = med(gaps) - med([sum(j["rounds"][1:]) for j in floor["jobs"]]) + plain_rounds - plain_wall
        lines += [row("F3. floor sweep, wall per job after the first", spread(gaps), med(gaps) / plain_wall),
                  row("   floor + plain: fixed cost per job", f"{fixed:.1f}")]
        if floor.get("single"):
            lines.append(row("   floor + plain + wait: fixed cost per job", f"{fixed + waits:.1f}"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="digits")
    parser.add_argument("--data", default=None, help="dataset.path (the vit setting's Fashion-MNIST folder)")
    parser.add_argument("--overrides", default="", help="more Hydra overrides for every run")
    parser.add_argument("--repeats", type=int, default=2, help="plain/app pairs, interleaved")
    parser.add_argument("--jobs", type=int, default=3, help="sweep jobs on one engine (0: none)")
    parser.add_argument("--max-parallel", type=int, default=1,
                        help="also run the sweep jobs this many at a time (each run its own Ray cluster) and "
                             "compare the sweep's wall time with one at a time")
    parser.add_argument("--num-cpus", type=int, default=1,
                        help="CPUs per simulated client (default 1, the launcher's; one Ray actor each)")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip the floor app's runs (scripts/flower_floor: Flower's own costs)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 1 repeat, 2 jobs (a smoke run)")
    parser.add_argument("--plain-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.max_parallel < 1:
        parser.error(f"--max-parallel must be >= 1, got {args.max_parallel}")
    if args.max_parallel > 1 and args.jobs < 2:
        parser.error(f"--max-parallel {args.max_parallel} compares sweeps of --jobs >= 2, got --jobs {args.jobs}")
    if args.plain_child is not None:
        print(json.dumps(plain_run(args.plain_child)))
        return 0
    if args.setting == "vit" and not args.data:
        parser.error("--setting vit needs --data <Fashion-MNIST folder> (scripts/data/fashion_mnist.py)")
    overrides = " ".join(filter(None, [SETTINGS[args.setting], f"dataset.path={args.data}" if args.data else "",
                                       args.overrides, "num_rounds=2" if args.quick else ""]))
    if args.quick:
        args.repeats, args.jobs = 1, min(args.jobs, 2)
    plain, alone, floor = [], [], {"alone": [], "jobs": [], "single": None}
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        base = Path(tmp)
        for repeat in range(args.repeats):
            plain.append(plain_process(overrides))
            alone.append(app_alone(overrides, base / f"alone-{repeat}", args.num_cpus))
            if args.floor:
                floor["alone"].append(floor_alone(plain[0], base / f"floor-alone-{repeat}.json", args.num_cpus))
        jobs, sweeps = [], {}
        for parallel in sorted({1, args.max_parallel}) if args.jobs else ():
            runs = [app_job(overrides, seed, base / f"job-p{parallel}-{seed}", args.num_cpus)
                    for seed in range(1, args.jobs + 1)]
            if parallel == 1 and args.floor:  # the floor's jobs on the same engine, after the app's
                runs += [floor_job(plain[0], base / f"floor-job-{i}.json", args.num_cpus) for i in range(args.jobs)]
                runs.append(floor_job(plain[0], base / "floor-job-single.json", args.num_cpus, clients_per_round=1,
                                      phase_jitter=DISPATCH_POLL, num_rounds=SINGLE_ROUNDS))
            found = sweep(runs, parallel)
            jobs = jobs or found[:args.jobs]
            sweeps[parallel] = (max(j["end"] for j in found[:args.jobs]), [j["wall"] for j in found[:args.jobs]])
            if parallel == 1 and args.floor:
                floor["jobs"], floor["single"] = found[args.jobs:-1], found[-1]
    print(report(args.setting, overrides, plain, alone, jobs, args.num_cpus, sweeps, floor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
