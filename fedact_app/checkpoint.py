"""Checkpoints of a run, and resuming a run from one in a new Flower run.

A checkpoint is one safetensors file, ``<run folder>/checkpoints/round-00004.safetensors``, whose
tensors sit under prefixed keys::

    model/<name>                 the global state x^r after round r
    rule/<key>/<name>            the server rule's state (FedACT: v_bar, delta_g; FedAdam: m, v;
                                 SCAFFOLD: c), ``ServerRule.state_dict()``
    client/<pid>/<key>/<name>    the state each client partition keeps (SCAFFOLD: c_i), simulation
    rng/torch, rng/numpy         the ServerApp process's torch and numpy generator states

and whose metadata entry ``"fedact"`` is a JSON object with the rest: round, the count of
consecutive empty rounds, the python ``random`` state, the numpy generator's scalars, the resolved
config (YAML) and the metrics rows so far. Node sampling keeps no state to save: round r's sample
follows from (seed, r) alone. Older checkpoints also hold the node sampler's ``random.Random``
state under ``"sampler"``; loading ignores it. The metadata entry ``"fedact-sha256"`` is a SHA-256
over the tensors and the ``"fedact"`` entry (``checksum``): a checkpoint changed after it was
written does not load (those of FedACT before checksums have none and load unverified), nor does
one whose state holds NaN or inf.

One file is written to a temporary name in the same folder, fsynced and renamed over the final
name (``os.replace``), so a crash never leaves a torn checkpoint; the oldest ones beyond
``keep_checkpoints`` are removed.

Clients keep state across rounds in Flower's ``Context.state``, which a new Flower run starts
empty. So that a resumed simulation continues exactly, a client that keeps state also writes it to
``<run folder>/client_state/<pid>.safetensors`` (the server names the folder in the round config,
``client-state-dir``; a client writes only where the server's run folder exists, i.e. on a
filesystem it shares with the server, as in simulation); the server copies those files into each
checkpoint, and in a resumed run tells clients the checkpoint (``resume-checkpoint``) to load their
state from when their ``Context.state`` is empty. docs/DEPLOY.md says what happens on SuperNodes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from logging import WARNING
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from flwr.common import log
from omegaconf import OmegaConf
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from fedact_app.algorithms import TensorDict
from fedact_app.config import Config, ConfigError, to_yaml
from fedact_app.finite import describe_names, non_finite

CHECKPOINT_DIR = "checkpoints"
CLIENT_STATE_DIR = "client_state"
CLIENT_STATE_DIR_KEY = "client-state-dir"  # round-config key: where clients write their kept state
RESUME_KEY = "resume-checkpoint"  # round-config key: the checkpoint clients restore their state from
METADATA_KEY = "fedact"
CHECKSUM_KEY = "fedact-sha256"  # metadata entry: checksum(tensors, the METADATA_KEY entry)
# Keys that must match between a checkpoint's config and the resuming run's (num_rounds may grow).
COMPATIBLE_KEYS = ("algorithm", "model", "dataset", "partition", "seed", "num_clients", "local_steps",
                   "batch_size", "task", "language")
NEWER_KEYS = ("task", "language")  # absent from older checkpoints (vision runs): taken as the current values
SPEED_ONLY_KEYS = ("algorithm.compile", "algorithm.fused")  # how the step runs, not what it computes: free to change on resume
# What every checkpoint holds: entries of its "fedact" metadata (rng.<key>: inside "rng"), and tensors
# besides the model's.
REQUIRED_METADATA = ("round", "empty_rounds", "config", "rows", "rng.python", "rng.numpy")
REQUIRED_TENSORS = ("rng/torch", "rng/numpy")


class CheckpointError(ValueError):
    """A file ``load_checkpoint`` refuses; the message names the file and what is wrong with it."""


# ---------------------------------------------------------------- atomic files


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Create ``path`` through ``write(temporary path)`` in the same folder, fsync, ``os.replace``.

    A failure (or a crash) at any point leaves an existing ``path`` as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_tensors(path: Path, tensors: TensorDict, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, atomically."""
    contiguous = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    atomic_write(path, lambda tmp: save_file(contiguous, str(tmp), metadata=metadata))


# ---------------------------------------------------------------- the checkpoint


@dataclass
class Checkpoint:
    """Everything a run needs to continue after round ``round``."""

    round: int
    model: TensorDict
    rule: dict[str, TensorDict]
    rng: dict  # "python": the random module's state; "numpy", "torch": see capture_rng
    empty_rounds: int
    config: str  # the resolved config (YAML) of the run that wrote it
    rows: list[dict]  # metrics rows 0..round
    clients: dict[str, dict[str, TensorDict]] = field(default_factory=dict)  # partition id -> kept state


def capture_rng() -> dict:
    """The process's python, numpy and torch generator states."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}


def restore_rng(rng: dict) -> None:
    """Inverse of ``capture_rng``."""
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    n = rng["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))


def _random_state(state: list) -> tuple:
    """A ``random.Random`` state read back from JSON (lists) as the tuple ``setstate`` takes."""
    version, internal, gauss = state
    return version, tuple(internal), gauss


def _state_tensors(ckpt: Checkpoint) -> TensorDict:
    """The model, rule and clients' kept state of ``ckpt`` under their checkpoint names."""
    tensors = {f"model/{n}": t for n, t in ckpt.model.items()}
    tensors.update({f"rule/{key}/{n}": t for key, arrays in ckpt.rule.items() for n, t in arrays.items()})
    tensors.update({f"client/{pid}/{key}/{n}": t for pid, kept in ckpt.clients.items()
                    for key, arrays in kept.items() for n, t in arrays.items()})
    return tensors


def checksum(tensors: TensorDict, metadata: str) -> str:
    """SHA-256 (hex) over each tensor's name, dtype, shape and bytes, in name order, then ``metadata``.

    Each tensor's bytes follow a JSON line describing it with their count, so two different sets of
    tensors never feed the hash the same byte stream."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        data = tensor.reshape(-1).view(torch.uint8).numpy()
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape), data.nbytes]).encode() + b"\n")
        digest.update(data)
    digest.update(metadata.encode())
    return digest.hexdigest()


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    """Write ``ckpt`` to ``path`` atomically (module docstring: layout)."""
    tensors = _state_tensors(ckpt)
    numpy_rng = dict(ckpt.rng["numpy"])
    tensors["rng/torch"] = ckpt.rng["torch"]
    tensors["rng/numpy"] = numpy_rng.pop("keys")
    meta = {"round": ckpt.round, "empty_rounds": ckpt.empty_rounds, "config": ckpt.config,
            "rows": ckpt.rows, "rng": {"python": ckpt.rng["python"], "numpy": numpy_rng}}
    text = json.dumps(meta)
    save_tensors(path, tensors, {METADATA_KEY: text, CHECKSUM_KEY: checksum(tensors, text)})


def _split(tensors: TensorDict, prefix: str) -> TensorDict:
    return {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}


def _nested(tensors: TensorDict) -> dict[str, TensorDict]:
    """{"key/name": t} -> {"key": {"name": t}}."""
    out: dict[str, TensorDict] = {}
    for name, tensor in tensors.items():
        key, _, rest = name.partition("/")
        out.setdefault(key, {})[rest] = tensor
    return out


def _read(path: Path) -> tuple[TensorDict, dict[str, str]]:
    """A safetensors file's tensors and metadata; CheckpointError when it is not a readable one."""
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path} is empty (0 bytes)")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, f.metadata() or {}
    except SafetensorError as err:
        raise CheckpointError(f"{path} is not a readable safetensors file (truncated, or another format): "
                              f"{err}") from err


def _fedact_metadata(path: Path, tensors: TensorDict, metadata: dict[str, str]) -> dict:
    """The checkpoint's "fedact" metadata; CheckpointError unless it and every required entry are there."""
    if METADATA_KEY not in metadata:
        raise CheckpointError(f"{path} is not a FedACT checkpoint (no {METADATA_KEY!r} metadata)")
    try:
        meta = json.loads(metadata[METADATA_KEY])
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is not a FedACT checkpoint ({METADATA_KEY!r} metadata is not a JSON "
                              f"object)")
    rng = meta.get("rng") if isinstance(meta.get("rng"), dict) else {}
    missing = [key for key in REQUIRED_METADATA
               if (rng if key.startswith("rng.") else meta).get(key.removeprefix("rng.")) is None]
    missing += [name for name in REQUIRED_TENSORS if name not in tensors]
    if not any(name.startswith("model/") for name in tensors):
        missing.append("model/")
    if missing:
        raise CheckpointError(f"{path} is not a FedACT checkpoint (missing {missing})")
    return meta


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint written by ``save_checkpoint``.

    Raises ``CheckpointError``, naming the file and the fault, for a file that is empty, truncated
    or not safetensors, that lacks the "fedact" metadata or an entry every checkpoint holds, or
    whose checksum does not match its content, or whose model, rule or client state holds NaN or
    inf (the checksum of a run saved after it diverged matches). A checkpoint without a checksum
    (written by FedACT before checkpoints had one) loads unverified, its values still checked."""
    path = Path(path)
    tensors, metadata = _read(path)
    meta = _fedact_metadata(path, tensors, metadata)
    if CHECKSUM_KEY in metadata and checksum(tensors, metadata[METADATA_KEY]) != metadata[CHECKSUM_KEY]:
        raise CheckpointError(f"{path} does not match its checksum ({CHECKSUM_KEY}): its tensors or metadata "
                              f"changed after it was written (corrupted or edited)")
    clients = {pid: _nested(kept) for pid, kept in _nested(_split(tensors, "client/")).items()}
    rng = {"python": _random_state(meta["rng"]["python"]), "torch": tensors["rng/torch"],
           "numpy": {**meta["rng"]["numpy"], "keys": tensors["rng/numpy"]}}
    ckpt = Checkpoint(round=meta["round"], model=_split(tensors, "model/"),
                      rule=_nested(_split(tensors, "rule/")), rng=rng, empty_rounds=meta["empty_rounds"],
                      config=meta["config"], rows=meta["rows"], clients=clients)
    if poisoned := non_finite(_state_tensors(ckpt)):
        raise CheckpointError(f"{path} holds non-finite values (NaN or inf) in {describe_names(poisoned)}; "
                              f"a run resumed from it would continue from a diverged or poisoned state")
    return ckpt


def checkpoint_path(run_dir: Path, server_round: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"round-{server_round:05d}.safetensors"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """A run folder's checkpoints, oldest first."""
    return sorted((Path(run_dir) / CHECKPOINT_DIR).glob("round-*.safetensors"))


def resolve_resume(resume: str) -> Path:
    """``resume``: a checkpoint file, or a run folder (its newest checkpoint)."""
    path = Path(resume).expanduser().resolve()
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise ConfigError(f"Invalid config value resume={resume!r}: allowed a checkpoint file or a run "
                              f"folder with checkpoints; {path / CHECKPOINT_DIR} holds none")
        return found[-1]
    if not path.is_file():
        raise ConfigError(f"Invalid config value resume={resume!r}: allowed an existing checkpoint file "
                          f"or run folder; {path} does not exist")
    return path


def _leaves(value, prefix: str) -> dict[str, object]:
    """A nested config mapping as ``{dotted key: value}`` (a non-mapping is its own leaf)."""
    if not isinstance(value, dict):
        return {prefix: value}
    return {key: leaf for name, child in value.items() for key, leaf in _leaves(child, f"{prefix}.{name}").items()}


def check_compatible(ckpt: Checkpoint, cfg: Config, source: Path) -> None:
    """The resuming run must train the same problem the same way; ``num_rounds`` may grow."""
    saved = OmegaConf.to_container(OmegaConf.create(ckpt.config))
    current = OmegaConf.to_container(OmegaConf.create(to_yaml(cfg)))
    saved.update({key: current.get(key) for key in NEWER_KEYS if key not in saved and cfg.task == "vision"})
    before = {k: v for key in COMPATIBLE_KEYS for k, v in _leaves(saved.get(key), key).items()}
    now = {k: v for key in COMPATIBLE_KEYS for k, v in _leaves(current.get(key), key).items()}
    differ = [key for key in sorted(before.keys() | now.keys())
              if key not in SPEED_ONLY_KEYS and before.get(key) != now.get(key)]
    if differ:
        details = "; ".join(f"{key}: checkpoint {before.get(key)!r}, now {now.get(key)!r}" for key in differ)
        raise ConfigError(f"Invalid config value resume={str(source)!r}: allowed a checkpoint of a run with "
                          f"the same {', '.join(COMPATIBLE_KEYS)}; these differ: {details}")
    if cfg.num_rounds <= ckpt.round:
        raise ConfigError(f"Invalid config value num_rounds={cfg.num_rounds}: allowed > {ckpt.round}, the "
                          f"round the checkpoint {source} was written after")


# ---------------------------------------------------------------- the server's side


class Checkpointer:
    """Writes a run's checkpoints every ``checkpoint_every`` rounds and after the last, rotating them."""

    def __init__(self, run_dir: Path, cfg: Config, restored_clients: Mapping[str, dict] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.every = cfg.checkpoint_every
        self.keep = cfg.keep_checkpoints
        self.num_rounds = cfg.num_rounds
        self.restored_clients = dict(restored_clients or {})
        self.client_state_dir = self.run_dir / CLIENT_STATE_DIR

    def due(self, server_round: int) -> bool:
        return server_round == self.num_rounds or (self.every > 0 and server_round % self.every == 0)

    def client_states(self) -> dict[str, dict[str, TensorDict]]:
        """Each partition's newest kept state: this run's client files over the restored ones. A
        file holding NaN or inf (a client that diverged) is skipped with a warning: the partition
        keeps its older entry, and one client cannot stop the run's checkpoints."""
        clients = dict(self.restored_clients)
        for file in sorted(self.client_state_dir.glob("*.safetensors")):
            tensors = load_file(str(file))
            if diverged := non_finite(tensors):
                log(WARNING, "%s holds non-finite values (%s); partition %s keeps its older state",
                    file, describe_names(diverged), file.stem)
                continue
            clients[file.stem] = _nested(tensors)
        return clients

    def write(self, ckpt: Checkpoint) -> Path:
        """Save ``ckpt`` (with the clients' kept state) and remove the oldest beyond ``keep``.

        A ``ckpt`` whose state holds NaN or inf raises RuntimeError before anything is written or
        removed: ``load_checkpoint`` would refuse it, and rotating it in would remove the last
        checkpoints a run could be resumed from."""
        path = checkpoint_path(self.run_dir, ckpt.round)
        ckpt.clients = self.client_states()
        if poisoned := non_finite(_state_tensors(ckpt)):
            raise RuntimeError(f"Round {ckpt.round}'s state holds non-finite values (NaN or inf) in "
                               f"{describe_names(poisoned)}: no checkpoint written; those in {path.parent} "
                               f"are of earlier rounds")
        path.parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(path, ckpt)
        for old in list_checkpoints(self.run_dir)[:-self.keep]:
            old.unlink()
        return path


# ---------------------------------------------------------------- the client's side


def persist_client_state(config: Mapping, partition_id: int, client_state: dict[str, TensorDict]) -> None:
    """Write a client's kept state to the folder the server named (``client-state-dir``) when the
    server's run folder is visible here (a shared filesystem, as in simulation); else do nothing."""
    folder = config.get(CLIENT_STATE_DIR_KEY)
    if not folder or not client_state or not Path(folder).parent.is_dir():
        return
    Path(folder).mkdir(exist_ok=True)
    tensors = {f"{key}/{n}": t for key, arrays in client_state.items() for n, t in arrays.items()}
    save_tensors(Path(folder) / f"{partition_id}.safetensors", tensors)


def restored_client_state(config: Mapping, partition_id: int) -> dict[str, TensorDict]:
    """This partition's kept state from the checkpoint the server resumed from ({} if none)."""
    source = config.get(RESUME_KEY)
    if not source:
        return {}
    prefix = f"client/{partition_id}/"
    with safe_open(str(source), framework="pt") as f:
        tensors = {name[len(prefix):]: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)}
    return _nested(tensors)


# ---------------------------------------------------------------- the ServerApp's wiring


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from, and the file it was read from."""

    source: Path
    checkpoint: Checkpoint


def open_resume(cfg: Config) -> Resume | None:
    """The checkpoint named by ``cfg.resume``, checked against ``cfg``; None when not resuming.
    A checkpoint ``load_checkpoint`` refuses is a ``ConfigError`` naming ``resume=`` and the file."""
    if cfg.resume is None:
        return None
    source = resolve_resume(cfg.resume)
    try:
        ckpt = load_checkpoint(source)
    except CheckpointError as err:
        raise ConfigError(f"Invalid config value resume={cfg.resume!r}: allowed a complete FedACT checkpoint "
                          f"(or a run folder whose newest checkpoint is one); {err}") from err
    check_compatible(ckpt, cfg, source)
    return Resume(source, ckpt)


def client_round_config(checkpointer: Checkpointer, resume: Resume | None) -> dict:
    """Round-config entries telling clients where to keep and where to restore their state."""
    config = {CLIENT_STATE_DIR_KEY: str(checkpointer.client_state_dir)}
    if resume is not None and resume.checkpoint.clients:
        config[RESUME_KEY] = str(resume.source)
    return config


def snapshot(strategy, server_round: int, rows: list[dict], cfg: Config) -> Checkpoint:
    """A ``Checkpoint`` after ``server_round`` of a strategy with ``state_dict()`` (an
    ``AlgorithmStrategy``), with the process's RNG states (clients filled on write)."""
    state = strategy.state_dict()
    return Checkpoint(round=server_round, model=state["model"], rule=state["rule"], rng=capture_rng(),
                      empty_rounds=state["empty_rounds"], config=to_yaml(cfg), rows=list(rows))


def restore(strategy, ckpt: Checkpoint) -> None:
    """Put the checkpoint's model, rule state and empty-round count back into the strategy
    (``load_state_dict``) and the RNG states into the process."""
    strategy.load_state_dict({"model": ckpt.model, "rule": ckpt.rule, "empty_rounds": ckpt.empty_rounds})
    restore_rng(ckpt.rng)
