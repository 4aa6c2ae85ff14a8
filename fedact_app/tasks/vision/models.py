"""The vision models, built by name from ``conf/model/*.yaml``.

:func:`build_model` looks the name up in :data:`MODELS` and calls its builder with the dataset's
image size, channels and number of classes plus the YAML ``kwargs`` (each builder declares its
allowed kwargs and their defaults; an unknown one is an error naming the allowed ones). Weights
are always freshly initialized: no pretrained weights are ever downloaded.

- ``cnn_small`` (plain torch): two 3x3 conv blocks (conv-ReLU, widths ``width`` and
  ``2*width``), each followed by a 2x2 max-pool while the feature map is at least 4 px, then
  global average pooling and a linear head. ~20k parameters at width 32; for 8x8 digits and
  28/32 px smoke runs on CPU.
- ``vit_tiny``: timm ``VisionTransformer`` as in the reference FedAdamW code: patch 4, width 192,
  depth 6, 3 heads, MLP ratio 4 (2.7 M parameters for 32 px, 100 classes). ``image_size`` must
  be a multiple of ``patch_size``.
- ``swin_lite`` (the seed does not define it; our choice): timm ``SwinTransformer`` with patch 2,
  window 4, embed dim 48, depths (2, 2, 2, 2), heads (3, 6, 12, 24), MLP ratio 4: Swin-T's
  layout at half width and one block pair per stage. 32 px inputs give 16x16 tokens and stages at
  16, 8, 4, 2 tokens a side (windows shrink to the feature map where it is smaller, as timm does);
  64 px (Tiny-ImageNet) gives 32, 16, 8, 4. 5.15 M parameters for 32 px and 100 classes
  (5.11 M for 10 classes, 5.19 M for 64 px / 200 classes).
- ``resnet18``: timm ``resnet18``; with ``cifar_stem: true`` (the default) the 7x7 stride-2 stem
  conv becomes a 3x3 stride-1 conv (padding 1, no bias) and the stem max-pool is removed, as is
  usual for 32 px CIFAR images (11.2 M parameters).

Stochastic depth (``drop_path_rate``) is 0 for the transformers unless set in ``kwargs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from fedact_app.compat import ensure_torchvision_ops
from fedact_app.config import DatasetConfig, ModelConfig


@dataclass(frozen=True)
class _Builder:
    """A model builder and its allowed kwargs with their defaults."""

    build: Callable[..., nn.Module]
    defaults: dict[str, Any]


def build_model(model: ModelConfig, dataset: DatasetConfig) -> nn.Module:
    """A freshly initialized ``model.name`` for ``dataset``'s image size, channels and classes."""
    if model.name not in MODELS:
        raise ValueError(f"Unknown model {model.name!r}; known models: {', '.join(MODELS)}")
    builder = MODELS[model.name]
    unknown = sorted(set(model.kwargs) - set(builder.defaults))
    if unknown:
        raise ValueError(
            f"Unknown model.kwargs {unknown} for model {model.name!r}; allowed: {', '.join(builder.defaults)}"
        )
    kwargs = {**builder.defaults, **model.kwargs}
    return builder.build(
        image_size=dataset.image_size, channels=dataset.channels, num_classes=dataset.num_classes, **kwargs
    )


# ----------------------------------------------------------------------------------------------
# cnn_small


class SmallCNN(nn.Module):
    """conv3x3-ReLU(-maxpool) -> conv3x3-ReLU(-maxpool) -> global average pool -> linear."""

    def __init__(self, image_size: int, channels: int, num_classes: int, width: int = 32):
        super().__init__()
        layers: list[nn.Module] = []
        size, in_ch = image_size, channels
        for out_ch in (width, 2 * width):
            layers += [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.ReLU(inplace=True)]
            if size >= 4:  # pool while the map stays at least 2 px a side
                layers.append(nn.MaxPool2d(2))
                size //= 2
            in_ch = out_ch
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_ch, num_classes)

    def forward(self, x):
        return self.head(self.pool(self.features(x)).flatten(1))


def _cnn_small(image_size: int, channels: int, num_classes: int, width: int) -> nn.Module:
    if width < 1:
        raise ValueError(f"cnn_small: width must be >= 1, got {width}")
    return SmallCNN(image_size, channels, num_classes, width=int(width))


# ----------------------------------------------------------------------------------------------
# vit_tiny


def _vit_tiny(image_size: int, channels: int, num_classes: int, patch_size: int, embed_dim: int,
              depth: int, num_heads: int, mlp_ratio: float, drop_path_rate: float) -> nn.Module:
    _check_patch("vit_tiny", image_size, patch_size)
    if embed_dim % num_heads:
        raise ValueError(f"vit_tiny: embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
    return _timm_model(
        "vit_tiny_patch16_224", img_size=image_size, patch_size=patch_size,
        embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
        in_chans=channels, num_classes=num_classes, drop_path_rate=drop_path_rate,
    )


# ----------------------------------------------------------------------------------------------
# swin_lite


def _swin_lite(image_size: int, channels: int, num_classes: int, patch_size: int, window_size: int,
               embed_dim: int, depths: list[int], num_heads: list[int], mlp_ratio: float,
               drop_path_rate: float) -> nn.Module:
    _check_patch("swin_lite", image_size, patch_size)
    if len(depths) != len(num_heads):
        raise ValueError(f"swin_lite: depths {list(depths)} and num_heads {list(num_heads)} need one entry per stage")
    return _timm_model(
        "swin_tiny_patch4_window7_224", img_size=image_size, patch_size=patch_size,
        window_size=window_size, embed_dim=embed_dim, depths=tuple(depths), num_heads=tuple(num_heads),
        mlp_ratio=mlp_ratio, in_chans=channels, num_classes=num_classes, drop_path_rate=drop_path_rate,
    )


# ----------------------------------------------------------------------------------------------
# resnet18


def _resnet18(image_size: int, channels: int, num_classes: int, cifar_stem: bool) -> nn.Module:
    model = _timm_model("resnet18", in_chans=channels, num_classes=num_classes)
    if cifar_stem:
        model.conv1 = nn.Conv2d(channels, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as timm's init
        model.maxpool = nn.Identity()
    return model


def _timm_model(name: str, **kwargs: Any) -> nn.Module:
    """``timm.create_model(name, pretrained=False, **kwargs)``. timm is imported here, not with
    this module: its import takes about 1.5 s, which a ClientApp that builds ``cnn_small``
    would otherwise pay in every process (in a deployment, Flower 1.41 starts one per message)."""
    ensure_torchvision_ops()  # before timm imports torchvision (CPU torch + CUDA torchvision)
    import timm

    return timm.create_model(name, pretrained=False, **kwargs)


def _check_patch(name: str, image_size: int, patch_size: int) -> None:
    """The image must split into whole patches."""
    if patch_size < 1 or image_size % patch_size:
        raise ValueError(
            f"{name}: dataset.image_size={image_size} is not a multiple of patch_size={patch_size}; "
            "choose a patch size that divides the image size (model.kwargs.patch_size)"
        )


MODELS: dict[str, _Builder] = {
    "cnn_small": _Builder(_cnn_small, {"width": 32}),
    "vit_tiny": _Builder(_vit_tiny, {"patch_size": 4, "embed_dim": 192, "depth": 6, "num_heads": 3,
                                     "mlp_ratio": 4.0, "drop_path_rate": 0.0}),
    "swin_lite": _Builder(_swin_lite, {"patch_size": 2, "window_size": 4, "embed_dim": 48,
                                       "depths": [2, 2, 2, 2], "num_heads": [3, 6, 12, 24],
                                       "mlp_ratio": 4.0, "drop_path_rate": 0.0}),
    "resnet18": _Builder(_resnet18, {"cifar_stem": True}),
}
