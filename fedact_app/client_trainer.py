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

import torch
from flwr.common import log

from fedact_app.algorithms import ALGORITHMS, ClientUpdate, RoundInputs, TensorDict
from fedact_app.config import Config, PartitionConfig, compose
from fedact_app.data import (BatchStream, ImageTensors, batch_generator, load_client_train, load_test,
                             partition_indices, test_batches)
from fedact_app.diagnostics import TrustProbe
from fedact_app.models import build_model
from fedact_app.train import EvalStats, evaluate, memory_format, resolve_device, train_steps
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
    """Model, local optimizer and method rule of one process."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.model = build_model(cfg.model, cfg.dataset).to(self.device,
                                                             memory_format=memory_format(cfg.channels_last))
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.rule = ALGORITHMS[cfg.algorithm.name].local(cfg.algorithm)
        self.optimizer = self.rule.make_optimizer(self.named_params)
        self._train_data: dict[tuple[int, int], ImageTensors] = {}

    def train_data(self, partition_id: int, num_partitions: int) -> ImageTensors:
        """This client's partition, resident on the training device (cached per process)."""
        key = (partition_id, num_partitions)
        if key not in self._train_data:
            self._train_data[key] = load_client_train(self.cfg, partition_id, num_partitions).to(self.device)
        return self._train_data[key]

    def load_global(self, state: TensorDict) -> None:
        self.model.load_state_dict(state)

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
        batches = BatchStream(self.train_data(partition_id, num_partitions), self.cfg.batch_size,
                              self.cfg.dataset.augment, generator)
        probe = TrustProbe(self.cfg.diagnostics.trust_every, self.cfg.diagnostics.top_p,
                           direction=lambda: self.rule.last_step_direction(self.optimizer),
                           amplified=lambda: self.rule.amplified_fraction(self.optimizer))
        stats = train_steps(self.model, self.optimizer, batches, local_steps, self.cfg.precision,
                            self.cfg.channels_last, after_step=probe.after_step)
        new_state = self.model.state_dict()
        delta = {name: new_state[name].detach().cpu() - state[name] for name in state}
        lr_sum = lr * local_steps
        local = self.rule.end_round(self.optimizer, self.named_params, inputs, delta, lr_sum)
        update = ClientUpdate(delta=delta, num_steps=local_steps, lr_sum=lr_sum,
                              num_examples=stats.num_examples, arrays=_to_cpu(local.arrays))
        return RoundResult(update, stats.loss, _to_cpu(local.client_state), probe.summary())

    def evaluate_local(self, state: TensorDict, *, partition_id: int, num_partitions: int) -> EvalStats:
        """The global model on this client's share of the test set (an IID split of it)."""
        self.load_global(state)
        test = load_test(self.cfg)
        indices = partition_indices(test.labels.numpy(), num_partitions, PartitionConfig(name="iid"),
                                    self.cfg.seed)[partition_id]
        index = torch.as_tensor(indices, dtype=torch.long)
        local = ImageTensors(test.images[index], test.labels[index]).to(self.device)
        return evaluate(self.model, test_batches(local, self.cfg.eval_batch_size), self.cfg.precision,
                        self.cfg.channels_last)


@functools.lru_cache(maxsize=2)
def trainer_for(overrides: str, data_path: str | None = None) -> ClientTrainer:
    """The process's warm trainer for one run configuration (the run's ``overrides`` string).

    ``data_path`` (a SuperNode's node-config ``data-path``) replaces ``dataset.path``: the node
    trains on the whole train split found there (one IID partition of one) and evaluates on the
    whole test split there. The rest of the dataset config (image size, channels, classes,
    columns, normalization) comes from the run's overrides, as for every other node.
    """
    cfg = compose(overrides)
    if data_path is None:
        return ClientTrainer(cfg)
    cfg = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, path=data_path),
                              partition=PartitionConfig(name="iid"))
    trainer = ClientTrainer(cfg)
    log(INFO, "SuperNode data: data-path=%s, %d training examples", data_path,
        len(trainer.train_data(0, 1)))
    return trainer
