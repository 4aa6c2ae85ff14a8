"""Flower ServerApp: compose the config, build model, method and strategy, evaluate, write results."""

from __future__ import annotations

import random
import time
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from fedact_app.aggregation import Aggregation
from fedact_app.algorithms import ALGORITHMS, TensorDict
from fedact_app.checkpoint import Checkpointer, client_round_config, open_resume, restore, snapshot
from fedact_app.config import Config, compose
from fedact_app.node_slot import remove_run_locks, remove_stale_locks
from fedact_app.node_worker.gather import CLIENT_BATCH_KEY
from fedact_app.results import RunRecorder, create_run_dir
from fedact_app.serverapp_done import mark_done
from fedact_app.strategy import AlgorithmStrategy
from fedact_app.tasks.base import Task, build_task
from fedact_app.timeline import process_started
from fedact_app.train import cosine_lr, memory_format, resolve_device

app = ServerApp()


class CentralEvaluator:
    """The task's held-out metrics of the global model at round 0, every ``eval_every`` rounds
    and the last."""

    def __init__(self, cfg: Config, task: Task, model: torch.nn.Module) -> None:
        self.cfg = cfg
        self.task = task
        self.device = resolve_device(cfg.device)
        self.model = model.to(self.device, memory_format=memory_format(cfg.channels_last))

    def __call__(self, server_round: int, state: TensorDict) -> dict | None:
        due = server_round % self.cfg.eval_every == 0 or server_round == self.cfg.num_rounds
        if not due:
            return None
        self.model.load_state_dict(state, strict=False)  # the shared entries (Task.shared_names)
        return self.task.evaluate(self.model, self.device)


def server_device(cfg: Config) -> torch.device:
    """Where the ServerApp keeps the global state and combines the replies (``server_device``):
    ``auto`` is the CPU in a ``device=cpu`` run (the whole run on the CPU, as its results on
    another machine are), else CUDA where this process sees a GPU."""
    choice = "cpu" if cfg.server_device == "auto" and cfg.device == "cpu" else cfg.server_device
    return resolve_device(choice, "server_device")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


Startup = dict[str, float | None]  # a start-up phase -> its Unix time (summary.json's ``startup``)


def initial_model(cfg: Config, startup: Startup | None = None) -> tuple[Task, torch.nn.Module, TensorDict, list[str]]:
    """The run's task (its data checked), its model with the seed's initial weights, the shared
    entries of that model (x^0, copies) and the names of the trainable parameters. ``startup``
    gets the Unix times of the data checked (``data``) and of the model built (``model``)."""
    marks = {} if startup is None else startup
    task = build_task(cfg)
    task.check_data()
    marks["data"] = time.time()
    seed_everything(cfg.seed)
    model = task.build_model()
    marks["model"] = time.time()
    full_state = model.state_dict()
    initial_state = {name: full_state[name].detach().clone() for name in task.shared_names(model)}
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    return task, model, initial_state, trainable


@app.main()
def main(grid: Grid, context: Context) -> None:
    if run_app(grid, context).clients_idle:  # Flower's shutdown then waits on no client
        mark_done(context.run_id)  # a local engine may start its next run meanwhile


def run_app(grid: Grid, context: Context) -> AlgorithmStrategy:
    """The whole run: configuration, task and model, the method's rounds, the run folder; the
    strategy that ran them. summary.json's ``startup`` has the Unix times of the start-up's
    phases: this process's start (``process``, None where /proc is missing), this call
    (``serverapp``), the training data checked against the partition (``data``), the model built
    (``model``), the model on the ServerApp's device (``task``), and the start of the first round
    this run ran (``first_round``: round 1, or the one after a resumed checkpoint; its sampling,
    before the nodes' identification)."""
    startup = {"process": process_started(), "serverapp": time.time()}
    cfg = compose(str(context.run_config.get("overrides", "")))
    resume = open_resume(cfg)
    task, model, initial_state, trainable = initial_model(cfg, startup)
    log(INFO, "%s on %s with %s: %d trainable parameters", cfg.algorithm.name, cfg.dataset.name,
        cfg.model.name, sum(p.numel() for p in model.parameters() if p.requires_grad))
    if ALGORITHMS[cfg.algorithm.name].samples_trust_scores and cfg.local_steps < cfg.diagnostics.trust_every:
        log(WARNING, "local_steps=%d < diagnostics.trust_every=%d: clients sample no trust-score "
            "statistics (positive_ratio, top_p_mass, amplified_fraction); lower diagnostics.trust_every "
            "to get them", cfg.local_steps, cfg.diagnostics.trust_every)

    evaluator = CentralEvaluator(cfg, task, model)
    startup["task"] = time.time()
    recorder = RunRecorder(create_run_dir(cfg), cfg, earlier_rows=resume.checkpoint.rows if resume else ())
    checkpointer = Checkpointer(recorder.run_dir, cfg, resume.checkpoint.clients if resume else None)
    algorithm = cfg.algorithm
    strategy = AlgorithmStrategy(
        ALGORITHMS[algorithm.name].server(algorithm, trainable, num_clients=cfg.num_clients,
                                          aggregation=Aggregation(cfg.aggregation, cfg.trim_fraction)),
        trainable=trainable,
        local_steps=cfg.local_steps,
        lr_schedule=lambda r: cosine_lr(r, cfg.num_rounds, algorithm.lr, algorithm.lr_min),
        fraction_train=cfg.fraction_train, min_train_nodes=cfg.min_train_nodes,
        fraction_evaluate=cfg.fraction_evaluate, seed=cfg.seed, expected_nodes=cfg.num_clients,
        max_empty_rounds=cfg.max_empty_rounds, max_update_norm=cfg.max_update_norm,
        batch_size=cfg.batch_size, max_moment_ratio=cfg.max_moment_ratio,
        max_update_ratio=cfg.max_update_ratio, wire_dtype=cfg.wire_dtype, reply_dtype=cfg.reply_dtype,
        train_config={**client_round_config(checkpointer, resume),
                      **({CLIENT_BATCH_KEY: True} if cfg.client_batch else {})},
        device=server_device(cfg))
    if resume is not None:
        restore(strategy, resume.checkpoint)
        log(INFO, "Resuming after round %d from %s", resume.checkpoint.round, resume.source)

    def after_round(server_round: int) -> None:
        if checkpointer.due(server_round):
            path = checkpointer.write(snapshot(strategy, server_round, recorder.rows, cfg))
            log(INFO, "Checkpoint: %s", path)

    remove_stale_locks()
    try:
        final_state = strategy.run(grid, cfg.num_rounds, cfg.round_timeout, evaluate_fn=evaluator,
                                   on_round_end=recorder.record_round,
                                   initial_state=None if resume else initial_state,
                                   first_round=resume.checkpoint.round + 1 if resume else 1, after_round=after_round,
                                   overlap_evaluation=lambda server_round: not checkpointer.due(server_round))
    finally:
        remove_run_locks(context.run_id)  # the simulated nodes' slots (fedact_app.node_slot)
    recorder.finish(final_state, startup={**startup, "first_round": strategy.first_round_started})
    return strategy
