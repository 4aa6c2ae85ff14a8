"""Benchmark: one config as a local deployment with warm workers, cold, Flower's floor, and in simulation.

    python scripts/bench_deploy.py                  # digits, 4 SuperNodes, K = 10, 5 rounds, 1 repeat
    python scripts/bench_deploy.py --repeats 3      # modes interleaved, medians with their ranges
    python scripts/bench_deploy.py --quick          # a smoke run (2 nodes, 2 rounds)
    python scripts/bench_deploy.py --overrides "model=vit_tiny dataset=synthetic ... device=cuda" \\
        --cuda-devices 0

Each deployment mode brings up its own ``scripts/deploy/local_cluster.py`` cluster (TLS, node
authentication, one SuperNode per client, ``num_clients`` of them), submits one run and takes it
down again; the cluster's start is not timed. The modes:

- **warm**: the app as deployed by default, a warm worker per SuperNode (``fedact_app.node_worker``);
- **cold**: the same with ``warm-worker=false`` in every node config: a fresh ClientApp process
  imports torch, builds the task and trains, for every message;
- **floor**: ``scripts/flower_floor``, a Flower app whose ClientApp imports Flower and NumPy only
  and answers at once with one array for each of the app's reply records, of its size, on the
  same cluster set-up: the seconds a round costs before any app does anything. Its arrays are
  zeros, and Flower sends equal arrays once (content-addressed objects), so its messages are
  fewer objects than the app's;
- **floor-distinct**: the floor with every array of every message of its own content
  (``distinct-arrays``): as many objects as the app's messages;
- **simulation**: ``python -m fedact_app.cli.launch``'s run of the same config, each client with
  as many CPUs (so torch threads) as ``local_cluster.py`` gives each SuperNode.

Per mode: the median round of rounds 2..R (``metrics.jsonl`` ``seconds``; the floor's own clock),
round 1, and the whole run (submitted to finished, as ``flwr ls`` reports it). The plain loop's
median round (``scripts/bench_run.py``'s, the same clients one after another in one process) is
the compute a round holds; "floor + plain" is what a round would cost if the app added only its
compute to Flower's floor. Last, whether warm and cold (and the simulation) gave the same
``metrics.jsonl`` (wall-clock columns aside) and the same final model, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(SCRIPTS), str(SCRIPTS / "deploy")]
import bench_run  # noqa: E402  (its plain loop, its simulation run and its floor's config)
import local_cluster as lc  # noqa: E402

APP_DIR = SCRIPTS.parent
DEFAULT = "num_clients=4 fraction_train=1.0 min_train_nodes=4 num_rounds=5 local_steps=10"
QUICK = "num_clients=2 fraction_train=1.0 min_train_nodes=2 num_rounds=2 local_steps=2"
MODES = ("floor", "floor-distinct", "warm", "cold", "simulation")
WARM_OFF = "partition-id={i} num-partitions={n} warm-worker=false"


def deployed(mode: str, overrides: str, plain: dict, work: Path, cuda_devices: list[str]) -> dict:
    """One run of ``mode`` ("warm", "cold", "floor" or "floor-distinct") on a fresh local cluster."""
    template = WARM_OFF if mode == "cold" else lc.DEFAULT_TEMPLATE
    cluster = lc.up(work / "cluster", plain["num_clients"], node_config_template=template,
                    cuda_devices=cuda_devices, cwd=work, env=bench_run.ENV, timeout=180, quiet=True)
    try:
        if mode.startswith("floor"):
            config = bench_run.floor_config(plain, work / "floor.json", distinct_arrays=mode == "floor-distinct")
            run_id = lc.submit(cluster, SCRIPTS / "flower_floor", run_config=config)
        else:
            run_id = lc.submit(cluster, APP_DIR, overrides=f"{overrides} output_dir={work / 'out'}")
        submitted = time.monotonic()
        state, details, log = lc.wait_run(cluster, run_id, timeout=3600)
        wall = time.monotonic() - submitted
    finally:
        lc.down(cluster, quiet=True)
    if state != "finished:completed":
        raise RuntimeError(f"the {mode} deployment run ended {state} {details}:\n{log[-3000:]}")
    if mode.startswith("floor"):
        record = json.loads((work / "floor.json").read_text())
        if not record["answered"]:
            raise RuntimeError(f"the floor run had messages without a reply:\n{log[-3000:]}")
        return {"rounds": record["rounds"], "wall": wall}
    return {**bench_run.run_record(work / "out"), "wall": wall, "run_dir": str(_run_dir(work / "out"))}


def simulated(overrides: str, plain: dict, work: Path) -> dict:
    """The launcher's run of the same config, each client with the CPUs (so the torch threads) a
    local cluster's SuperNode gets (``local_cluster.threads_per_node``)."""
    record = bench_run.app_alone(overrides, work / "out", lc.threads_per_node(plain["num_clients"]))
    return {**record, "run_dir": str(_run_dir(work / "out"))}


def _run_dir(output: Path) -> Path:
    (folder,) = [p for p in output.iterdir() if (p / "summary.json").is_file()]
    return folder


def same_results(a: str, b: str) -> str:
    """"equal" when two run folders hold the same metrics (wall-clock columns aside) and the same
    final model bit for bit, else what differs."""
    import torch
    from safetensors.torch import load_file

    def rows(folder: str) -> list[dict]:
        lines = (Path(folder) / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if "seconds" not in k} for line in lines if line.strip()]

    ra, rb = rows(a), rows(b)
    if ra != rb:
        where = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
        return f"metrics differ from round {where}"
    ma, mb = load_file(str(Path(a) / "model.safetensors")), load_file(str(Path(b) / "model.safetensors"))
    if ma.keys() != mb.keys():
        return "the final models hold different tensors"
    gap = max((ma[k].double() - mb[k].double()).abs().max().item() for k in ma)
    return "equal" if all(torch.equal(ma[k], mb[k]) for k in ma) else f"final models differ by up to {gap:.2e}"


def median_round(record: dict) -> float:
    later = record["rounds"][1:] or record["rounds"]
    return statistics.median(later)


def report(overrides: str, plain: dict, results: dict[str, list[dict]]) -> list[str]:
    spread = bench_run.spread
    plain_round = statistics.median(plain["rounds"][1:] or plain["rounds"])
    lines = [f"# bench_deploy: {bench_run.machine()}",
             f"config: {overrides}; {plain['num_clients']} SuperNodes, "
             f"{plain['clients_per_round']} clients a round, {plain['num_rounds']} rounds",
             "", "| mode | median round 2..R, s | round 1, s | whole run, s |", "|---|---:|---:|---:|"]
    for mode, records in results.items():
        lines.append(f"| {mode} | {spread([median_round(r) for r in records], '{:.2f}')} | "
                     f"{spread([r['rounds'][0] for r in records], '{:.2f}')} | "
                     f"{spread([r['wall'] for r in records])} |")
    lines.append(f"| plain loop (compute) | {plain_round:.2f} | {plain['rounds'][0]:.2f} | |")
    for base in ("floor", "floor-distinct"):
        if base not in results:
            continue
        floor = statistics.median(median_round(r) for r in results[base])
        floor1 = statistics.median(r["rounds"][0] for r in results[base])
        lines += ["", f"{base} + plain: {floor + plain_round:.2f} s a round"]
        for mode in ("warm", "cold"):
            if mode in results:
                lines.append(f"{mode} - {base}: median round "
                             f"{statistics.median(median_round(r) for r in results[mode]) - floor:+.2f} s, round 1 "
                             f"{statistics.median(r['rounds'][0] for r in results[mode]) - floor1:+.2f} s")
    if "warm" in results:
        warm = results["warm"][0]["run_dir"]
        for other in ("cold", "simulation"):
            if other in results:
                lines.append(f"results, warm vs {other}: {same_results(warm, results[other][0]['run_dir'])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overrides", default=DEFAULT, help=f"the run's Hydra overrides (default: {DEFAULT!r})")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each mode, interleaved (default 1)")
    parser.add_argument("--cuda-devices", default="", help="CUDA devices given round-robin to the SuperNodes")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK!r}")
    parser.add_argument("--json", type=Path, default=None, help="also write every record here")
    args = parser.parse_args(argv)
    overrides = QUICK if args.quick else args.overrides
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"--modes {','.join(unknown)}: expected some of {', '.join(MODES)}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected >= 1")
    cuda = [d for d in args.cuda_devices.split(",") if d.strip()]
    plain = bench_run.plain_process(overrides)
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="bench-deploy-") as tmp:
        for repeat in range(args.repeats):
            order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]  # interleaved, rotated
            for mode in order:
                work = Path(tmp) / f"{mode}-{repeat}"
                work.mkdir()
                record = simulated(overrides, plain, work) if mode == "simulation" else \
                    deployed(mode, overrides, plain, work, cuda)
                results[mode].append(record)
                print(f"{mode} #{repeat + 1}: rounds " + ", ".join(f"{s:.2f}" for s in record["rounds"])
                      + f" s; whole run {record['wall']:.1f} s", flush=True)
        lines = report(overrides, plain, results)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"overrides": overrides, "plain": plain, "results": results,
                                         "machine": bench_run.machine()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
