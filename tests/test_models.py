"""Tests of fedact_app/tasks/vision/models.py (and the torchvision shim in fedact_app/compat.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from fedact_app.config import DatasetConfig, ModelConfig
from fedact_app.tasks.vision.models import MODELS, build_model

ROOT = Path(__file__).resolve().parents[1]

DIGITS = DatasetConfig(name="digits", num_classes=10, image_size=8, channels=1, mean=[0.3], std=[0.4])
CIFAR10 = DatasetConfig(name="cifar10", num_classes=10, image_size=32, channels=3)
CIFAR100 = DatasetConfig(name="cifar100", num_classes=100, image_size=32, channels=3)
TINY = DatasetConfig(name="tiny_imagenet", num_classes=200, image_size=64, channels=3)


def yaml_model(name: str) -> ModelConfig:
    """The model as configured in conf/model/<name>.yaml."""
    raw = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"))
    return ModelConfig(name=raw["name"], kwargs=raw.get("kwargs") or {})


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


CASES = [
    ("cnn_small", DIGITS), ("cnn_small", CIFAR10), ("cnn_small", CIFAR100),
    ("vit_tiny", DIGITS), ("vit_tiny", CIFAR10), ("vit_tiny", CIFAR100), ("vit_tiny", TINY),
    ("swin_lite", CIFAR10), ("swin_lite", CIFAR100), ("swin_lite", TINY),
    ("resnet18", DIGITS), ("resnet18", CIFAR10), ("resnet18", TINY),
]


@pytest.mark.parametrize("name,dataset", CASES, ids=[f"{m}-{d.name}" for m, d in CASES])
def test_models_build_and_give_logits(name, dataset):
    torch.manual_seed(0)
    model = build_model(yaml_model(name), dataset)
    x = torch.randn(2, dataset.channels, dataset.image_size, dataset.image_size)
    with torch.no_grad():
        logits = model.eval()(x)
    assert logits.shape == (2, dataset.num_classes)
    assert torch.isfinite(logits).all()


def test_every_registered_model_has_a_yaml_that_agrees_with_its_defaults():
    for name, builder in MODELS.items():
        configured = yaml_model(name)
        assert configured.name == name
        assert configured.kwargs == {k: builder.defaults[k] for k in configured.kwargs}


def test_vit_tiny_is_the_reference_shape():
    model = build_model(yaml_model("vit_tiny"), CIFAR100)
    assert len(model.blocks) == 6 and model.embed_dim == 192
    assert model.blocks[0].attn.num_heads == 3
    assert model.patch_embed.patch_size == (4, 4) and model.patch_embed.grid_size == (8, 8)
    assert model.blocks[0].mlp.fc1.out_features == 4 * 192


def test_vit_patch_must_divide_the_image():
    with pytest.raises(ValueError, match="image_size=28.*patch_size=5"):
        build_model(ModelConfig(name="vit_tiny", kwargs={"patch_size": 5}), DatasetConfig(image_size=28, channels=1,
                                                                                            mean=[0.5], std=[0.5]))


def test_resnet18_has_the_cifar_stem():
    model = build_model(yaml_model("resnet18"), CIFAR10)
    conv = model.conv1
    assert conv.kernel_size == (3, 3) and conv.stride == (1, 1) and conv.padding == (1, 1) and conv.bias is None
    assert isinstance(model.maxpool, nn.Identity)
    plain = build_model(ModelConfig(name="resnet18", kwargs={"cifar_stem": False}), CIFAR10)
    assert plain.conv1.kernel_size == (7, 7) and isinstance(plain.maxpool, nn.MaxPool2d)


def test_swin_lite_has_about_five_million_parameters():
    count = num_params(build_model(yaml_model("swin_lite"), CIFAR100))
    assert 3.5e6 <= count <= 6.5e6


def test_unknown_kwarg_names_it_and_the_allowed_ones():
    with pytest.raises(ValueError, match=r"\['depthh'\].*vit_tiny.*patch_size, embed_dim, depth"):
        build_model(ModelConfig(name="vit_tiny", kwargs={"depthh": 3}), CIFAR10)


def test_cnn_small_width():
    model = build_model(ModelConfig(name="cnn_small", kwargs={"width": 4}), DIGITS)
    assert model.head.in_features == 8
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == 2


def test_timm_imports_after_ensure_torchvision_ops():
    code = ("from fedact_app.compat import ensure_torchvision_ops as e; e(); e(); "
            "import torchvision, timm; import torchvision.transforms.v2; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
