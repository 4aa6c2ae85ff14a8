"""`overrides='dataset=cifar100 model=vit_tiny partition.alpha=0.1'` builds the seed's setting and,
with no hub access, stops at the dataset with a message naming the hub id and the way out."""

import time

import pytest

from fedact_app.config import compose
from fedact_app.tasks.vision.data import load_test
from fedact_app.tasks.vision.splits import DatasetUnavailableError
from fedact_app.tasks.vision.models import build_model


def test_paper_setting_builds_model_and_fails_only_at_the_hub(tmp_path):
    cfg = compose(f"dataset=cifar100 model=vit_tiny partition.alpha=0.1 data_dir={tmp_path}")
    model = build_model(cfg.model, cfg.dataset)
    assert model.num_classes == 100 and len(model.blocks) == 6 and model.embed_dim == 192
    assert model.patch_embed.patch_size == (4, 4) and model.patch_embed.img_size == (32, 32)
    assert 2.5e6 < sum(p.numel() for p in model.parameters()) < 3.0e6
    started = time.monotonic()
    with pytest.raises(DatasetUnavailableError) as err:
        load_test(cfg)
    assert time.monotonic() - started < 30
    assert "uoft-cs/cifar100" in str(err.value) and "dataset.path" in str(err.value)
