"""Benchmark: one optimizer step of FedACT-AdamW against torch.optim.AdamW on real parameter sets.

    python scripts/bench_optimizer.py                       # vit_tiny and resnet18, CPU (and CUDA if present)
    python scripts/bench_optimizer.py --device cuda --repeats 50
    python scripts/bench_optimizer.py --quick               # seconds: cnn_small, few repeats (CI smoke)

For each model (built by ``fedact_app.tasks.vision.models.build_model`` for ``--dataset``) and device it times,
side by side, ``step()`` of

- ``AdamW foreach`` — ``torch.optim.AdamW(foreach=True)``, the reference of every ratio;
- ``AdamW fused`` — ``torch.optim.AdamW(fused=True)`` (CUDA only);
- ``FedACT global`` — ``FedACTAdamW`` with its defaults (exact global top-floor(tau*d));
- ``FedACT tensor`` — ``trust_scope="tensor"``;
- ``FedAdamW`` — ``trust_signal="none"``;
- ``FedACT unfused`` — the defaults with ``fused=False`` (without torch's fused AdamW/SGD
  kernels for m, v, u and the update, which are on by default for CPU and CUDA parameters),
  the comparison that decides that default;
- ``FedACT launched`` (CUDA only) — the defaults with ``cuda_graph=False``: the selection's
  kernels launched one by one instead of replayed as one CUDA graph;
- with ``--compile``, ``FedACT compiled`` and ``FedACT tensor compiled`` — the defaults and the
  tensor scope with ``compile=True`` (on CUDA the selection then counts, topk._CountSelect).

Every optimizer owns a copy of the parameters with fixed random gradients; the FedACT ones start
a round with a random v_bar and Delta_G (as from round 2 on). Timing interleaves the optimizers
(one step of each per repeat, after warm-up steps), so a busy machine slows all of them alike,
and reports the median and the minimum; on CUDA each step is timed with a synchronize on both
sides. ``memory`` is what the optimizer holds beyond the parameters and gradients (state and
scratch, counted once per storage); on CUDA also the transient peak of one step above that
(``torch.cuda.max_memory_allocated``).

Then the whole train step, forward + backward + step (batch ``--batch`` at the dataset's image
size, random data), for AdamW foreach and FedACT global (on CUDA also AdamW fused and FedACT
launched; and compiled), interleaved the same way.
With ``--compile-model MODE`` also ``FedACT compiled model``: FedACT global with the forward and
backward through ``torch.compile(model, mode=MODE, dynamic=False)``, as the run config's
``compile_model`` does; its first step (the compilation) is timed apart, before the warm-up, and
a line gives its median, min and max against FedACT global's from the same interleaved repeats.

    python scripts/bench_optimizer.py --models cnn_small vit_tiny --device cpu --optimizer-repeats 1 \
        --train-repeats 30 --compile-model default

With ``--profile N``, last, where a FedACT step spends its time, for the global and the tensor
scope (and with ``--compile`` their compiled steps): ``torch.profiler`` over N steps after
warm-up, the operations with the most self time on the device (CUDA) or the CPU, per step, with
the selection's kernels launched one by one (``cuda_graph=False``: to the profiler a graph's
replay is one launch). ``--device-selection`` selects on CPU as on CUDA (numpy hidden), a CPU
stand-in for comparing the device engines.

    python scripts/bench_optimizer.py --models resnet18 --device cuda --optimizer-repeats 1 \
        --no-train-step --profile 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

APP_DIR = Path(__file__).resolve().parents[1]
if str(APP_DIR) not in sys.path:
    sys.path.insert(0, str(APP_DIR))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fedact_app.config import compose  # noqa: E402
from fedact_app.tasks.vision.models import build_model  # noqa: E402
from fedact_app.optim import FedACTAdamW, topk  # noqa: E402

REFERENCE = "AdamW foreach"
PROFILED = {"FedACT global": {}, "FedACT tensor": {"trust_scope": "tensor"}}  # --profile's scopes
PROFILED_COMPILED = {"FedACT compiled": {"compile": True},  # and with --compile
                     "FedACT tensor compiled": {"trust_scope": "tensor", "compile": True}}
PROFILE_TOP = 25  # operations listed per profile


def optimizers(device: torch.device, compiled: bool = False
               ) -> dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]]:
    """The optimizers compared, by name (fused AdamW only where torch has it: CUDA)."""
    makers = {
        REFERENCE: lambda ps: torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.01, foreach=True),
        "FedACT global": lambda ps: FedACTAdamW(ps, lr=3e-4),
        "FedACT tensor": lambda ps: FedACTAdamW(ps, lr=3e-4, trust_scope="tensor"),
        "FedAdamW": lambda ps: FedACTAdamW(ps, lr=3e-4, trust_signal="none"),
    }
    if device.type == "cuda":
        makers["AdamW fused"] = lambda ps: torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.01, fused=True)
    makers["FedACT unfused"] = lambda ps: FedACTAdamW(ps, lr=3e-4, fused=False)
    if device.type == "cuda":
        makers["FedACT launched"] = lambda ps: FedACTAdamW(ps, lr=3e-4, cuda_graph=False)
    if compiled:
        makers["FedACT compiled"] = lambda ps: FedACTAdamW(ps, lr=3e-4, compile=True)
        makers["FedACT tensor compiled"] = lambda ps: FedACTAdamW(ps, lr=3e-4, trust_scope="tensor", compile=True)
    return makers


def start_round(opt: torch.optim.Optimizer, params: list[torch.Tensor], seed: int) -> None:
    """A FedACT optimizer starts a round as from round 2 on: random v_bar and Delta_G."""
    if isinstance(opt, FedACTAdamW):
        gen = torch.Generator().manual_seed(seed)
        v_bar = [(1e-6 * torch.rand(p.shape, generator=gen)).to(p) for p in params]
        delta_g = [(1e-3 * torch.randn(p.shape, generator=gen)).to(p) for p in params]
        opt.begin_round(v_bar=v_bar, delta_g=delta_g, global_step=50)


def held_bytes(opt: torch.optim.Optimizer, exclude: list[torch.Tensor]) -> int:
    """Bytes of every tensor and numpy array reachable from the optimizer (state and scratch),
    each storage once, without the parameters and gradients in ``exclude``."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    total, stack, visited = 0, [vars(opt)], set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(obj, np.ndarray):
            total += obj.nbytes if obj.base is None else 0  # views of tensors are counted there
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.append(vars(obj))
    return total


def timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int,
                warmup: int) -> dict[str, list[float]]:
    """Seconds of every repeat of every function, run round-robin after ``warmup`` rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            timed(fn, device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return times


def fixed_grads(params0: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """One fixed random gradient per parameter (seed 0), on ``device``."""
    gen = torch.Generator().manual_seed(0)
    return [(1e-2 * torch.randn(p.shape, generator=gen)).to(device) for p in params0]


def with_grads(params0: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """A copy of the parameters on ``device``, each with a copy of its gradient."""
    params = [p.detach().clone().to(device).requires_grad_() for p in params0]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def bench_steps(params0: list[torch.Tensor], device: torch.device, repeats: int, warmup: int,
                compiled: bool) -> list[dict]:
    """Step time and memory of every optimizer on copies of ``params0``."""
    grads = fixed_grads(params0, device)
    opts, held, exclude = {}, {}, []
    for i, (name, make) in enumerate(optimizers(device, compiled).items()):
        params = with_grads(params0, grads, device)
        opt = make(params)
        start_round(opt, params, seed=i)
        opt.step()  # creates the state
        opts[name] = opt
        held[name] = held_bytes(opt, params + [p.grad for p in params])
        exclude += params
    rows = []
    times = interleaved({name: opt.step for name, opt in opts.items()}, device, repeats, warmup)
    for name, opt in opts.items():
        row = dict(name=name, median_ms=1e3 * statistics.median(times[name]), min_ms=1e3 * min(times[name]),
                   held_mib=held[name] / 2**20)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            opt.step()
            torch.cuda.synchronize(device)
            row["transient_mib"] = (torch.cuda.max_memory_allocated(device) - before) / 2**20
        rows.append(row)
    ref = next(r for r in rows if r["name"] == REFERENCE)
    for row in rows:
        row["ratio"] = row["median_ms"] / ref["median_ms"]
    return rows


COMPILED_MODEL = "FedACT compiled model"


def bench_train_step(model0: torch.nn.Module, shape: tuple[int, ...], num_classes: int, device: torch.device,
                     repeats: int, warmup: int, compiled: bool, compile_model: str | None = None
                     ) -> tuple[dict[str, list[float]], float | None]:
    """Seconds of every repeat of forward + backward + step for AdamW foreach and FedACT global
    (and the compiled variants), and the seconds of the compiled model's first step."""
    gen = torch.Generator().manual_seed(1)
    images = torch.randn(shape, generator=gen).to(device)
    labels = torch.randint(0, num_classes, (shape[0],), generator=gen).to(device)
    makers = optimizers(device, compiled)
    makers[COMPILED_MODEL] = makers["FedACT global"]
    names = ([REFERENCE, "FedACT global"] + ["AdamW fused", "FedACT launched"] * (device.type == "cuda")
             + ["FedACT compiled"] * compiled + [COMPILED_MODEL] * bool(compile_model))
    fns = {}
    for i, name in enumerate(names):
        model = copy.deepcopy(model0).to(device).train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = makers[name](params)
        start_round(opt, params, seed=i)
        forward = model
        if name == COMPILED_MODEL:
            forward = torch.compile(model, mode=compile_model, dynamic=False)

        def train_step(forward=forward, opt=opt, mark=name == COMPILED_MODEL):
            if mark:
                torch.compiler.cudagraph_mark_step_begin()
            loss = F.cross_entropy(forward(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        fns[name] = train_step
    compile_seconds = timed(fns[COMPILED_MODEL], device) if compile_model else None
    return interleaved(fns, device, repeats, warmup), compile_seconds


def own_time_events(events, cuda: bool) -> list:
    """The profiler's events (averaged or raw) whose self times add up to the step's, most first: on CUDA
    the kernels and copies by their device time (not the operators that launch them, nor an
    annotation on the device's timeline, which span the kernels and would count them again), on
    the CPU every operator by its own CPU time."""
    from torch.autograd import DeviceType

    if cuda:
        events = [e for e in events
                  if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return sorted(events, key=lambda e: getattr(e, key), reverse=True)


def profile_steps(params0: list[torch.Tensor], device: torch.device, steps: int, compiled: bool) -> None:
    """Print, for each scope of :data:`PROFILED` (and :data:`PROFILED_COMPILED` when
    ``compiled``; all with ``cuda_graph=False``), the operations with the most self time over
    ``steps`` profiled steps (after 3 warm-up steps), per step (:func:`own_time_events`)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    key = "self_device_time_total" if cuda else "self_cpu_time_total"  # microseconds
    grads = fixed_grads(params0, device)
    for name, options in {**PROFILED, **(PROFILED_COMPILED if compiled else {})}.items():
        params = with_grads(params0, grads, device)
        opt = FedACTAdamW(params, lr=3e-4, cuda_graph=False, **options)
        start_round(opt, params, seed=0)
        for _ in range(3):
            opt.step()
        activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
        if cuda:
            torch.cuda.synchronize(device)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                opt.step()
            if cuda:
                torch.cuda.synchronize(device)
        events = own_time_events(prof.key_averages(), cuda)
        total = sum(getattr(e, key) for e in events)
        print(f"\nprofile: {name} (cuda_graph=False), {steps} steps; {total / steps / 1e3:.3f} ms of "
              f"{'device' if cuda else 'CPU'} self time a step")
        print(f"{'operation':<100} {'calls':>6} {'ms':>8} {'share':>6}")
        for event in events[:PROFILE_TOP]:
            own = getattr(event, key)
            print(f"{event.key[:100]:<100} {event.count / steps:>6.1f} {own / steps / 1e3:>8.3f} "
                  f"{100 * own / max(total, 1e-9):>5.1f}%")


def print_compiled_model(times: dict[str, list[float]], compile_seconds: float, mode: str) -> None:
    """The compiled model's train step against FedACT global's: medians, spread, ratio."""
    def spread(name: str) -> str:
        ts = times[name]
        return f"{1e3 * statistics.median(ts):.2f} ms (min {1e3 * min(ts):.2f}, max {1e3 * max(ts):.2f})"

    ratio = statistics.median(times[COMPILED_MODEL]) / statistics.median(times["FedACT global"])
    print(f"compiled model (mode {mode}): {spread(COMPILED_MODEL)} against FedACT global "
          f"{spread('FedACT global')}, {len(times[COMPILED_MODEL])} interleaved repeats; ratio {ratio:.3f}; "
          f"first step (compilation) {compile_seconds:.1f} s")


def print_table(model: str, dataset: str, params: list[torch.Tensor], device: torch.device, rows: list[dict],
                train: dict[str, float] | None, batch: int, image_size: int) -> None:
    d = sum(p.numel() for p in params)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\n{model} / {dataset}: {d:,} parameters in {len(params)} tensors; {name}{threads}")
    cuda = device.type == "cuda"
    fused = next((r["median_ms"] for r in rows if r["name"] == "AdamW fused"), None)  # CUDA only
    header = f"{'optimizer':<22} {'median ms':>10} {'min ms':>9} {'x ' + REFERENCE:>16} {'memory MiB':>11}"
    print(header + (f" {'step peak MiB':>14}" if cuda else "") + (f" {'x AdamW fused':>14}" if fused else ""))
    for r in rows:
        line = (f"{r['name']:<22} {r['median_ms']:>10.2f} {r['min_ms']:>9.2f} {r['ratio']:>16.2f} "
                f"{r['held_mib']:>11.1f}")
        print(line + (f" {r['transient_mib']:>14.1f}" if cuda else "")
              + (f" {r['median_ms'] / fused:>14.2f}" if fused else ""))
    if train:
        ref = train[REFERENCE]
        print(f"train step (forward + backward + step, batch {batch} at {image_size} px): "
              + ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in train.items()) + "; "
              + ", ".join(f"ratio {name} {s / ref:.3f}" for name, s in train.items() if name != REFERENCE))


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (a median needs at least one timing)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["vit_tiny", "resnet18"])
    parser.add_argument("--dataset", default="cifar100", help="sets image size, channels and classes")
    parser.add_argument("--device", default="all", choices=["all", "cpu", "cuda"],
                        help="all: CPU, and CUDA when present")
    parser.add_argument("--repeats", type=positive, default=20, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=positive, default=2, help="torch CPU threads")
    parser.add_argument("--batch", type=positive, default=50, help="train-step batch size")
    parser.add_argument("--train-repeats", type=positive, default=5,
                        help="timed train steps per optimizer (--no-train-step skips them)")
    parser.add_argument("--no-train-step", action="store_true", help="skip the whole train step")
    parser.add_argument("--compile", action="store_true", help="also FedACT with compile=True")
    parser.add_argument("--compile-model", choices=["default", "reduce-overhead", "max-autotune"],
                        help="also the train step with the model through torch.compile in this mode")
    parser.add_argument("--optimizer-repeats", type=positive, default=None,
                        help="timed optimizer steps (default: --repeats); the train step takes --train-repeats")
    parser.add_argument("--profile", type=positive, default=None, metavar="N",
                        help="also profile N FedACT steps per scope (module docstring)")
    parser.add_argument("--device-selection", action="store_true",
                        help="on CPU too, select with the engines CUDA uses (numpy's hidden): the radix "
                             "select, and with --compile the compiled counting selection")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: cnn_small on digits, 3 repeats, 1 warm-up, batch 8")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.dataset = ["cnn_small"], "digits"
        args.repeats, args.warmup, args.batch, args.train_repeats = 3, 1, 8, 2
    torch.set_num_threads(args.threads)
    if args.device_selection:
        topk.np = None  # what the engines check for the host selection (topk._select_on_host)
    devices = [torch.device("cpu")] if args.device in ("all", "cpu") else []
    if args.device == "cuda" or (args.device == "all" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            parser.error("--device cuda but no CUDA device is visible")
        devices.append(torch.device("cuda"))
    optimizer_repeats = args.optimizer_repeats or args.repeats
    print(f"torch {torch.__version__}; median and min of {optimizer_repeats} interleaved steps after "
          f"{args.warmup} warm-up; ratio = median / median of {REFERENCE}")
    if args.device_selection:
        print("selection: the engines CUDA uses (numpy hidden): the radix select"
              + (", and the counting selection in the compiled rows" if args.compile else ""))
    for model_name in args.models:
        cfg = compose(f"model={model_name} dataset={args.dataset}")
        model = build_model(cfg.model, cfg.dataset)
        params = [p for p in model.parameters() if p.requires_grad]
        ds = cfg.dataset
        for device in devices:
            rows = bench_steps(params, device, optimizer_repeats, args.warmup, args.compile)
            train, times, compile_seconds = None, None, None
            if not args.no_train_step:
                shape = (args.batch, ds.channels, ds.image_size, ds.image_size)
                times, compile_seconds = bench_train_step(model, shape, ds.num_classes, device, args.train_repeats,
                                                          1, args.compile, args.compile_model)
                train = {name: statistics.median(ts) for name, ts in times.items() if name != COMPILED_MODEL}
            print_table(model_name, args.dataset, params, device, rows, train, args.batch, ds.image_size)
            if times and args.compile_model:
                print_compiled_model(times, compile_seconds, args.compile_model)
            if args.profile:
                profile_steps(params, device, args.profile, args.compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
