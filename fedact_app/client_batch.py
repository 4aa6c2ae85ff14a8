"""Several clients' local rounds of the FedACT family at once, on one device (plain PyTorch).

A round's clients start from the same x^r, v̄^r and Δ_G^{r-1} and differ only in their batches
(seed: Algorithm 1, lines 4-21). :class:`ClientBatch` keeps the trainable parameters of C such
clients as the rows of one ``[C, d]`` tensor (row c: client c's flat parameters, in
``named_parameters`` order), runs their forward and backward as one computation
(``torch.func.vmap`` over ``torch.func.functional_call`` of the model) and takes their steps with
one :class:`~fedact_app.optim.FedACTAdamW` whose parameters are the rows
(``trust_scope="global"``: one top-⌊τd⌋ selection per row, the seed's s ∈ R^d of each client) or
each row's views shaped like the model's tensors (``"tensor"``: one selection per client and
tensor). Its tensor scope selects within each of its parameters, which is why the rows are the
parameters. So a step of C clients runs about as many PyTorch operations as a step of one: on a
GPU, where a client's step is bound by launching kernels, the C clients' steps share the
launches. A run with ``client_batch=true`` trains each round's clients with it
(``ClientTrainer.train_batch``, fed by :mod:`fedact_app.node_worker.gather`);
``scripts/bench_client_batch.py`` measures it against the same clients one after another.

Each client's step is the step :class:`FedACTAdamW` takes for that client alone, from the same
batches; the batched matrix products may round differently from one client's (in float64 the
two agree to 1e-9 relative or better, ``tests/test_client_batch.py``). What must hold for that:

- every trainable parameter takes part in every client's loss (a single client's FedACTAdamW
  leaves a parameter without a gradient out of d): the first step refuses a model where one
  gets no gradient;
- the buffers of the state (BatchNorm's running statistics) are each client's own, ``[C, ...]``
  like the parameters, and their change is part of the client's Δ, as for a single client;
- the model trains without random layers (dropout, stochastic depth): ``vmap`` would draw the
  clients' randomness otherwise than a client alone; such a model is refused at its first step;
- timm's attention runs its unfused path (``fused_attn = False`` on the copy of the model the
  clients share): ``vmap`` has no batching rule for the CPU's fused attention kernel (it would
  run it one client after another), and on CUDA the memory-efficient kernel's backward under
  ``vmap`` fails at ViT-Tiny's shapes in float32 ("LSE is not correctly aligned", torch 2.11,
  NVIDIA H200).

``compile_mode`` (as a run's ``compile_model``) computes the clients' losses through
``torch.compile`` of the vmapped function (``fullgraph=True``; ``reduce-overhead``: CUDA graphs
on a GPU), compiled at the first step; AOTAutograd compiles its backward too. The sum of the
losses, the accumulation into the gradients and the optimizer step run eagerly.

The gradients, the state and the selection's buffers are C times a single client's. Each
client's trust-score diagnostics (:class:`fedact_app.diagnostics.TrustProbe`) are its own, taken
from one ``last_step_direction`` of the sampled step for all of them.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils._pytree import tree_map

from fedact_app.algorithms import ALGORITHMS, ClientUpdate, TensorDict
from fedact_app.config import COMPILE_MODES
from fedact_app.diagnostics import TrustProbe
from fedact_app.packing import as_vector
from fedact_app.registry import FEDACT_FAMILY
from fedact_app.train import autocast


@dataclass
class BatchedResult:
    """One client's round within the batch: its reply, its mean training loss and its trust-score
    diagnostics (``TrustProbe.summary``)."""

    update: ClientUpdate
    loss: float
    diagnostics: dict[str, float]


class ClientBatch:
    """C clients of the FedACT family trained at once on the device of ``model``.

    Args:
        model: the clients' architecture; it is copied, and each round loads the ``state``
            given into the copy (a buffer the state does not hold, such as a non-persistent one,
            keeps the copy's value; the trainable tensors are the rows).
        algorithm: the method's config (``fedact``, ``fedadamw`` or ``fedact_local``): its lr
            schedule is the caller's, everything else (betas, eps, weight decay, rho, tau,
            alpha, gamma, trust scope and signal, scale_matched, fused, compile) applies as in
            :class:`~fedact_app.algorithms.FedACTLocal`.
        clients: C, the number of clients each :meth:`train_round` trains.
        loss_fn: ``loss_fn(module, batch) -> (loss, examples)``, a training loss such as
            :func:`fedact_app.train.classification_loss`; it is called inside ``vmap`` with one
            client's batch and a ``module`` that takes the model's positional and keyword
            inputs, so it must only compute on tensors (no ``.item()``, no memory format other
            than contiguous).
        precision: ``fp32`` or ``bf16`` (:func:`fedact_app.train.autocast`).
        trust_every, top_p: the clients' diagnostics (``diagnostics.trust_every``, ``.top_p``;
            ``trust_every=0``: none), as :class:`~fedact_app.diagnostics.TrustProbe` takes them.
        compile_mode: ``none`` (eager), or the ``torch.compile`` mode of the clients' vmapped
            loss (``default``, ``reduce-overhead``, ``max-autotune``; ``dynamic=False``).
    """

    def __init__(self, model: nn.Module, algorithm, clients: int,
                 loss_fn: Callable[[Any, Any], tuple[Tensor, int]], precision: str = "fp32",
                 trust_every: int = 0, top_p: float = 0.01, compile_mode: str = "none") -> None:
        if algorithm.name not in FEDACT_FAMILY:
            raise ValueError(f"ClientBatch trains the FedACT family {FEDACT_FAMILY}, not "
                             f"algorithm={algorithm.name!r}")
        if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
            raise ValueError(f"Invalid clients: {clients!r}; expected an integer >= 1")
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"Invalid precision: {precision!r}; expected 'fp32' or 'bf16'")
        if compile_mode not in COMPILE_MODES:
            raise ValueError(f"Invalid compile_mode: {compile_mode!r}; expected one of {COMPILE_MODES}")
        self.template = copy.deepcopy(model)
        self.named = [(name, p) for name, p in self.template.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in self.named]
        if not self.named:
            raise ValueError("ClientBatch needs a model with trainable parameters; this one has none")
        if len({(p.dtype, p.device) for _, p in self.named}) > 1:
            raise ValueError("ClientBatch needs every trainable parameter on one device and of one dtype; got "
                             f"{sorted({f'{p.dtype} on {p.device}' for _, p in self.named})}")
        for module in self.template.modules():
            if hasattr(module, "fused_attn"):  # timm's attention (module docstring)
                module.fused_attn = False
        self.clients, self.loss_fn, self.precision = clients, loss_fn, precision
        self.trust_every, self.top_p = trust_every, top_p
        self.offsets = [0]
        for _, p in self.named:
            self.offsets.append(self.offsets[-1] + p.numel())
        first = self.named[0][1]
        self.device = first.device
        # The clients' parameters: row c of `weights` is client c's flat parameters. The forward
        # reads them as one stacked leaf per model tensor (a [C, ...] view of `weights`), whose
        # gradient is accumulated in place into the same view of `grads`; the optimizer's
        # parameters are the rows (or their tensors) of `weights`, its gradients those of `grads`.
        # (Slicing one [C, d] leaf in the forward instead would make each slice's backward fill a
        # [C, d] gradient: O(tensors x C x d) a step.)
        self.weights = torch.zeros(clients, self.offsets[-1], dtype=first.dtype, device=self.device)
        self.grads = torch.zeros_like(self.weights)
        self.leaves = {name: view.requires_grad_() for name, view in self._stacked(self.weights).items()}
        self.leaf_grads = list(self._stacked(self.grads).values())
        for leaf, grad in zip(self.leaves.values(), self.leaf_grads):
            leaf.grad = grad
        self.rows_are_params = algorithm.trust_scope == "global"
        self._examples = 0  # the loss function's examples a client's batch (the same for all)
        if self.rows_are_params:
            self.params = list(self.weights.unbind(0))
            grads = list(self.grads.unbind(0))
        else:
            self.params = [view for row in self.weights.unbind(0) for view in self._views(row).values()]
            grads = [view for row in self.grads.unbind(0) for view in self._views(row).values()]
        for p, g in zip(self.params, grads):
            p.grad = g
        # each of the optimizer's parameters is one selection scope of one client: a row for the
        # global scope, a row's tensor for the tensor scope (FedACTAdamW's tensor scope)
        self.rule = ALGORITHMS[algorithm.name].local(replace(algorithm, trust_scope="tensor"))
        self.optimizer = self.rule.make_optimizer([(str(i), p) for i, p in enumerate(self.params)])
        self._pairs: tuple[int, list[tuple[Tensor, Tensor]] | None] = (0, None)
        self._checked = False  # whether a step has shown that every trainable parameter gets a gradient
        # each client's own copy of the state's buffers (BatchNorm's running statistics), which
        # the forward writes in place; each round copies the state's values in
        persistent = self.template.state_dict().keys()
        self.buffers = {name: b.detach().expand(clients, *b.shape).clone()
                        for name, b in self.template.named_buffers() if name in persistent}
        # randomness="error" (vmap's default): a random layer raises (module docstring)
        self.compiled = compile_mode != "none"
        self._losses = vmap(self._client_loss)
        if self.compiled:
            # The leaves and the buffers keep their addresses (the rounds and the optimizer write
            # them in place): as static inputs, CUDA graphs (reduce-overhead) read them where they
            # are, rather than copying each into a graph buffer before every replay (a [C, ...]
            # view of `weights` spans (C - 1) d + n entries), and may write the buffers in place.
            for tensor in (*self.leaves.values(), *self.buffers.values()):
                torch._dynamo.mark_static_address(tensor)
            self._losses = torch.compile(self._losses, mode=compile_mode, dynamic=False, fullgraph=True)

    def _stacked(self, rows: Tensor) -> dict[str, Tensor]:
        """The model's trainable tensors as [C, ...] views of the clients' ``rows``."""
        return {name: rows[:, start:end].view(rows.shape[0], *p.shape)
                for (name, p), start, end in zip(self.named, self.offsets, self.offsets[1:])}

    def _views(self, row: Tensor) -> dict[str, Tensor]:
        """The model's trainable tensors as views of one client's flat ``row``."""
        return {name: row[start:end].view(p.shape)
                for (name, p), start, end in zip(self.named, self.offsets, self.offsets[1:])}

    def _per_parameter(self, received: dict[str, TensorDict], key: str) -> list[Tensor] | None:
        """``received[key]`` (a tensor per trainable parameter) as one tensor per optimizer
        parameter, the same values for every client; None where the server sent no ``key``."""
        arrays = received.get(key)
        if arrays is None:
            return None
        if self.rows_are_params:
            return [as_vector(arrays, self.names).to(self.device, self.weights.dtype)] * self.clients
        return [arrays[name].to(self.device, self.weights.dtype) for name in self.names] * self.clients

    def _client_pairs(self, client: int) -> list[tuple[Tensor, Tensor]] | None:
        """Client ``client``'s (u, g) pairs of the last step (``rule.last_step_direction``, made
        once a step for all clients)."""
        step = self.optimizer.local_step
        if self._pairs[0] != step:
            self._pairs = (step, self.rule.last_step_direction(self.optimizer))
        pairs = self._pairs[1]
        if pairs is None:
            return None
        per_client = len(pairs) // self.clients
        return pairs[client * per_client:(client + 1) * per_client]

    def _client_loss(self, params: dict[str, Tensor], buffers: dict[str, Tensor], batch: Any) -> Tensor:
        def module(*args, **kwargs):
            return functional_call(self.template, {**params, **buffers}, args, kwargs)
        loss, self._examples = self.loss_fn(module, batch)
        return loss

    def train_round(self, state: TensorDict, received: dict[str, TensorDict], batches: Sequence[Any], *,
                    lr: float, local_steps: int, global_step: int) -> list[BatchedResult]:
        """K = ``local_steps`` steps of each client from x^r = ``state`` (the model's whole state
        dict, on the CPU) with the server's ``received`` arrays (``v_bar``, ``delta_g``; absent
        means zeros) and ``global_step`` = t before the round's first step. ``batches[c]`` is
        client c's stream (``next_batch()``): each step stacks the C batches, which must have
        the same shapes. Returns each client's reply (Δ_c, v_c) and loss, in ``batches`` order."""
        if len(batches) != self.clients:
            raise ValueError(f"train_round got {len(batches)} clients' batches for a ClientBatch of "
                             f"{self.clients} clients")
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"Invalid local_steps: {local_steps!r}; expected an integer >= 1")
        if missing := [name for name in self.names if name not in state]:
            raise ValueError(f"The state lacks {len(missing)} of the model's trainable tensors, e.g. {missing[:3]}")
        if missing := [name for name in self.buffers if name not in state]:
            raise ValueError(f"The state lacks {len(missing)} of the model's buffers, e.g. {missing[:3]}")
        self.template.load_state_dict(state, strict=False)  # what is not trained: buffers, frozen tensors
        self.template.train()
        self.weights.copy_(as_vector(state, self.names).expand(self.clients, -1))
        for name, buffer in self.buffers.items():
            buffer.copy_(state[name].expand_as(buffer))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.begin_round(v_bar=self._per_parameter(received, "v_bar"),
                                   delta_g=self._per_parameter(received, "delta_g"), global_step=global_step)
        self._pairs = (0, None)
        # amplified_fraction is the same for every client: each has its d coordinates and k of them
        probes = [TrustProbe(self.trust_every, self.top_p, direction=functools.partial(self._client_pairs, c),
                             amplified=lambda: self.rule.amplified_fraction(self.optimizer))
                  for c in range(self.clients)]
        loss_sum = torch.zeros(self.clients, dtype=torch.float64, device=self.device)
        examples = 0
        for step in range(1, local_steps + 1):
            batch = tree_map(lambda *leaves: torch.stack(leaves), *[b.next_batch() for b in batches])
            self.grads.zero_()
            if self.compiled:
                # a new iteration for CUDA graphs (reduce-overhead): the last step's outputs may be
                # overwritten from here on; a no-op without CUDA graphs
                torch.compiler.cudagraph_mark_step_begin()
            try:
                with autocast(self.device, self.precision):
                    loss = self._losses(self.leaves, self.buffers, batch)
            except RuntimeError as err:
                if "randomness error mode" not in str(err):
                    raise
                raise ValueError("ClientBatch trains models without random layers in training (dropout, "
                                 "stochastic depth): this model draws random numbers in its forward") from err
            reached: set[str] = set()
            hooks = [] if self._checked else [
                leaf.register_post_accumulate_grad_hook(lambda _, name=name: reached.add(name))
                for name, leaf in self.leaves.items()]
            try:
                with warnings.catch_warnings():
                    # a leaf's rows are d apart in `weights` and its gradient's in `grads` (each
                    # row one client's flat parameters): autograd warns that this is not the
                    # layout a fresh gradient would have
                    warnings.filterwarnings("ignore",
                                            message="grad and param do not obey the gradient layout contract")
                    loss.sum().backward()
            finally:
                for hook in hooks:
                    hook.remove()
            if hooks:
                if unused := [name for name in self.leaves if name not in reached]:
                    raise ValueError(f"ClientBatch needs every trainable parameter in the loss; {len(unused)} got "
                                     f"no gradient, e.g. {unused[:3]} (freeze them: requires_grad=False)")
                self._checked = True
            if any(leaf.grad is not grad for leaf, grad in zip(self.leaves.values(), self.leaf_grads)):
                raise RuntimeError("autograd replaced a gradient of ClientBatch instead of accumulating into it")
            self.optimizer.step()
            for probe in probes:
                probe.after_step(step)
            loss_sum += loss.detach()
            examples += self._examples
        rows = self.weights.cpu()  # on a CPU device the live rows: each delta below is a new tensor
        moments = torch.cat([m.reshape(-1) for m in self.optimizer.second_moments()]).reshape(self.clients, -1).cpu()
        results = []
        for c, mean_loss in enumerate((loss_sum / local_steps).tolist()):
            trained = {name: view - state[name] for name, view in self._views(rows[c]).items()}
            trained.update({name: tensor[c].cpu() - state[name] for name, tensor in self.buffers.items()})
            delta = {name: trained.get(name, torch.zeros_like(tensor)) for name, tensor in state.items()}
            v = self._views(moments[c])  # views of this round's own copy of the moments
            update = ClientUpdate(delta=delta, num_steps=local_steps, lr_sum=lr * local_steps,
                                  num_examples=examples, arrays={"v": v})
            results.append(BatchedResult(update, mean_loss, probes[c].summary()))
        self._pairs = (0, None)  # the last sampled step's u: C x d, not kept past the round
        return results
