"""The GPU share of a simulated client when the command line does not give one.

Flower's simulation hands a client a GPU only through ``client-resources-num-gpus``: with 0 every
ClientApp runs where Ray puts it with ``CUDA_VISIBLE_DEVICES`` empty, and ``device=auto`` trains
it on the CPU however many GPUs the machine has. So the launcher, sweeps, studies and tuning take
``--num-gpus`` as "auto" unless it is given, and give each client

    share = GPUs / (clients training at once x runs at once), at most 1, rounded down to 1e-4,

where the clients training at once are those a round samples (``num_clients``,
``fraction_train``, ``min_train_nodes``), at most as many as the CPUs hold (``--num-cpus`` each),
and the runs at once are a sweep's ``--max-parallel``. The share is 0 when the config says
``device=cpu`` or the launching process sees no GPU (``CUDA_VISIBLE_DEVICES`` hides them, or
torch counts none). ``device=cuda`` with no GPU in sight is an error here, before any process
starts. ``--num-gpus X`` (0 included) replaces the rule.

The seed's vision setting on one GPU with 16 CPUs: 10 clients a round, min(10, 16 / 1) at once,
so 0.1 GPU each: every client of a round on the GPU together.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from fedact_app.sampling import sample_count


# Where a GPU driver shows itself: NVIDIA's, WSL2's GPU paravirtualization, AMD's ROCm (torch's
# HIP build answers torch.cuda too).
DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def visible_gpus() -> int:
    """CUDA devices a process started from here would see. No torch import (and no CUDA call)
    when ``CUDA_VISIBLE_DEVICES`` hides every device or this machine shows none of the drivers
    of ``DRIVER_PATHS``."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return 0
    if not any(Path(path).exists() for path in DRIVER_PATHS):
        return 0
    import torch  # only where a driver is installed

    return torch.cuda.device_count()


def machine_cpus() -> int:
    """CPUs this process may run on (a container's limit, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def clients_at_once(cfg: Any, num_cpus_per_client: int, cpus: int) -> int:
    """Clients of one round that train at the same time: those sampled, as many as the CPUs hold
    (with ``client_batch``, all of them: :func:`ray_cpus`)."""
    sampled = sample_count(cfg.num_clients, cfg.fraction_train, cfg.min_train_nodes)
    if cfg.client_batch:
        return sampled
    return max(1, min(sampled, cpus // max(1, num_cpus_per_client)))


def ray_cpus(cfg: Any, num_cpus_per_client: int, cpus: int) -> int:
    """CPUs a simulation's Ray counts: the machine's ``cpus``; with ``client_batch`` at least one
    ClientApp's ``num_cpus_per_client`` for every client a round samples. Its ClientApps then
    only hand their training messages to the machine's batching worker
    (``fedact_app.node_worker.gather``), which trains them at once: every client of a round
    needs a ClientApp holding its message, or the batch waits ``client_batch_wait`` for it."""
    if not cfg.client_batch:
        return cpus
    return max(cpus, sample_count(cfg.num_clients, cfg.fraction_train, cfg.min_train_nodes) * num_cpus_per_client)


def gpu_share(device: str, at_once: int, gpus: int) -> float:
    """The rule of the module docstring: GPUs / clients at once, at most 1, 0 for ``device=cpu``
    or no GPU; rounded down so that ``at_once`` shares never sum above the GPUs (Ray's
    resources have four decimals)."""
    if device == "cpu" or gpus <= 0:
        return 0.0
    return math.floor(min(1.0, gpus / max(1, at_once)) * 10_000) / 10_000


def client_gpus(cfg: Any | None, num_cpus_per_client: int, requested: float | None, *,
                runs_at_once: int = 1) -> float:
    """GPUs per simulated client: ``requested`` when given (``--num-gpus``), else the module's rule
    for the composed FedACT config ``cfg`` (None, another app: 0). ValueError for a negative
    request, or for ``device=cuda`` when no GPU is visible here."""
    if requested is not None:
        if not (requested >= 0 and math.isfinite(requested)):
            raise ValueError(f"--num-gpus {requested}: allowed a number >= 0 (GPUs per client), or none for "
                             "the automatic share")
        return float(requested)
    if cfg is None:
        return 0.0
    gpus = 0 if cfg.device == "cpu" else visible_gpus()
    if cfg.device == "cuda" and gpus == 0:
        raise ValueError("device=cuda but this machine shows no GPU (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): use device=auto or device=cpu, "
                         "or run where a GPU is visible")
    return gpu_share(cfg.device, clients_at_once(cfg, num_cpus_per_client, machine_cpus()) * runs_at_once, gpus)


def describe_share(share: float, requested: float | None) -> str:
    """One line for the launcher's output: the share and where it came from."""
    if requested is not None:
        return f"each client gets {share:g} GPU (--num-gpus)"
    if share == 0:
        return "clients train on the CPU (no GPU visible, or device=cpu)"
    return (f"each client gets {share:g} GPU (automatic: GPUs / clients training at once; "
            "--num-gpus 0 keeps them on the CPU)")
