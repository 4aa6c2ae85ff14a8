"""A client's local work as plain PyTorch: load x^r, run K local steps of the method, build the reply.

One ``ClientTrainer`` per process and configuration is kept warm across rounds and across the
virtual clients a simulation worker serves: the model and the optimizer are reused, because every
round overwrites the model state and the method's ``begin_round`` resets the optimizer state
(FedACT: m = 0, v = v_bar, k = 0; LocalAdam: empty state), so nothing leaks from one client to
the next. What a client keeps across its rounds (SCAFFOLD's c_i) is not kept here: it comes in
and goes out with each round (``client_state``), and the ClientApp stores it in the client's
Flower ``Context.state``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from logging import INFO

from flwr.common import log

from fedact_app.algorithms import ALGORITHMS, ClientUpdate, RoundInputs, TensorDict
from fedact_app.client_batch import ClientBatch
from fedact_app.config import Config, PartitionConfig, compose
from fedact_app.diagnostics import TrustProbe
from fedact_app.tasks.base import build_task
from fedact_app.train import batch_generator, compiled_for_training, memory_format, resolve_device, train_steps
from fedact_app.wire import from_wire


@dataclass
class RoundResult:
    """One client round: the reply, the mean training loss, the state the client keeps."""

    update: ClientUpdate
    loss: float
    client_state: dict[str, TensorDict]
    diagnostics: dict[str, float]  # the round's trust-score statistics (fedact_app.diagnostics)


def _to_cpu(arrays: dict[str, TensorDict]) -> dict[str, TensorDict]:
    """Detached CPU copies (a rule may return its live optimizer state)."""
    return {key: {n: t.detach().cpu().clone() for n, t in d.items()} for key, d in arrays.items()}


class ClientTrainer:
    """Model, local optimizer and method rule of one process, around the run's ``Task``."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.task = build_task(cfg)
        self.model = self.task.build_model().to(self.device, memory_format=memory_format(cfg.channels_last))
        # the training loss's module: self.model, or with compile_model a compiled wrapper over
        # the same parameters, compiled on the first round and reused by every later one
        self.train_module = compiled_for_training(self.model, cfg.compile_model)
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.shared = set(self.task.shared_names(self.model))
        self.rule = ALGORITHMS[cfg.algorithm.name].local(cfg.algorithm)
        self.optimizer = self.rule.make_optimizer(self.named_params)
        self._batches: dict[int, ClientBatch] = {}  # client_batch: ClientBatch by number of clients

    def load_global(self, state: TensorDict) -> None:
        """Load the shared entries (``Task.shared_names``); a state with others or without all of
        them is refused."""
        if set(state) != self.shared:
            raise ValueError(f"The global state has {len(state)} entries, the task shares "
                             f"{len(self.shared)} (e.g. {sorted(set(state) ^ self.shared)[:3]})")
        self.model.load_state_dict(state, strict=False)

    def train_round(self, state: TensorDict, received: dict[str, TensorDict], *, partition_id: int,
                    num_partitions: int, server_round: int, lr: float, local_steps: int,
                    global_step: int, client_state: dict[str, TensorDict] | None = None) -> RoundResult:
        """K local steps from x^r = ``state`` with the server's ``received`` arrays and this client's
        kept ``client_state`` (None or {} on its first round); all inputs and outputs on the CPU."""
        self.load_global(state)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        received = {key: from_wire(arrays, self.cfg.wire_dtype) for key, arrays in received.items()}
        inputs = RoundInputs(received, client_state or {}, global_step)
        self.rule.begin_round(self.optimizer, self.named_params, inputs.to(self.device))
        generator = batch_generator(self.cfg.seed, server_round, partition_id, self.device)
        batches = self.task.train_batches(partition_id, num_partitions, server_round, self.device, generator)
        probe = TrustProbe(self.cfg.diagnostics.trust_every, self.cfg.diagnostics.top_p,
                           direction=lambda: self.rule.last_step_direction(self.optimizer),
                           amplified=lambda: self.rule.amplified_fraction(self.optimizer))
        stats = train_steps(self.model, self.optimizer, batches, local_steps, self.cfg.precision,
                            after_step=probe.after_step, loss_fn=self.task.loss,
                            train_module=self.train_module)
        new_state = self.model.state_dict()
        delta = {name: new_state[name].detach().cpu() - state[name] for name in state}
        lr_sum = lr * local_steps
        local = self.rule.end_round(self.optimizer, self.named_params, inputs, delta, lr_sum)
        update = ClientUpdate(delta=delta, num_steps=local_steps, lr_sum=lr_sum,
                              num_examples=stats.num_examples, arrays=_to_cpu(local.arrays))
        return RoundResult(update, stats.loss, _to_cpu(local.client_state), probe.summary())

    def train_batch(self, state: TensorDict, received: dict[str, TensorDict], *, partition_ids: list[int],
                    num_partitions: int, server_round: int, lr: float, local_steps: int,
                    global_step: int) -> list[RoundResult]:
        """The rounds of the clients ``partition_ids`` (FedACT family: they keep no state) trained at
        once (:class:`fedact_app.client_batch.ClientBatch`), each from its own batches as
        :meth:`train_round` draws them; inputs and outputs on the CPU."""
        batch = self._client_batch(len(partition_ids))
        received = {key: from_wire(arrays, self.cfg.wire_dtype) for key, arrays in received.items()}
        streams = [self.task.train_batches(p, num_partitions, server_round, self.device,
                                           batch_generator(self.cfg.seed, server_round, p, self.device))
                   for p in partition_ids]
        results = batch.train_round(state, received, streams, lr=lr, local_steps=local_steps,
                                    global_step=global_step)
        return [RoundResult(result.update, result.loss, {}, result.diagnostics) for result in results]

    def _client_batch(self, clients: int) -> ClientBatch:
        """The ``ClientBatch`` of ``clients`` clients, kept for the next round of as many (with
        ``compile_model``, each size compiles once); the two most recent sizes are kept."""
        batch = self._batches.pop(clients, None) or ClientBatch(
            self.model, self.cfg.algorithm, clients, self.task.loss, self.cfg.precision,
            self.cfg.diagnostics.trust_every, self.cfg.diagnostics.top_p, self.cfg.compile_model)
        self._batches[clients] = batch  # the most recent last
        while len(self._batches) > 2:
            del self._batches[next(iter(self._batches))]
        return batch

    def evaluate_local(self, state: TensorDict, *, partition_id: int,
                       num_partitions: int) -> tuple[dict[str, float], int]:
        """The global model on this client's share of the held-out data: metrics and its size."""
        self.load_global(state)
        return self.task.evaluate_client(self.model, partition_id, num_partitions, self.device)


@functools.lru_cache(maxsize=2)
def trainer_for(overrides: str, data_path: str | None = None) -> ClientTrainer:
    """The process's warm trainer for one run configuration (the run's ``overrides`` string).

    ``data_path`` (a SuperNode's node-config ``data-path``) replaces ``dataset.path``: the node
    trains on all the training data found there (one IID partition of one) and evaluates on the
    held-out data there (the test split; for text, its held-out documents or records). The rest
    of the dataset config (image size, channels, classes, columns, normalization) comes from the
    run's overrides, as for every other node.
    """
    cfg = compose(overrides)
    if data_path is None:
        return ClientTrainer(cfg)
    cfg = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, path=data_path),
                              partition=PartitionConfig(name="iid"))
    trainer = ClientTrainer(cfg)
    log(INFO, "SuperNode data: data-path=%s, %s", data_path, trainer.task.describe_train_data(0, 1))
    return trainer
