"""CPU smoke of the benchmark scripts in quick mode: they run and print their tables and ratios.
Their speed is not checked here (docs/PERFORMANCE.md has the figures and how they were taken)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, timeout: float) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_bench_optimizer_compares_the_compiled_step_with_the_device_selection():
    """--compile --device-selection: the compiled rows beside the others, with the selections CUDA
    runs (numpy hidden), on CPU."""
    out = run_script("bench_optimizer.py", "--quick", "--device", "cpu", "--compile", "--device-selection",
                     "--no-train-step", "--optimizer-repeats", "2", timeout=300)
    assert "median and min of 2 interleaved steps after 1 warm-up" in out, out  # --optimizer-repeats, not --repeats
    assert "selection: the engines CUDA uses (numpy hidden): the radix select, and the counting selection in the " \
           "compiled rows" in out, out
    for name in ("FedACT global", "FedACT tensor", "FedACT compiled", "FedACT tensor compiled"):
        assert re.search(rf"^{name} +\d+\.\d+ +\d+\.\d+ +\d+\.\d+ +\d+\.\d+$", out, re.M), (name, out)


def test_bench_optimizer_quick_prints_its_table():
    out = run_script("bench_optimizer.py", "--quick", "--device", "cpu", "--profile", "2", timeout=180)
    assert "cnn_small / digits: 19,466 parameters in 6 tensors; cpu" in out
    for name in ("AdamW foreach", "FedACT global", "FedACT tensor", "FedAdamW", "FedACT unfused"):
        assert re.search(rf"^{name} +\d+\.\d+ +\d+\.\d+ +\d+\.\d+ +\d+\.\d+$", out, re.M), (name, out)
    assert re.search(r"^train step .* ratio FedACT global \d+\.\d+$", out, re.M), out
    for scope in ("global", "tensor"):  # --profile: the operations with the most self time, per step
        table = out.split(f"profile: FedACT {scope} (cuda_graph=False), 2 steps; ")[1].split("\n\n")[0]
        assert re.match(r"\d+\.\d{3} ms of CPU self time a step\noperation +calls +ms +share\n", table), out
        rows = re.findall(r"^(\S.{99}) +(\d+\.\d) +(\d+\.\d{3}) +(\d+\.\d)%$", table, re.M)
        assert 1 <= len(rows) <= 25 and sum(float(r[3]) for r in rows) <= 100.5, table
        assert any(r[0].startswith("aten::") for r in rows), table


def test_the_cuda_profile_counts_each_kernel_once():
    """bench_optimizer --profile on CUDA: the kernels and copies, not the operators that launch
    them nor the step's annotation on the device's timeline (each spans kernels listed already),
    most device time first; on the CPU every operator."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from types import SimpleNamespace

    import bench_optimizer
    from torch.autograd import DeviceType

    def event(name, device_type, cpu, device, annotation=False):
        return SimpleNamespace(key=name, device_type=device_type, is_user_annotation=annotation,
                               self_cpu_time_total=cpu, self_device_time_total=device)

    events = [event("aten::index_add_", DeviceType.CPU, 30.0, 900.0),
              event("Optimizer.step#FedACTAdamW.step", DeviceType.CUDA, 0.0, 1000.0, annotation=True),
              event("indexFuncLargeIndex", DeviceType.CUDA, 0.0, 900.0),
              event("Memcpy DtoD", DeviceType.CUDA, 0.0, 10.0),
              event("searchsorted_cuda_kernel", DeviceType.CUDA, 0.0, 100.0)]
    assert [e.key for e in bench_optimizer.own_time_events(events, cuda=True)] == [
        "indexFuncLargeIndex", "searchsorted_cuda_kernel", "Memcpy DtoD"]
    assert [e.key for e in bench_optimizer.own_time_events(events, cuda=False)][0] == "aten::index_add_"


@pytest.mark.e2e
def test_bench_round_quick_prints_the_split_the_path_and_the_ratio():
    out = run_script("bench_round.py", "--quick", timeout=420)
    # the rest is what the round leaves after parts measured apart from it: it can come out negative
    for row in ("Flower simulation round", "local compute", "(de)serialization", "aggregation",
                "idle / overhead", "plain PyTorch loop round"):
        assert re.search(rf"^ *{re.escape(row)}.* +-?\d+\.\d+", out, re.M), (row, out)
    assert re.search(r"^ratio Flower / plain loop: \d+\.\d+$", out, re.M), out
    assert re.search(r"^round 1 started \d+\.\d s after the launch \(the ServerApp's evaluation of the initial "
                     r"model, \d+\.\d s, ran while round 1's clients trained\); this 2-round run took \d+\.\d s; "
                     r"a 300-round run at this round: \d+ s", out, re.M), out
    assert re.search(r"^the ServerApp's work after a round's last reply .*: \d+\.\d{3} s$", out, re.M), out
    for row in ("the ServerApp pushes the round's messages", "then the last reply's client starts",
                "its work: read the message, train, reply", "the reply reaches the ServerApp's pull",
                "the ServerApp's work after it", "the round outside this path"):
        assert re.search(rf"^  {re.escape(row)} +-?\d+\.\d{{3}} s", out, re.M), (row, out)
    assert re.search(r"^start-up, after the launch: the simulation process \(ServerApp and clients' dispatch\) "
                     r"started \d+\.\d s, the ServerApp began \d+\.\d s, its data checked \d+\.\d s, its model built "
                     r"\d+\.\d s, the model on its device \d+\.\d s, round 1 began \d+\.\d s$", out, re.M), out
    assert re.search(r"^  the round's clients started -?\d+\.\d{3} to -?\d+\.\d{3} s after the push$", out, re.M), out


def test_bench_round_reads_the_batching_workers_line_of_each_batch(caplog):
    """With client_batch, bench_round prints each measured round's batch as the batching worker's
    Gather logs it."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_round
    from fedact_app.node_worker.gather import Gather
    from fedact_app.node_worker.worker import round_label

    with caplog.at_level("INFO", logger="flwr"):
        assert Gather(lambda items: [item * 2 for item in items], round_label).submit((7, 3), 1, 1.0, 21) == 42
    (found,) = [(int(m[1]), m[2]) for m in bench_round.BATCH_LINE.finditer(caplog.text)]
    assert found[0] == 3 and re.fullmatch(r"1 of 1 messages trained at once in \d+\.\d\d s; they arrived over "
                                          r"\d+\.\d\d s, the batch began \d+\.\d\d s after the first", found[1]), found


def test_bench_round_paper_is_the_seeds_round_on_a_gpu():
    """``--paper``: ViT-Tiny on CIFAR-100's shape, batch 50, 10 clients x K = 50, 0.1 GPU each."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_round
    from fedact_app.config import compose

    cfg = compose(bench_round.PAPER_OVERRIDES)
    assert (cfg.model.name, cfg.dataset.name, cfg.dataset.num_classes, cfg.dataset.image_size) == (
        "vit_tiny", "synthetic", 100, 32)
    assert (cfg.dataset.num_train, cfg.batch_size, cfg.device, cfg.algorithm.name) == (50000, 50, "cuda", "fedact")
    args = bench_round.parse_args(["--paper"])
    assert (args.clients, args.local_steps, args.rounds, args.num_cpus, args.num_gpus) == (10, 50, 5, 1, 0.1)
    assert args.overrides == bench_round.PAPER_OVERRIDES
    args = bench_round.parse_args(["--paper", "--num-gpus", "0.5", "--rounds", "8", "--overrides", "precision=bf16"])
    assert (args.clients, args.rounds, args.num_gpus) == (10, 8, 0.5)  # the flags given win
    assert compose(args.overrides).precision == "bf16" and compose(args.overrides).model.name == "vit_tiny"
    with pytest.raises(SystemExit):
        bench_round.parse_args(["--paper", "--quick"])


def test_bench_client_batch_prints_both_sides_their_gap_and_the_operation_counts():
    out = run_script("bench_client_batch.py", "--clients", "2", "--local-steps", "1", "--rounds", "2", "--profile",
                     "--overrides", "dataset.num_train=200 model.kwargs.depth=1", timeout=300)
    assert "2 clients x K = 1 x batch 8; fedact (trust_scope=global), precision=fp32, compile_model=none" in out, out
    for label in ("clients one after another", "clients at once (ClientBatch)"):
        row = rf"^  {re.escape(label)} +\d+\.\d{{3}}  \[\d+\.\d{{3}}-\d+\.\d{{3}}\] +\d+\.\d\d$"
        assert re.search(row, out, re.M), out
    assert re.search(r"^  loop / batched: \d+\.\d\dx$", out, re.M), out
    assert re.search(r"^of a batched step: the optimizer's step alone \d+\.\d\d ms \(median of 20\), the rest "
                     r"\(forward, backward, batches, the round's own work over K\) about \d+\.\d\d ms$", out, re.M), out
    assert re.search(r"max \|dDelta\| / max \|Delta\| = \d\.\d\de[-+]\d\d; .*: \d+\.\d{3} %", out), out
    assert re.search(r"^a step of all 2 clients: aten ops loop [\d,]+ / batched [\d,]+ = \d+\.\d\dx$", out, re.M), out


def test_bench_client_batch_paper_is_the_seeds_round():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_client_batch
    import bench_round
    from fedact_app.config import compose

    args = bench_client_batch.parse_args(["--paper", "--clients", "4"])
    assert (args.clients, args.local_steps, args.rounds) == (4, 50, 6)  # the flags given win
    cfg = compose(args.overrides)
    assert args.overrides.startswith(bench_round.PAPER_OVERRIDES)
    assert (cfg.model.name, cfg.batch_size, cfg.device, cfg.num_clients, cfg.local_steps) == (
        "vit_tiny", 50, "cuda", 4, 50)


@pytest.mark.e2e
def test_bench_run_quick_prints_the_ratios_the_floor_and_one_accuracy():
    out = run_script("bench_run.py", "--quick", timeout=600)
    for row in ("1. app run alone", "2. app rounds 1..R, summed", "3. sweep, wall per job after the first"):
        assert re.search(rf"^{re.escape(row)}.* \d+\.\d\dx$", out, re.M), (row, out)
    for row in ("start-up until the run folder", "round 1 (Ray, actors, ids, initial eval)",
                "shutdown after the final model", "fixed cost per job"):
        assert row in out, (row, out)
    for row in ("F1. floor run alone (launcher, start to exit)", "   floor + plain rounds", "   plain round + that",
                "   floor + plain + that wait, rounds 2..R", "F3. floor sweep, wall per job after the first"):
        assert re.search(rf"^{re.escape(row)}.* \d+\.\d\dx$", out, re.M), (row, out)
    for row in ("   floor + plain: fixed cost per job", "   floor + plain + wait: fixed cost per job"):
        assert re.search(rf"^{re.escape(row)} +-?\d+\.\d$", out, re.M), (row, out)
    # the plain loop and the app compute the same run: one final accuracy for both
    assert re.search(r"^final test accuracy, plain loop and app runs \(one seed\): \[0\.\d+\]$", out, re.M), out


def test_bench_diagnostics_quick_prints_the_ratio_to_diagnostics_off():
    out = run_script("bench_diagnostics.py", "--quick", "--device", "cpu", timeout=180)
    assert re.search(r"^off \(trust_every=0\) +\d+\.\d+ +1\.000$", out, re.M), out
    assert re.search(r"^trust_every=10 +\d+\.\d+ +\d+\.\d+$", out, re.M), out


def test_bench_cold_start_prints_every_phase_with_and_without_the_partition_cache():
    out = run_script("bench_cold_start.py", "--repeats", "2", "--overrides", "local_steps=2 device=cpu", timeout=240)
    for phase in ("imports", "trainer", "data", "round", "warm round"):
        assert re.search(rf"^{phase} +\d+\.\d+ +\d+\.\d+$", out, re.M), (phase, out)
    assert re.search(r"^cold round \(imports to reply\): \d+\.\d+ s with an empty cache, \d+\.\d+ s with it "
                     r"filled; warm round \d+\.\d+ s$", out, re.M), out


def test_bench_run_reports_the_parallel_sweep_per_job_against_one_at_a_time():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_run

    plain = [{"wall": 10.0, "rounds": [1.0, 1.0], "final_test_accuracy": 0.5}]
    alone = [{"wall": 20.0, "rounds": [3.0, 1.5], "startup": 5.0, "round0": 0.5, "shutdown": 2.0,
              "final_test_accuracy": 0.5}]
    # one at a time with overlap: the second job waited inside run() while the first computed, so
    # its own wall (28 s) is not a job's cost; the 16 s between the two ends is
    jobs = [{"wall": 18.0, "end": 18.0, "rounds": [2.0, 1.0]}, {"wall": 28.0, "end": 34.0, "rounds": [2.0, 1.0]}]
    out = bench_run.report("digits", "", plain, alone, jobs, 1, {1: (34.0, [18.0, 28.0]), 2: (25.5, [24.0, 25.0])})
    assert re.search(r"^3\. sweep, wall per job after the first +16\.0 +1\.60x$", out, re.M), out
    assert re.search(r"first job \(starts SuperLink and Ray\) +18\.0$", out, re.M), out
    assert re.search(r"fixed cost per job \(wall per job - plain run\) +6\.0$", out, re.M), out
    assert re.search(r"--max-parallel 1: sweep wall / 2 jobs +17\.0 +1\.00x of --max-parallel 1$", out, re.M), out
    assert re.search(r"--max-parallel 2: sweep wall / 2 jobs +12\.8 +0\.75x of --max-parallel 1 "
                     r"\(a job's own wall 24\.5 \[24\.0-25\.0\]\)$", out, re.M), out
    for bad in (["--max-parallel", "0"], ["--max-parallel", "2", "--jobs", "1"]):
        with pytest.raises(SystemExit):
            bench_run.main(bad)


def test_bench_run_floor_rows_put_the_plain_loops_rounds_in_place_of_the_floors():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_run

    plain = [{"wall": 10.0, "rounds": [1.5, 1.0, 1.0], "final_test_accuracy": 0.5, "clients_per_round": 5}]
    floor = {"alone": [{"wall": 12.0, "rounds": [3.0, 0.2, 0.2]}], "single": {"rounds": [2.0, 0.1, 0.1, 0.1, 0.3]},
             "jobs": [{"end": 20.0, "rounds": [1.0, 0.3, 0.3]}, {"end": 27.0, "rounds": [1.0, 0.3, 0.3]}]}
    out = "\n".join(bench_run.floor_report(plain, floor))
    for row, seconds, ratio in [("F1. floor run alone (launcher, start to exit)", "12.0", "1.20"),
                                ("   floor + plain rounds", "15.1", "1.51"),  # 12 - 0.4 + 3.5
                                ("F2. floor median round, 5 messages, locked", "0.200", None),
                                # the mean of rounds 2..R (0.15), not their median (0.1)
                                ("   1 message a round at a random phase, mean", "0.150", None),
                                ("   plain round + that", "1.150", "1.15"),
                                ("   floor + plain + that wait, rounds 2..R", "15.4", "1.54"),  # + 2 x 0.15
                                ("F3. floor sweep, wall per job after the first", "7.0", "0.70"),
                                ("   floor + plain: fixed cost per job", "-0.1", None),  # 7 - 0.6 + 3.5 - 10
                                ("   floor + plain + wait: fixed cost per job", "0.2", None)]:
        tail = "" if ratio is None else rf" +{ratio}x"
        assert re.search(rf"^{re.escape(row)} +{re.escape(seconds)}{tail}$", out, re.M), (row, out)


@pytest.mark.e2e
def test_bench_deploy_quick_prints_each_modes_rounds_and_the_gap_to_the_floor():
    out = run_script("bench_deploy.py", "--quick", "--modes", "floor,floor-distinct,warm", timeout=600)
    for mode in ("floor", "floor-distinct", "warm"):
        assert re.search(rf"^\| {mode} \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d \|$", out, re.M), (mode, out)
    for floor in ("floor", "floor-distinct"):
        assert re.search(rf"^warm - {floor}: median round [+-]\d+\.\d\d s, round 1 [+-]\d+\.\d\d s$", out, re.M), out


def test_the_floors_records_are_packed_as_the_apps_and_zeros_or_each_of_its_own_content():
    """scripts/flower_floor: one record per shape, packed as fedact_app.wire packs a record of
    float32 tensors; zeros (equal arrays of one shape are one Flower object), or with a salt every
    array's bytes, and every 5 MiB chunk Flower cuts them into, differ from every other's."""
    import hashlib

    from flwr.app import RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    from fedact_app.wire import unpacked

    sys.path.insert(0, str(ROOT / "scripts" / "flower_floor"))
    from flower_floor import records

    shapes = "[[3, 2], [3, 2], [4], [3, 2]]"

    def digests(records):
        return [hashlib.sha256(record["float32"].data).hexdigest() for record in records.values()]

    zeros = records(shapes)
    assert [list(record) for record in zeros.values()] == [["layout", "float32"]] * 4
    assert [tuple(unpacked(record)["values"].shape) for record in zeros.values()] == [(3, 2), (3, 2), (4,), (3, 2)]
    assert all(not unpacked(record)["values"].any() for record in zeros.values())
    assert len(set(digests(zeros))) == 2  # the three (3, 2) arrays are one object's content
    salted = [digests(records(shapes, salt)) for salt in ((1,), (2,), (2, 7))]
    assert len({d for ds in salted for d in ds}) == 12
    big = "[[3000000]]"  # 12 MB: three chunks of Flower's 5 MiB
    one, other = (get_all_nested_objects(RecordDict(records(big, salt))) for salt in ((1,), (2,)))
    assert len(one) >= 6 and len(one.keys() | other.keys()) == len(one) + len(other) - 2  # the layout is shared


def test_bench_aggregation_quick_prints_each_rule_against_the_mean():
    out = run_script("bench_aggregation.py", "--quick", timeout=180)
    assert "cnn_small: 19,466 trainable parameters in 6 tensors; 3 clients" in out
    assert re.search(r"^mean +\d+\.\d +\[\d+\.\d-\d+\.\d\] +1\.00$", out, re.M), out
    for rule in ("trimmed_mean", "median"):
        assert re.search(rf"^{rule} +\d+\.\d +\[\d+\.\d-\d+\.\d\] +\d+\.\d\d$", out, re.M), (rule, out)


def test_bench_server_quick_prints_each_piece_the_round_and_the_floor():
    out = run_script("bench_server.py", "--quick", timeout=180)
    assert re.search(r"^cnn_small: 19,466 trainable parameters in 6 tensors; 3 FedACT replies \(delta, v\); "
                     r".+, \d+ threads; device cpu; median of 2", out, re.M), out
    for piece in ("decode + checks", "decode + checks, bfloat16", "acceptance", "aggregate", "DC + ||Delta_G||",
                  "server round", "after the last reply"):
        assert re.search(rf"^{re.escape(piece)} +\d+\.\d +\[\d+\.\d-\d+\.\d\] +\d+\.\d\d$", out, re.M), (piece, out)
    assert re.search(r"^floor: stack\(S x d\)\.sum\(0\) +\d+\.\d +\[\d+\.\d-\d+\.\d\] +1\.00$", out, re.M), out


def test_gpu_checks_names_files_that_exist_and_refuses_an_unknown_step(tmp_path):
    """scripts/gpu_checks.sh, the GPU run prepared for a machine that has one: every script and
    test file it runs is there, and a step it does not know stops it, naming the known ones."""
    script = ROOT / "scripts" / "gpu_checks.sh"
    named = set(re.findall(r"\b((?:scripts|tests)/[\w/]+\.py)\b", script.read_text()))
    assert named and all((ROOT / path).is_file() for path in named), sorted(named)
    proc = subprocess.run(["bash", str(script), "bogus"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 2
    assert ("unknown step bogus: allowed optim optim-compiled server round round-compiled round-bf16 round-bytes "
            "round-mps round-2-actors round-batched client-batch units deploy") in proc.stderr
