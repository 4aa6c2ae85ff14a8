"""ClientBatch (C clients' FedACT rounds at once) against the same clients trained one at a time."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fedact_app.client_batch import ClientBatch
from fedact_app.config import AlgorithmConfig, DatasetConfig, ModelConfig
from fedact_app.diagnostics import TrustProbe
from fedact_app.optim import FedACTAdamW
from fedact_app.tasks.vision.models import build_model
from fedact_app.train import classification_loss
from timm.models.vision_transformer import VisionTransformer
from torch._dynamo.utils import counters

BATCH = 4
TOP_P = 0.05


def small_vit(fused_attn: bool = True) -> torch.nn.Module:
    """A two-block timm ViT in float64, without the attention's qkv bias: the key's bias gets a
    gradient of 0 in exact arithmetic (softmax ignores a shift of all logits), so its trust scores
    are rounding noise, and which of them a top-k takes would follow the rounding, which differs
    between a batched product and a single one."""
    torch.manual_seed(0)
    model = VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=5, embed_dim=12, depth=2,
                              num_heads=2, qkv_bias=False)
    for module in model.modules():
        if hasattr(module, "fused_attn"):
            module.fused_attn = fused_attn
    return model.double()


class Stream:
    """A client's fixed batches, handed out in order (a BatchStream's contract), on ``device``."""

    def __init__(self, batches, device="cpu"):
        self.batches = [tuple(t.to(device) for t in batch) for batch in batches]
        self.position = 0

    def next_batch(self):
        self.position += 1
        return self.batches[self.position - 1]


def client_batches(client: int, steps: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + client)
    return [(torch.randn(BATCH, 3, size, size, generator=generator, dtype=torch.float64),
             torch.randint(0, 5, (BATCH,), generator=generator)) for _ in range(steps)]


def one_client(model, algorithm, state, received, batches, lr, steps, global_step, trust_every=0,
               precision="fp32"):
    """The reference: one client's round with its own FedACTAdamW, as ClientTrainer takes it
    (in train mode, the forward under ``precision``), and its TrustProbe's summary."""
    model.load_state_dict(state)
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    a = algorithm
    optimizer = FedACTAdamW([p for _, p in named], lr=lr, betas=tuple(a.betas), eps=a.eps,
                            weight_decay=a.weight_decay, rho=a.rho, tau=a.tau, alpha=a.alpha, gamma=a.gamma,
                            trust_scope=a.trust_scope, trust_signal=a.trust_signal,
                            scale_matched=a.scale_matched)
    optimizer.begin_round(v_bar=[received["v_bar"][n] for n, _ in named] if "v_bar" in received else None,
                          delta_g=[received["delta_g"][n] for n, _ in named] if "delta_g" in received else None,
                          global_step=global_step)
    probe = TrustProbe(trust_every, TOP_P, direction=optimizer.last_step_direction,
                       amplified=optimizer.amplified_fraction)
    losses = []
    device = next(model.parameters()).device
    for images, labels in ((images.to(device), labels.to(device)) for images, labels in batches):
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        probe.after_step(len(losses) + 1)
        losses.append(loss.item())
    delta = {n: t.detach().cpu() - state[n] for n, t in model.state_dict().items()}
    v = {n: m.detach().cpu() for (n, _), m in zip(named, optimizer.second_moments())}
    return delta, v, sum(losses) / len(losses), probe.summary()


def server_arrays(model, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return {"v_bar": {n: torch.rand(p.shape, generator=generator, dtype=p.dtype) * 1e-3 for n, p in named},
            "delta_g": {n: torch.randn(p.shape, generator=generator, dtype=p.dtype) * 1e-2 for n, p in named}}


@pytest.mark.parametrize("settings", [
    dict(name="fedact"),
    dict(name="fedact", trust_scope="tensor"),
    dict(name="fedact", scale_matched=True, tau=0.3),
    dict(name="fedact_local"),
    dict(name="fedadamw", trust_signal="none"),
    dict(name="fedact", rho=0.0),
])
def test_each_client_steps_as_if_alone(settings):
    settings = {"lr": 1e-2, "weight_decay": 0.05,
                "trust_signal": {"fedact_local": "local"}.get(settings["name"], "corrected"), **settings}
    algorithm = dataclasses.replace(AlgorithmConfig(), **settings)
    model = small_vit()
    state = {n: t.clone() for n, t in model.state_dict().items()}
    received = server_arrays(model, 7)
    clients, steps, lr = 3, 3, 1e-2
    batch = ClientBatch(model, algorithm, clients, classification_loss, trust_every=1, top_p=TOP_P)
    results = batch.train_round(state, received, [Stream(client_batches(c, steps)) for c in range(clients)],
                                lr=lr, local_steps=steps, global_step=6)
    assert len(results) == clients
    for c, result in enumerate(results):
        delta, v, loss, diagnostics = one_client(small_vit(), algorithm, state, received, client_batches(c, steps),
                                                 lr, steps, 6, trust_every=1)
        assert set(result.diagnostics) == set(diagnostics) == {"positive-ratio", "top-p-mass", "amplified-fraction"}
        for key, value in diagnostics.items():
            assert result.diagnostics[key] == pytest.approx(value, rel=1e-9), key
        assert set(result.update.delta) == set(delta)
        for name in delta:
            torch.testing.assert_close(result.update.delta[name], delta[name], rtol=1e-9, atol=1e-12)
            assert result.update.delta[name].abs().max() > 0 or delta[name].abs().max() == 0
        for name in v:
            torch.testing.assert_close(result.update.arrays["v"][name], v[name], rtol=1e-9, atol=1e-15)
        assert result.loss == pytest.approx(loss, rel=1e-12)
        assert result.update.num_examples == steps * BATCH and result.update.num_steps == steps
        assert result.update.lr_sum == pytest.approx(lr * steps)
    # the clients' batches differ, so do their rounds
    assert not torch.allclose(results[0].update.delta["head.weight"], results[1].update.delta["head.weight"])


def test_batchnorm_statistics_are_each_clients_own():
    """ResNet-18: every client's running statistics (and its count of batches) move with its own
    batches and come back in its Δ, as with the client alone. At 16 px (at 8 px the last stage's
    BatchNorm normalizes 4 values a channel, which magnifies rounding past the tolerance)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="resnet18"), DatasetConfig(image_size=16, channels=3, num_classes=5)).double()
    algorithm = dataclasses.replace(AlgorithmConfig(), name="fedact", lr=1e-2)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    received = server_arrays(model, 5)
    # a model handed over in eval mode trains in train mode, as train_steps trains a client's
    results = ClientBatch(copy.deepcopy(model).eval(), algorithm, 2, classification_loss).train_round(
        state, received, [Stream(client_batches(c, 2, 16)) for c in range(2)], lr=1e-2, local_steps=2,
        global_step=4)
    for c, result in enumerate(results):
        delta, v, loss, _ = one_client(copy.deepcopy(model), algorithm, state, received, client_batches(c, 2, 16),
                                       1e-2, 2, 4)
        assert result.loss == pytest.approx(loss, rel=1e-12)
        assert result.update.delta["bn1.num_batches_tracked"] == delta["bn1.num_batches_tracked"] == 2
        assert result.update.delta["bn1.running_mean"].abs().max() > 0
        for name in delta:
            torch.testing.assert_close(result.update.delta[name], delta[name], rtol=1e-9, atol=1e-12)
        for name in v:
            torch.testing.assert_close(result.update.arrays["v"][name], v[name], rtol=1e-9, atol=1e-15)
    assert not torch.equal(results[0].update.delta["bn1.running_mean"], results[1].update.delta["bn1.running_mean"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scope", ["global", "tensor"])
def test_cuda_each_client_steps_as_if_alone(scope):
    """On the GPU: the batched products, the clients' rows and the device selection per row."""
    algorithm = dataclasses.replace(AlgorithmConfig(), name="fedact", lr=1e-2, weight_decay=0.05, trust_scope=scope)
    model = small_vit().cuda()
    state = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
    received = server_arrays(model, 7)
    results = ClientBatch(model, algorithm, 3, classification_loss).train_round(
        state, received, [Stream(client_batches(c, 3), "cuda") for c in range(3)], lr=1e-2, local_steps=3,
        global_step=6)
    for c, result in enumerate(results):
        delta, v, loss, _ = one_client(small_vit().cuda(), algorithm, state, received, client_batches(c, 3), 1e-2, 3, 6)
        for name in delta:
            torch.testing.assert_close(result.update.delta[name], delta[name], rtol=1e-9, atol=1e-12)
        for name in v:
            torch.testing.assert_close(result.update.arrays["v"][name], v[name], rtol=1e-9, atol=1e-15)
        assert result.loss == pytest.approx(loss, rel=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_float32_vit_at_vit_tiny_shapes():
    """ViT-Tiny's attention shapes (65 tokens, 3 heads of 64) in float32 on the GPU, where SDPA
    would pick its memory-efficient kernel, whose backward under vmap fails ("LSE is not correctly
    aligned"; the float64 cases above take the math kernel): the batch runs, and its clients'
    losses and Δ follow each client alone within float32's rounding."""
    algorithm = dataclasses.replace(AlgorithmConfig(), name="fedact", lr=1e-3)
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=4, in_chans=3, num_classes=5, embed_dim=192, depth=1,
                              num_heads=3, qkv_bias=False).cuda()
    state = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
    batches = [[(images.float(), labels) for images, labels in client_batches(c, 2, size=32)] for c in range(2)]
    results = ClientBatch(model, algorithm, 2, classification_loss).train_round(
        state, {}, [Stream(b, "cuda") for b in batches], lr=1e-3, local_steps=2, global_step=0)
    for result, own in zip(results, batches):
        delta, _, loss, _ = one_client(copy.deepcopy(model), algorithm, state, {}, own, 1e-3, 2, 0)
        assert result.loss == pytest.approx(loss, rel=1e-4)
        flat = torch.cat([t.reshape(-1) for t in result.update.delta.values()])
        reference = torch.cat([delta[n].reshape(-1) for n in result.update.delta])
        off = (flat - reference).abs() > 1e-3 * reference.abs().max()
        assert off.float().mean() < 0.01


def test_a_second_round_starts_afresh():
    """Nothing of round r (m, v, Delta_G, the rows, the probes' pairs) leaks into round r + 1:
    a round with the server's arrays, then one without (v_bar and Delta_G zeros), each as its
    clients alone take it."""
    algorithm = dataclasses.replace(AlgorithmConfig(), name="fedact", lr=1e-2)
    model = small_vit()
    state = {n: t.clone() for n, t in model.state_dict().items()}
    batch = ClientBatch(model, algorithm, 2, classification_loss, trust_every=1, top_p=TOP_P)
    for received, offset, global_step in ((server_arrays(model, 3), 5, 0), ({}, 0, 2)):
        results = batch.train_round(state, received, [Stream(client_batches(c + offset, 2)) for c in range(2)],
                                    lr=1e-2, local_steps=2, global_step=global_step)
        for c, result in enumerate(results):
            delta, v, loss, diagnostics = one_client(small_vit(), algorithm, state, received,
                                                     client_batches(c + offset, 2), 1e-2, 2, global_step,
                                                     trust_every=1)
            for name in delta:
                torch.testing.assert_close(result.update.delta[name], delta[name], rtol=1e-9, atol=1e-12)
            for name in v:
                torch.testing.assert_close(result.update.arrays["v"][name], v[name], rtol=1e-9, atol=1e-15)
            assert result.loss == pytest.approx(loss, rel=1e-12)
            assert result.diagnostics == pytest.approx(diagnostics, rel=1e-9)


def test_bf16_autocast_within_its_rounding():
    """precision=bf16: the forward under bfloat16 autocast, as a client's. FedAdamW (no top-k, so
    no coordinate changes sides), float32: each client's batched Delta is as far from its Delta
    alone under bf16 as bf16 puts that from float32's (a few %: Adam's first steps divide by
    |g|), where float32 batched and alone agree to 1e-5."""
    algorithm = dataclasses.replace(AlgorithmConfig(), name="fedadamw", trust_signal="none", lr=1e-2)
    model = small_vit().float()
    state = {n: t.clone() for n, t in model.state_dict().items()}
    batches = [[(images.float(), labels) for images, labels in client_batches(c, 2)] for c in range(2)]
    rounds = {precision: ClientBatch(model, algorithm, 2, classification_loss, precision=precision).train_round(
        state, {}, [Stream(b) for b in batches], lr=1e-2, local_steps=2, global_step=0)
        for precision in ("bf16", "fp32")}
    for c in range(2):
        alone = {precision: one_client(small_vit().float(), algorithm, state, {}, batches[c], 1e-2, 2, 0,
                                       precision=precision) for precision in ("bf16", "fp32")}

        def flat(delta):
            return torch.cat([delta[n].reshape(-1) for n in sorted(delta)])

        def gap(a, b):
            return float((flat(a) - flat(b)).norm() / flat(b).norm())

        bf16_effect = gap(alone["fp32"][0], alone["bf16"][0])
        assert bf16_effect > 1e-3  # autocast changed the step
        assert gap(rounds["bf16"][c].update.delta, alone["bf16"][0]) < 3 * bf16_effect
        assert gap(rounds["fp32"][c].update.delta, alone["fp32"][0]) < 1e-5
        assert rounds["bf16"][c].loss == pytest.approx(alone["bf16"][2], rel=1e-3)


def small_cnn() -> torch.nn.Module:
    """A convolution with BatchNorm, float64: running statistics the compiled forward writes. No
    convolution bias: BatchNorm removes it, so its gradient is 0 in exact arithmetic and its
    scores rounding noise (as the key bias's, small_vit)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, bias=False), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 5)).double()


def compiled_against_eager(model, mode: str, device: str = "cpu") -> None:
    """Two rounds of 2 clients x 3 steps with ``compile_mode=mode`` on ``device``, each client's
    reply, loss and examples as the eager batch's (float64, to 1e-9); one graph compiled, none
    again in the second round."""
    algorithm = dataclasses.replace(AlgorithmConfig(), name="fedact", lr=1e-2)
    model = model.to(device)
    state = {n: t.detach().cpu().clone() for n, t in model.state_dict().items()}
    batches = {mode: ClientBatch(model, algorithm, 2, classification_loss, compile_mode=mode)
               for mode in ("none", mode)}
    graphs = counters["stats"]["unique_graphs"]
    for server_round, received in ((1, {}), (2, server_arrays(model, 7))):
        rounds = {name: batch.train_round(state, received, [Stream(client_batches(c + server_round, 3), device)
                                                            for c in range(2)],
                                          lr=1e-2, local_steps=3, global_step=3 * (server_round - 1))
                  for name, batch in batches.items()}
        assert counters["stats"]["unique_graphs"] == graphs + 1  # compiled once, at the first step
        for eager, compiled in zip(rounds["none"], rounds[mode]):
            for name in eager.update.delta:
                torch.testing.assert_close(compiled.update.delta[name], eager.update.delta[name], rtol=1e-9,
                                           atol=1e-12)
            for name in eager.update.arrays["v"]:
                torch.testing.assert_close(compiled.update.arrays["v"][name], eager.update.arrays["v"][name],
                                           rtol=1e-9, atol=1e-15)
            assert compiled.loss == pytest.approx(eager.loss, rel=1e-12)
            assert compiled.update.num_examples == eager.update.num_examples == 3 * BATCH


@pytest.mark.parametrize("model", [small_vit, small_cnn])
def test_compiled_losses_equal_the_eager_ones(model):
    """compile_mode="default" (inductor) on the CPU: the ViT, and BatchNorm's statistics written
    by the compiled forward (compiled once each: ~20 s on a 2-vCPU VM)."""
    compiled_against_eager(model(), "default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", [small_vit, small_cnn])
def test_cuda_graphs_equal_the_eager_batch(model):
    """compile_mode="reduce-overhead" on the GPU: CUDA graphs over the clients' loss, with the
    leaves and buffers as static inputs written in place between replays, and no graph skipped."""
    skips = counters["inductor"]["cudagraph_skips"]
    compiled_against_eager(model(), "reduce-overhead", "cuda")
    assert counters["inductor"]["cudagraph_skips"] == skips


def test_refuses_what_it_cannot_batch():
    vit = small_vit()
    with pytest.raises(ValueError, match="FedACT family.*fedavg"):
        ClientBatch(vit, dataclasses.replace(AlgorithmConfig(), name="fedavg"), 2, classification_loss)
    with pytest.raises(ValueError, match="Invalid clients: 0"):
        ClientBatch(vit, AlgorithmConfig(), 0, classification_loss)
    with pytest.raises(ValueError, match="Invalid precision: 'fp16'"):
        ClientBatch(vit, AlgorithmConfig(), 2, classification_loss, precision="fp16")
    with pytest.raises(ValueError, match="Invalid compile_mode: 'fast'"):
        ClientBatch(vit, AlgorithmConfig(), 2, classification_loss, compile_mode="fast")
    frozen = small_vit().requires_grad_(False)
    with pytest.raises(ValueError, match="trainable parameters; this one has none"):
        ClientBatch(frozen, AlgorithmConfig(), 2, classification_loss)
    batch = ClientBatch(vit, AlgorithmConfig(), 2, classification_loss)
    state = vit.state_dict()
    with pytest.raises(ValueError, match="got 1 clients' batches for a ClientBatch of 2"):
        batch.train_round(state, {}, [Stream([])], lr=1e-3, local_steps=1, global_step=0)
    with pytest.raises(ValueError, match="Invalid local_steps: 0"):
        batch.train_round(state, {}, [Stream([]), Stream([])], lr=1e-3, local_steps=0, global_step=0)
    with pytest.raises(ValueError, match="lacks 1 of the model's trainable tensors.*head.bias"):
        batch.train_round({n: t for n, t in state.items() if n != "head.bias"}, {}, [Stream([]), Stream([])],
                          lr=1e-3, local_steps=1, global_step=0)


def test_refuses_a_parameter_outside_the_loss_and_a_random_layer():
    """Either would make a client's step differ from the client's alone without a word: an unused
    parameter counts in d here, and vmap draws dropout's randomness otherwise."""
    unused = small_vit()
    unused.spare = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    batch = ClientBatch(unused, AlgorithmConfig(), 2, classification_loss)
    with pytest.raises(ValueError, match=r"1 got no gradient, e.g. \['spare'\]"):
        batch.train_round(unused.state_dict(), {}, [Stream(client_batches(c, 1)) for c in range(2)], lr=1e-3,
                          local_steps=1, global_step=0)
    torch.manual_seed(0)
    dropout = VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=5, embed_dim=12, depth=1,
                                num_heads=2, qkv_bias=False, drop_rate=0.1).double()
    batch = ClientBatch(dropout, AlgorithmConfig(), 2, classification_loss)
    with pytest.raises(ValueError, match="without random layers"):
        batch.train_round(dropout.state_dict(), {}, [Stream(client_batches(c, 1)) for c in range(2)], lr=1e-3,
                          local_steps=1, global_step=0)
