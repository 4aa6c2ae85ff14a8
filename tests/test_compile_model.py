"""``compile_model``: the clients' training forward/backward through ``torch.compile``.

The compiled path is checked against the eager one (``compile_model=none``) on the same x^r,
v_bar, Delta_G and batches: the loss and every gradient of one batch, and the delta, v and mean
loss of a real client round of K=3 FedACT steps, for cnn_small and a one-block ViT on digits.
They differ by rounding only (inductor fuses and reorders the float32 arithmetic); the bound
below is about 50x the largest difference measured on CPU, 2.1e-6 (docs/PERFORMANCE.md,
"Compiled model step"). Counters of torch._dynamo show that the compiled path ran, and was compiled once.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from fedact_app.client_trainer import ClientTrainer
from fedact_app.config import ConfigError, compose
from fedact_app.train import batch_generator

# largest |compiled - eager| over a tensor, relative to that tensor's largest |eager| value
RELATIVE_BOUND = 1e-4

MODELS = {
    "cnn_small": [],
    "vit": ["model=vit_tiny", "model.kwargs.depth=1", "model.kwargs.embed_dim=48", "batch_size=16"],
}


def test_compose_refuses_an_unknown_mode_and_language_tasks():
    assert compose().compile_model == "none"
    assert compose("compile_model=reduce-overhead").compile_model == "reduce-overhead"
    with pytest.raises(ConfigError, match="compile_model='fast'.*none, default, reduce-overhead, max-autotune"):
        compose("compile_model=fast")
    with pytest.raises(ConfigError, match="compile_model='default'.*none for task=lm_pretrain"):
        compose("task=lm_pretrain dataset=text dataset.path=/x.txt model=llama_tiny compile_model=default")


def relative_error(eager: dict[str, torch.Tensor], compiled: dict[str, torch.Tensor]) -> float:
    assert eager.keys() == compiled.keys()
    return max(float((compiled[n] - t).abs().max() / t.abs().max().clamp_min(1e-30)) for n, t in eager.items())


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


DEVICES = {"cpu": "default", **({"cuda": "reduce-overhead"} if torch.cuda.is_available() else {})}


@pytest.fixture(scope="module", params=[(m, d) for d in DEVICES for m in MODELS], ids="-".join)
def pair(request):
    """An eager and a compiled trainer of one config, a round's inputs, and the first round of
    each with the graphs torch._dynamo captured in it."""
    model, device = request.param
    base = [f"device={device}", "num_clients=2", "diagnostics.trust_every=0", *MODELS[model]]
    eager, compiled = (ClientTrainer(compose([*base, f"compile_model={mode}"])) for mode in ("none", DEVICES[device]))
    state = {n: t.detach().cpu().clone() for n, t in eager.model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    received = {"v_bar": {n: torch.rand(state[n].shape, generator=gen) * 1e-3 for n, _ in eager.named_params},
                "delta_g": {n: torch.randn(state[n].shape, generator=gen) * 1e-2 for n, _ in eager.named_params}}
    rounds, captured = {}, {}
    for name, trainer in (("eager", eager), ("compiled", compiled)):
        before = graphs()
        rounds[name] = trainer.train_round(state, received, partition_id=0, num_partitions=2, server_round=2,
                                           lr=1e-3, local_steps=3, global_step=4)
        captured[name] = graphs() - before
    return dict(eager=eager, compiled=compiled, state=state, received=received, rounds=rounds, captured=captured)


def test_loss_and_gradients_equal_the_eager_ones_up_to_rounding(pair):
    eager, compiled = pair["eager"], pair["compiled"]
    batch = eager.task.train_batches(1, 2, 5, eager.device, batch_generator(0, 1, 1, eager.device)).next_batch()
    losses, grads = {}, {}
    for name, trainer in (("eager", eager), ("compiled", compiled)):
        trainer.load_global(pair["state"])
        trainer.model.train()
        trainer.model.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        loss, _ = trainer.task.loss(trainer.train_module, batch)
        loss.backward()
        losses[name] = loss.detach()
        grads[name] = {n: p.grad.clone() for n, p in trainer.named_params}
    assert relative_error({"loss": losses["eager"]}, {"loss": losses["compiled"]}) < RELATIVE_BOUND
    assert relative_error(grads["eager"], grads["compiled"]) < RELATIVE_BOUND


def test_a_round_of_three_fedact_steps_equals_the_eager_one_up_to_rounding(pair):
    eager, compiled = pair["rounds"]["eager"].update, pair["rounds"]["compiled"].update
    assert relative_error(eager.delta, compiled.delta) < RELATIVE_BOUND
    assert relative_error(eager.arrays["v"], compiled.arrays["v"]) < RELATIVE_BOUND
    assert pair["rounds"]["compiled"].loss == pytest.approx(pair["rounds"]["eager"].loss, rel=RELATIVE_BOUND)


def test_the_model_keeps_its_state_dict_keys(pair):
    eager, compiled = pair["eager"], pair["compiled"]
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    assert not any("_orig_mod" in n for n in compiled.model.state_dict())
    assert compiled.shared == eager.shared and set(pair["rounds"]["compiled"].update.delta) == eager.shared


def test_the_compiled_path_runs_and_compiles_once(pair):
    """The compiled round captured a graph (the eager one none); an evaluation (eager, in eval
    mode) and a later round of another client reuse it: no new graph."""
    assert pair["captured"] == {"eager": 0, "compiled": 1}
    before = graphs()
    metrics, examples = pair["compiled"].evaluate_local(pair["state"], partition_id=1, num_partitions=2)
    assert examples > 0 and metrics["test_loss"] > 0
    pair["compiled"].train_round(pair["state"], pair["received"], partition_id=1, num_partitions=2,
                                 server_round=3, lr=1e-3, local_steps=2, global_step=7)
    assert graphs() == before
