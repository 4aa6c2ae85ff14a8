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


def one_client(model, algorithm, state, received, batches, lr, steps, global_step, trust_every=0):
    """The reference: one client's round with its own FedACTAdamW, as ClientTrainer takes it,
    and its TrustProbe's summary."""
    model.load_state_dict(state)
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
    batch = ClientBatch(model, algorithm, clients, classification_loss, trust_every=2, top_p=TOP_P)
    results = batch.train_round(state, received, [Stream(client_batches(c, steps)) for c in range(clients)],
                                lr=lr, local_steps=steps, global_step=6)
    assert len(results) == clients
    for c, result in enumerate(results):
        delta, v, loss, diagnostics = one_client(small_vit(), algorithm, state, received, client_batches(c, steps),
                                                 lr, steps, 6, trust_every=2)
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
    results = ClientBatch(model, algorithm, 2, classification_loss).train_round(
        state, received, [Stream(client_batches(c, 2, 16)) for c in range(2)], lr=1e-2, local_steps=2,
        global_step=4)
    for c, result in enumerate(results):
        delta, v, _, _ = one_client(copy.deepcopy(model), algorithm, state, received, client_batches(c, 2, 16), 1e-2,
                                 2, 4)
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


def test_a_second_round_starts_afresh():
    """The state of round r (m, the rows) does not leak into round r + 1."""
    algorithm = dataclasses.replace(AlgorithmConfig(), name="fedact", lr=1e-2)
    model = small_vit()
    state = {n: t.clone() for n, t in model.state_dict().items()}
    batch = ClientBatch(model, algorithm, 2, classification_loss)
    first = batch.train_round(state, {}, [Stream(client_batches(c + 5, 2)) for c in range(2)],
                              lr=1e-2, local_steps=2, global_step=0)
    received = server_arrays(model, 3)
    second = batch.train_round(state, received, [Stream(client_batches(c, 2)) for c in range(2)],
                               lr=1e-2, local_steps=2, global_step=2)
    assert first[0].loss != second[0].loss
    for c in range(2):
        delta, _, _, _ = one_client(small_vit(), algorithm, state, received, client_batches(c, 2), 1e-2, 2, 2)
        for name in delta:
            torch.testing.assert_close(second[c].update.delta[name], delta[name], rtol=1e-9, atol=1e-12)


def test_refuses_what_it_cannot_batch():
    vit = small_vit()
    with pytest.raises(ValueError, match="FedACT family.*fedavg"):
        ClientBatch(vit, dataclasses.replace(AlgorithmConfig(), name="fedavg"), 2, classification_loss)
    with pytest.raises(ValueError, match="Invalid clients: 0"):
        ClientBatch(vit, AlgorithmConfig(), 0, classification_loss)
    batch = ClientBatch(vit, AlgorithmConfig(), 2, classification_loss)
    with pytest.raises(ValueError, match="got 1 clients' batches for a ClientBatch of 2"):
        batch.train_round(vit.state_dict(), {}, [Stream([])], lr=1e-3, local_steps=1, global_step=0)
