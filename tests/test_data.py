"""Tests of the vision data (fedact_app/tasks/vision/: splits, partition, tensors, batches, data):
sources, local layouts of the hub datasets, partitions, batches.

The hub datasets cannot be downloaded here; their loading code runs on locally made parquet files
and image folders with the hub layouts' exact column and split names.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import shutil
import time
import tracemalloc
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

import datasets
from fedact_app.tasks.vision import cache, data, decoded, partition, splits
from fedact_app.tasks.vision.batches import BatchStream, _same_device, test_batches
from fedact_app.tasks.vision import tensors as image_tensors
from fedact_app.tasks.vision.tensors import ImageTensors, to_image_tensors
from fedact_app.train import batch_generator
from fedact_app.config import Config, DatasetConfig, PartitionConfig

RGB_STATS = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}


@pytest.fixture(autouse=True)
def _fresh_caches():
    data.clear_caches()
    yield
    data.clear_caches()


def digits_cfg() -> DatasetConfig:
    return DatasetConfig(name="digits", num_classes=10, image_size=8, channels=1, mean=[0.3053], std=[0.376],
                         augment=False)


def synthetic_cfg(**kw) -> DatasetConfig:
    base = dict(name="synthetic", num_classes=4, image_size=8, channels=1, mean=[0.0], std=[1.0],
                augment=False, num_train=40, num_test=12)
    return DatasetConfig(**{**base, **kw})


def pil_images(n: int, size: int, mode: str = "RGB", seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    shape = (size, size, 3) if mode == "RGB" else (size, size)
    return [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode) for _ in range(n)]


def write_parquet(path, columns: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(columns).to_parquet(str(path))


def fmnist_like(root, seed: int = 0):
    """A Fashion-MNIST-like parquet folder of 40x40 grayscale images (read at 28x28): 30 training
    and 6 test images; its DatasetConfig."""
    write_parquet(root / "train.parquet", {"image": pil_images(30, 40, mode="L", seed=seed),
                                           "label": [i % 10 for i in range(30)]})
    write_parquet(root / "test.parquet", {"image": pil_images(6, 40, mode="L", seed=seed + 1),
                                          "label": [5, 4, 3, 2, 1, 0]})
    return DatasetConfig(name="fashion_mnist", path=str(root), image_size=28, channels=1, mean=[0.286],
                         std=[0.353], augment=False)


def fmnist_like_pixels(n: int, seed: int) -> np.ndarray:
    """The uint8 pixels (n, 28, 28) of :func:`fmnist_like`'s images with this seed, resized by PIL
    here (bilinear), as the data pipeline is to decode them."""
    return np.stack([np.asarray(image.resize((28, 28), Image.BILINEAR)) for image in pil_images(n, 40, "L", seed)])


def image_folder(root, n_train: int = 4, gray_file: bool = False):
    """An image folder of 3 classes of 32x32 RGB PNGs (``n_train`` training and 2 test images
    each), with one grayscale training image if ``gray_file``; its DatasetConfig."""
    for split, n in (("train", n_train), ("test", 2)):
        for c, class_name in enumerate(("airplane", "cat", "truck")):
            (root / split / class_name).mkdir(parents=True, exist_ok=True)
            for i, image in enumerate(pil_images(n, 32, seed=10 * c + (split == "test"))):
                image.save(root / split / class_name / f"{i}.png")
    if gray_file:
        pil_images(1, 32, mode="L", seed=99)[0].save(root / "train" / "cat" / "gray.png")
    return DatasetConfig(name="cifar10", path=str(root), **RGB_STATS)


# ----------------------------------------------------------------------------------------------
# digits and synthetic


def test_digits_split_sizes_determinism_and_range():
    train, test = splits.load_splits(digits_cfg(), seed=1)
    assert (len(train), len(test)) == (1437, 360)
    train2, test2 = splits.load_splits(digits_cfg(), seed=2)  # the split ignores the run seed
    assert np.array_equal(train.images, train2.images)
    assert np.array_equal(splits.labels_of(test), splits.labels_of(test2))
    images = train.images
    assert images.shape == (1437, 1, 8, 8) and images.min() == 0.0 and images.max() == 1.0
    test_counts = np.bincount(splits.labels_of(test), minlength=10)
    assert test_counts.min() >= 35  # stratified: every digit about 36 times


def test_digits_tensors_are_normalized():
    cfg = Config(dataset=digits_cfg())
    test = data.load_test(cfg)
    assert test.images.shape == (360, 1, 8, 8) and test.images.dtype == torch.float32
    assert test.labels.dtype == torch.int64
    assert abs(test.images.mean().item()) < 0.1 and abs(test.images.std().item() - 1.0) < 0.1
    assert data.load_test(cfg) is test  # cached per process


def test_synthetic_shape_and_determinism():
    cfg = synthetic_cfg(channels=3, mean=[0.0] * 3, std=[1.0] * 3, image_size=6)
    train, test = splits.load_splits(cfg, seed=7)
    assert (len(train), len(test)) == (40, 12)
    a = train
    assert a.images.shape == (40, 3, 6, 6) and 0.0 <= a.images.min() and a.images.max() <= 1.0
    assert np.array_equal(np.bincount(a.labels), [10, 10, 10, 10])
    b = splits.load_splits(cfg, seed=7)[0]
    c = splits.load_splits(cfg, seed=8)[0]
    assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)
    assert not np.array_equal(a.images, c.images)


def test_synthetic_images_are_the_per_row_formula():
    """Row i is clip(means[labels[i]] + normal(0, 0.3, (c, h, w)), 0, 1) in float32, its noise
    from the i-th child of the split's seed sequence; the labels a permutation from the split's
    own seed."""
    cfg = synthetic_cfg(channels=3, mean=[0.0] * 3, std=[1.0] * 3, image_size=5, num_train=40, num_test=12)
    train, test = splits._synthetic_splits(cfg, 11)
    means_seq, *split_seqs = np.random.SeedSequence(11).spawn(3)
    means = np.random.default_rng(means_seq).uniform(0.0, 1.0, (4, 3, 5, 5))
    for split, seq, n in zip((train, test), split_seqs, (40, 12)):
        labels = np.random.default_rng(seq).permutation(np.arange(n) % 4)
        children = seq.spawn(n)
        images = np.stack([np.clip(means[labels[i]] + np.random.default_rng(children[i]).normal(0.0, 0.3, (3, 5, 5)),
                                   0.0, 1.0) for i in range(n)]).astype(np.float32)
        assert np.array_equal(split.labels, labels) and np.array_equal(split.images, images)
        assert split.images.dtype == np.float32


def test_synthetic_images_are_drawn_only_where_they_are_read():
    """The ServerApp's check of the partitions reads the training labels and its evaluation the
    test split: neither draws the training images. A client's partition draws its own rows
    alone, the same images as the whole split's rows. Threads reading a split at once get one
    array, drawn once."""
    cfg = Config(dataset=synthetic_cfg(), num_clients=2, seed=5)

    def drawn() -> tuple[bool, bool]:
        train, test, _, _ = data._splits_cached(data._dataset_key(cfg.dataset), None, cfg.seed)
        return tuple(split.all_images._array is not None for split in (train, test))

    data.train_labels(cfg)
    assert drawn() == (False, False)
    data.load_test(cfg)
    assert drawn() == (False, True)
    data.clear_caches()
    client = data.load_client_train(cfg, 0, 2)
    assert drawn() == (False, False)
    train, _, _, _ = data._splits_cached(data._dataset_key(cfg.dataset), None, cfg.seed)
    rows = partition.partition_indices(train.labels, 2, cfg.partition, seed=cfg.seed)[0]
    assert 0 < len(rows) < len(train)
    alone = train.all_images.take(rows)  # drawn for these rows alone
    assert train.all_images._array is None
    assert np.array_equal(alone, train.all_images.array()[rows])
    torch.testing.assert_close(client.images, to_image_tensors(train.select(rows), cfg.dataset).images)

    fresh, _ = splits._synthetic_splits(synthetic_cfg(), 5)  # a draw that raised is tried again
    draw, draws = fresh.all_images._draw, []

    def fails_once(rows):
        draws.append(len(rows))
        if len(draws) == 1:
            raise RuntimeError("no memory")
        return draw(rows)

    fresh.all_images._draw = fails_once
    with pytest.raises(RuntimeError, match="no memory"):
        fresh.all_images.array()
    assert fresh.all_images._array is None  # nothing kept of the failed draw
    assert np.array_equal(fresh.all_images.array(), splits._synthetic_splits(synthetic_cfg(), 5)[0].images)
    assert len(draws) == 2

    calls = []
    lazy = splits.LazyImages(lambda rows: calls.append(1) or time.sleep(0.05) or np.zeros(len(rows)), 3)
    with ThreadPoolExecutor(4) as pool:
        arrays = list(pool.map(lambda _: lazy.array(), range(4)))
    assert len(calls) == 1 and all(a is arrays[0] for a in arrays)


# ----------------------------------------------------------------------------------------------
# partitions


def label_entropy(labels: np.ndarray, num_classes: int) -> float:
    counts = np.bincount(labels, minlength=num_classes)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


LABELS = np.repeat(np.arange(10), 200)  # sorted by class, as an image folder is


@pytest.mark.parametrize("part", [PartitionConfig(name="iid"), PartitionConfig(name="dirichlet", alpha=0.3)])
def test_partitions_deterministic_disjoint_covering(part, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, "")  # draw twice, not draw and read back
    first = partition.partition_indices(LABELS, 10, part, seed=42)
    data.clear_caches()
    again = partition.partition_indices(LABELS, 10, part, seed=42)
    other = partition.partition_indices(LABELS, 10, part, seed=43)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert any(not np.array_equal(a, b) for a, b in zip(first, other))
    merged = np.concatenate(first)
    assert np.array_equal(np.sort(merged), np.arange(LABELS.size))  # disjoint and covering
    assert all(len(p) > 0 for p in first)


def test_dirichlet_skew_grows_as_alpha_shrinks_and_iid_is_uniform():
    def mean_entropy(part):
        parts = partition.partition_indices(LABELS, 10, part, seed=42)
        return np.mean([label_entropy(LABELS[p], 10) for p in parts])

    skewed = mean_entropy(PartitionConfig(name="dirichlet", alpha=0.1))
    flat = mean_entropy(PartitionConfig(name="dirichlet", alpha=100.0))
    iid = mean_entropy(PartitionConfig(name="iid"))
    assert skewed < 0.6 * math.log(10) < 0.95 * math.log(10) < flat
    assert iid > 0.97 * math.log(10)
    sizes = [len(p) for p in partition.partition_indices(LABELS, 10, PartitionConfig(name="iid"), seed=42)]
    assert sizes == [200] * 10


def test_a_partition_is_kept_on_disk_and_read_back_by_the_next_process(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    part = PartitionConfig(name="dirichlet", alpha=0.3)
    drawn = partition.partition_indices(LABELS, 10, part, seed=42)
    (stored,) = (tmp_path / "partitions").iterdir()
    data.clear_caches()  # as a new process: only the file remains
    swapped = drawn[::-1]  # a different valid partition written into the file is what comes back
    np.savez(stored, rows=np.concatenate(swapped), sizes=np.array([p.size for p in swapped]))
    assert all(np.array_equal(a, b) for a, b in zip(partition.partition_indices(LABELS, 10, part, seed=42), swapped))
    for bad in (b"not a zip file", None):  # garbage; an archive that does not fit the labels
        if bad is None:
            np.savez(stored, rows=np.arange(5) + LABELS.size, sizes=np.array([5] + [0] * 9))
        else:
            stored.write_bytes(bad)
        data.clear_caches()
        assert all(np.array_equal(a, b) for a, b in zip(partition.partition_indices(LABELS, 10, part, seed=42), drawn))
    other_seed = partition.partition_indices(LABELS, 10, part, seed=43)
    assert len(list((tmp_path / "partitions").iterdir())) == 2  # one file per seed
    assert any(not np.array_equal(a, b) for a, b in zip(other_seed, drawn))


DIGITS_PROCESS = """
import sys
import numpy as np
from fedact_app.tasks.vision import splits
arrays = splits._digits_arrays()
np.savez(sys.argv[1], sklearn_imported=np.array("sklearn" in sys.modules), **arrays)
"""


def test_the_digits_split_is_kept_on_disk_and_read_back_without_scikit_learn(tmp_path):
    """A process with an empty cache computes the split with scikit-learn and stores it; the next
    process reads it without importing scikit-learn, and both give the split computed here."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images, labels = (digits.images / 16.0).astype(np.float32)[:, None], digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(images, labels, test_size=0.2, stratify=labels, random_state=0)
    env = {**os.environ, "FEDACT_CACHE_DIR": str(tmp_path / "cache")}
    for run, sklearn_expected in (("first", True), ("second", False)):
        out = tmp_path / f"{run}.npz"
        subprocess.run([sys.executable, "-c", DIGITS_PROCESS, str(out)], env=env, check=True)
        with np.load(out) as got:
            assert bool(got["sklearn_imported"]) is sklearn_expected, run
            for name, want in (("x_train", x_tr), ("y_train", y_tr), ("x_test", x_te), ("y_test", y_te)):
                assert got[name].dtype == want.dtype and np.array_equal(got[name], want), (run, name)
    (stored,) = (tmp_path / "cache" / "digits").iterdir()
    stored.write_bytes(b"not a zip file")  # a damaged file is computed again and replaced
    subprocess.run([sys.executable, "-c", DIGITS_PROCESS, str(tmp_path / "third.npz")], env=env, check=True)
    with np.load(tmp_path / "third.npz") as got:
        assert bool(got["sklearn_imported"]) and np.array_equal(got["x_test"], x_te)
    with np.load(stored) as rewritten:
        assert np.array_equal(rewritten["y_train"], y_tr)


DIGITS_RUN_PROCESS = """
import json, sys
from fedact_app.client_trainer import ClientTrainer
from fedact_app.config import compose
from fedact_app.server_app import CentralEvaluator, initial_model
cfg = compose("num_clients=3 local_steps=2 partition.alpha=0.5 device=cpu")
task, model, state, _ = initial_model(cfg)
CentralEvaluator(cfg, task, model)(cfg.num_rounds, state)
ClientTrainer(cfg).train_round(state, {}, partition_id=1, num_partitions=3, server_round=1, lr=1e-3,
                               local_steps=2, global_step=0)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & {"datasets", "pandas", "pyarrow"})))
"""


def test_a_digits_run_reads_its_data_without_importing_hugging_face_datasets(tmp_path):
    """``digits`` and ``synthetic`` are arrays (``splits.ArraySplit``): a process that reads them
    and their cached partition (a ServerApp's task and evaluation, a client's round) imports
    neither ``datasets`` nor pandas or pyarrow, about 1 CPU-second each Flower process saves. The
    first process draws the partition with flwr-datasets, which does import them."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "FEDACT_CACHE_DIR": str(tmp_path / "cache")}
    imported = [json.loads(subprocess.run([sys.executable, "-c", DIGITS_RUN_PROCESS], env=env, check=True,
                                          capture_output=True, text=True).stdout.splitlines()[-1])
                for _ in range(2)]
    assert "datasets" in imported[0]  # flwr-datasets drew the Dirichlet partition
    assert imported[1] == []


def test_an_array_split_selects_rows_in_the_order_given():
    split = splits.ArraySplit(np.arange(5 * 4, dtype=np.float32).reshape(5, 1, 2, 2), np.arange(5, dtype=np.int64))
    picked = split.select([3, 0, 3])
    assert len(picked) == 3 and picked.labels.tolist() == [3, 0, 3]
    assert np.array_equal(picked.images[1], split.images[0]) and splits.labels_of(picked) is picked.labels
    assert picked.all_images is split.all_images  # no image copied until they are read
    again = picked.select([2, 1])  # a selection of a selection: rows 3 and 0 of the arrays
    assert again.labels.tolist() == [3, 0] and np.array_equal(again.images, split.images[[3, 0]])


def test_the_caches_are_off_with_an_empty_folder_name(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, "")
    monkeypatch.setenv("HOME", str(tmp_path))  # the default folder would be under here
    partition.partition_indices(LABELS, 10, PartitionConfig(name="iid"), seed=42)
    splits._digits_arrays()
    train, _ = decoded.decoded_splits(fmnist_like(tmp_path / "fmnist"), str(tmp_path / "hf"), 0)
    assert isinstance(train, datasets.Dataset)  # read by load_splits, decoded by each process
    assert not (tmp_path / ".cache" / "fedact").exists()  # (a first import of matplotlib writes .cache too)


def test_too_many_partitions_is_an_error():
    with pytest.raises(ValueError, match=r"10 examples.*num_partitions=11"):
        partition.partition_indices(np.arange(10) % 2, 11, PartitionConfig(name="iid"), seed=0)
    with pytest.raises(ValueError, match=r"10 examples.*num_partitions=11"):
        partition.partition_indices(np.arange(10) % 2, 11, PartitionConfig(name="dirichlet"), seed=0)


def test_client_train_decodes_only_its_partition():
    cfg = Config(dataset=digits_cfg(), partition=PartitionConfig(name="dirichlet", alpha=0.5))
    parts = [data.load_client_train(cfg, i, 4) for i in range(4)]
    assert sum(len(p) for p in parts) == 1437
    train_labels = splits.labels_of(splits.load_splits(digits_cfg())[0])
    rows = partition.partition_indices(train_labels, 4, cfg.partition, cfg.seed)
    for part, idx in zip(parts, rows):
        assert torch.equal(part.labels, torch.as_tensor(train_labels[idx]))
        assert part.images.shape == (len(idx), 1, 8, 8)
    assert data.load_client_train(cfg, 2, 4) is parts[2]  # cached per process
    with pytest.raises(ValueError, match="partition_id"):
        data.load_client_train(cfg, 4, 4)


# ----------------------------------------------------------------------------------------------
# hub layouts, made locally


def test_cifar10_like_parquet_folder(tmp_path):
    root = tmp_path / "cifar10"
    write_parquet(root / "train.parquet", {"img": pil_images(12, 32), "label": list(range(10)) + [0, 1]})
    write_parquet(root / "test.parquet", {"img": pil_images(5, 32, seed=1), "label": [9, 8, 7, 6, 5]})
    cfg = DatasetConfig(name="cifar10", hub_path="uoft-cs/cifar10", path=str(root), image_column="img",
                        **RGB_STATS)
    train, test = splits.load_splits(cfg, data_dir=str(tmp_path / "cache"))
    assert train.column_names == ["image", "label"] and (len(train), len(test)) == (12, 5)
    tensors = to_image_tensors(test, cfg)
    assert tensors.images.shape == (5, 3, 32, 32) and tensors.labels.tolist() == [9, 8, 7, 6, 5]
    raw = np.asarray(pil_images(5, 32, seed=1)[0], dtype=np.float32) / 255.0
    expected = (torch.from_numpy(raw).permute(2, 0, 1) - 0.5) / 0.25
    assert torch.allclose(tensors.images[0], expected, atol=1e-5)


def test_cifar10_like_single_file_and_split_pattern(tmp_path):
    write_parquet(tmp_path / "c10-train.parquet", {"img": pil_images(4, 32), "label": [0, 1, 2, 3]})
    write_parquet(tmp_path / "c10-test.parquet", {"img": pil_images(2, 32), "label": [4, 5]})
    for path in (tmp_path / "c10-train.parquet", tmp_path / "c10-{split}.parquet"):
        cfg = DatasetConfig(name="cifar10", path=str(path), image_column="img", **RGB_STATS)
        train, test = splits.load_splits(cfg, data_dir=str(tmp_path / "cache"))
        assert (len(train), len(test)) == (4, 2)


def test_cifar100_like_fine_label_in_split_folders(tmp_path):
    root = tmp_path / "cifar100"
    for split, n in (("train", 6), ("test", 3)):
        write_parquet(root / split / "part-0.parquet",
                      {"img": pil_images(n, 32), "fine_label": [99, 0, 50, 1, 2, 3][:n], "coarse_label": [19] * n})
    cfg = DatasetConfig(name="cifar100", path=str(root), image_column="img", label_column="fine_label",
                        num_classes=100, **RGB_STATS)
    train, test = splits.load_splits(cfg, data_dir=str(tmp_path / "cache"))
    assert train.column_names == ["image", "label"]
    assert train.with_format("numpy")[:]["label"].tolist() == [99, 0, 50, 1, 2, 3]


def test_tiny_imagenet_like_hub_layout_grayscale_to_rgb(tmp_path):
    root = tmp_path / "tiny-imagenet"
    train_images = pil_images(3, 64) + pil_images(1, 64, mode="L", seed=5)
    write_parquet(root / "data" / "train-00000-of-00001.parquet", {"image": train_images, "label": [0, 199, 7, 3]})
    write_parquet(root / "data" / "valid-00000-of-00001.parquet", {"image": pil_images(2, 64), "label": [1, 2]})
    cfg = DatasetConfig(name="tiny_imagenet", path=str(root), test_split="valid", num_classes=200,
                        image_size=64, **RGB_STATS)
    train, test = splits.load_splits(cfg, data_dir=str(tmp_path / "cache"))
    tensors = to_image_tensors(train, cfg)
    assert tensors.images.shape == (4, 3, 64, 64)
    gray = tensors.images[3]
    assert torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])  # L -> RGB copies the channel
    assert len(test) == 2


def test_images_of_another_size_are_resized(tmp_path):
    write_parquet(tmp_path / "train.parquet", {"image": pil_images(2, 40, mode="L"), "label": [0, 1]})
    write_parquet(tmp_path / "test.parquet", {"image": pil_images(1, 40, mode="L"), "label": [1]})
    cfg = DatasetConfig(name="fashion_mnist", path=str(tmp_path), image_size=28, channels=1, mean=[0.286],
                        std=[0.353])
    test = to_image_tensors(splits.load_splits(cfg, data_dir=str(tmp_path / "cache"))[1], cfg)
    assert test.images.shape == (1, 1, 28, 28)


def test_image_folder_layout(tmp_path):
    cfg = image_folder(tmp_path / "folder", n_train=3)
    train, test = splits.load_splits(cfg, data_dir=str(tmp_path / "cache"))
    assert (len(train), len(test)) == (9, 6)
    assert sorted(train.with_format("numpy")[:]["label"].tolist()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert to_image_tensors(test, cfg).images.shape == (6, 3, 32, 32)


# ----------------------------------------------------------------------------------------------
# local image files kept decoded on disk (decoded.py)


LOCAL_RUN_PROCESS = """
import sys
import numpy as np
from fedact_app.config import Config, DatasetConfig, PartitionConfig
from fedact_app.tasks.vision import data
dataset = DatasetConfig(name="fashion_mnist", path=sys.argv[2], image_size=28, channels=1, mean=[0.286],
                        std=[0.353], augment=False)
cfg = Config(dataset=dataset, partition=PartitionConfig(name="dirichlet", alpha=0.5), num_clients=3)
data.train_labels(cfg)  # the ServerApp's check of the partitions
client, test = data.load_client_train(cfg, 1, 3), data.load_test(cfg)
np.savez(sys.argv[1], datasets_imported=np.array("datasets" in sys.modules), client_images=client.images.numpy(),
         client_labels=client.labels.numpy(), test_images=test.images.numpy(), test_labels=test.labels.numpy())
"""


def run_local_process(tmp_path, name: str, cache_dir: str) -> dict[str, np.ndarray]:
    import subprocess
    import sys

    out = tmp_path / f"{name}.npz"
    subprocess.run([sys.executable, "-c", LOCAL_RUN_PROCESS, str(out), str(tmp_path / "fmnist")],
                   env={**os.environ, "FEDACT_CACHE_DIR": cache_dir}, check=True)
    with np.load(out) as got:
        return dict(got)


def test_local_image_files_are_decoded_once_and_read_back_without_datasets(tmp_path):
    """The first process decodes both splits whole and keeps the pixels on disk; the next process
    reads a client's partition and the test split from there without importing ``datasets``; the
    tensors of both are bit-identical to those of a process that decodes its rows itself (cache
    off), and the stored pixels are PIL's bilinear resize of the files' images."""
    fmnist_like(tmp_path / "fmnist")
    cache_dir = tmp_path / "cache"
    reference = run_local_process(tmp_path, "off", "")
    first = run_local_process(tmp_path, "first", str(cache_dir))
    second = run_local_process(tmp_path, "second", str(cache_dir))
    assert bool(reference["datasets_imported"]) and bool(first["datasets_imported"])
    assert not bool(second["datasets_imported"])
    for got in (first, second):
        for name in ("client_images", "client_labels", "test_images", "test_labels"):
            assert got[name].dtype == reference[name].dtype and np.array_equal(got[name], reference[name]), name
    (entry,) = [p for p in (cache_dir / "decoded").iterdir() if p.is_dir()]
    stored = np.load(entry / "test_images.npy")
    assert stored.dtype == np.uint8 and np.array_equal(stored[:, 0], fmnist_like_pixels(6, seed=1))
    assert np.load(entry / "test_labels.npy").tolist() == [5, 4, 3, 2, 1, 0]


def test_processes_missing_the_decoded_files_at_once_decode_them_once(tmp_path):
    """Two processes that start together on an empty cache: one decodes (importing ``datasets``)
    while the other waits for the lock, then reads its files."""
    import subprocess
    import sys

    cfg = fmnist_like(tmp_path / "fmnist")
    script = ("import sys; from fedact_app.config import DatasetConfig; from fedact_app.tasks.vision import decoded; "
              f"decoded.decoded_splits(DatasetConfig(**{dataclasses.asdict(cfg)!r}), None, 0); "
              "print('datasets' in sys.modules)")
    env = {**os.environ, "FEDACT_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate()[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sorted(out.split()[-1] for out in outputs) == ["False", "True"]


def all_tensors(cfg: Config) -> list[ImageTensors]:
    """Every client's partition, the test split and the validation rows, read afresh."""
    data.clear_caches()
    got = [data.load_client_train(cfg, p, cfg.num_clients) for p in range(cfg.num_clients)] + [data.load_test(cfg)]
    return got + ([data.load_validation(cfg)] if cfg.dataset.holdout_fraction > 0 else [])


@pytest.mark.parametrize("layout", ["parquet, grayscale resized, holdout", "image folder, grayscale file to RGB"])
def test_decoded_files_give_the_tensors_of_a_process_decoding_its_rows(layout, tmp_path, monkeypatch):
    """Every client's rows, the test split and the validation rows are bit-identical whether a
    process decodes them itself (cache off), decodes both splits whole into the cache, or reads
    them from it."""
    if layout.startswith("parquet"):
        dataset = dataclasses.replace(fmnist_like(tmp_path / "data"), holdout_fraction=0.2)
    else:
        dataset = image_folder(tmp_path / "data", gray_file=True)
    cfg = Config(dataset=dataset, partition=PartitionConfig(name="dirichlet", alpha=0.5), num_clients=3)
    monkeypatch.setenv(cache.CACHE_ENV, "")
    reference = all_tensors(cfg)
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    decoding = all_tensors(cfg)
    monkeypatch.setattr(decoded, "load_splits", None)  # the next pass reads the decoded files only
    reading = all_tensors(cfg)
    assert [p for p in (tmp_path / "cache" / "decoded").iterdir() if p.is_dir()]
    for got in (decoding, reading):
        assert len(got) == len(reference)
        for mine, theirs in zip(got, reference):
            assert torch.equal(mine.images, theirs.images) and torch.equal(mine.labels, theirs.labels)


def test_an_image_added_to_a_folder_is_decoded_again(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    cfg = image_folder(tmp_path / "folder")
    first = decoded.decoded_splits(cfg, None, 0)[0]
    assert isinstance(first, splits.ArraySplit) and len(first) == 12
    (entry,) = [p for p in (tmp_path / "cache" / "decoded").iterdir() if p.is_dir()]
    pil_images(1, 32, seed=5)[0].save(tmp_path / "folder" / "train" / "truck" / "new.png")
    train, _ = decoded.decoded_splits(cfg, None, 0)
    assert isinstance(train, splits.ArraySplit)
    assert len(train) == 13 and np.bincount(splits.labels_of(train)).tolist() == [4, 4, 5]
    (new_entry,) = [p for p in (tmp_path / "cache" / "decoded").iterdir() if p.is_dir()]
    assert new_entry != entry


def test_a_cache_folder_that_cannot_be_made_reads_the_files_as_they_are(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "a-file" / "cache"))
    with pytest.warns(RuntimeWarning, match="Decoded images of dataset.path=.* not kept on disk: the lock") as record:
        train, test = decoded.decoded_splits(fmnist_like(tmp_path / "fmnist"), None, 0)
    assert record[0].filename == __file__  # (the caller of decoded_splits)
    assert isinstance(train, datasets.Dataset) and (len(train), len(test)) == (30, 6)


def test_a_missing_column_is_the_same_error_every_time(tmp_path, monkeypatch):
    """Nothing is stored for a config that cannot be read, and the lock is released."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    cfg = dataclasses.replace(fmnist_like(tmp_path / "fmnist"), image_column="img")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"dataset.image_column='img' is not a column"):
            decoded.decoded_splits(cfg, None, 0)
    assert not [p for p in (tmp_path / "cache" / "decoded").iterdir() if p.is_dir()]


def test_decoded_files_are_made_again_when_the_data_changes_or_they_are_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    cfg = fmnist_like(tmp_path / "fmnist")
    first = np.array(decoded.decoded_splits(cfg, None, 0)[0].images)  # (a copy: the file is damaged below)
    (entry,) = [p for p in (tmp_path / "cache" / "decoded").iterdir() if p.is_dir()]
    for damage in (b"not a .npy file", None):  # garbage; an array of the wrong shape
        if damage is None:
            np.save(entry / "train_images.npy", np.zeros((30, 1, 8, 8), dtype=np.uint8))
        else:
            (entry / "train_images.npy").write_bytes(damage)
        assert np.array_equal(decoded.decoded_splits(cfg, None, 0)[0].images, first)  # (no mapping kept)
        assert np.array_equal(np.load(entry / "train_images.npy"), first)  # replaced
    fmnist_like(tmp_path / "fmnist", seed=7)  # new files in place of the old
    os.utime(tmp_path / "fmnist" / "train.parquet", ns=(1, 1))  # whatever the clock's resolution
    for killed in (entry, decoded._entry(cfg)[0]):  # writers killed while writing the old and the new state
        (tmp_path / "cache" / "decoded" / f"{killed.name}.123.4.partial").mkdir()
    changed = decoded.decoded_splits(cfg, None, 0)[0]
    assert np.array_equal(changed.images[:, 0], fmnist_like_pixels(30, seed=7))
    (new_entry,) = [p for p in (tmp_path / "cache" / "decoded").iterdir() if p.is_dir()]  # the old one removed
    assert new_entry != entry
    assert sorted(p.name for p in new_entry.parent.iterdir() if not p.name.endswith(".lock")) == [new_entry.name]


def test_labels_read_from_decoded_files_are_checked_against_num_classes(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    cfg = fmnist_like(tmp_path / "fmnist")
    decoded.decoded_splits(cfg, None, 0)
    with pytest.raises(ValueError, match=r"label 8, outside \[0, 8\)"):
        decoded.decoded_splits(dataclasses.replace(cfg, num_classes=8), None, 0)


def test_an_image_column_of_arrays_is_not_kept_decoded(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("test", 2)):
        write_parquet(tmp_path / "arrays" / f"{split}.parquet",
                      {"image": rng.random((n, 1, 4, 4), dtype=np.float32).tolist(), "label": list(range(n))})
    cfg = DatasetConfig(name="fashion_mnist", path=str(tmp_path / "arrays"), image_size=4, channels=1,
                        mean=[0.0], std=[1.0], augment=False)
    for process in ("first", "later"):
        train, test = decoded.decoded_splits(cfg, None, 0)
        assert isinstance(train, datasets.Dataset) and (len(train), len(test)) == (4, 2)
        monkeypatch.setattr(decoded, "exclusive", None)  # later ones find the note and take no lock
    assert not [p for p in (tmp_path / "cache" / "decoded").iterdir() if p.is_dir()]
    assert len(list((tmp_path / "cache" / "decoded").glob("*.arrays"))) == 1


def test_decoded_files_are_not_written_where_the_disk_lacks_the_room(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(path)._replace(free=20_000))
    cfg = fmnist_like(tmp_path / "fmnist")
    with pytest.warns(RuntimeWarning, match=r"not kept on disk: .* needs 0 MiB and .* has 0 MiB free") as record:
        train, _ = decoded.decoded_splits(cfg, None, 0)  # 36 x (784 + 8) bytes, and 1 GiB spare
    assert record[0].filename == __file__  # (the caller of decoded_splits)
    assert isinstance(train, datasets.Dataset)
    assert not [p for p in (tmp_path / "cache" / "decoded").iterdir() if p.is_dir()]
    assert_later_processes_read_the_files(cfg, monkeypatch)


def assert_later_processes_read_the_files(cfg: DatasetConfig, monkeypatch) -> None:
    """After a failed write, a note keeps later processes from decoding (and warning) again."""
    monkeypatch.setattr(decoded, "image_chunks", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train, _ = decoded.decoded_splits(cfg, None, 0)
    assert isinstance(train, datasets.Dataset) and len(train) == 30


def test_an_entry_that_cannot_be_written_is_noted_and_the_files_are_read_as_they_are(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(image_tensors, "CHUNK_ROWS", 4)
    cfg = fmnist_like(tmp_path / "fmnist")
    real_open, written = open, []

    class QuotaAfterTwoBlocks:  # the train pixels' file: the quota runs out at its third block
        def __init__(self, path, mode):
            self.file = real_open(path, mode)
            self.fileno = self.file.fileno  # (the lock file's flock)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            written.append(len(data))
            if len(written) == 4:  # the header, two blocks, then the third
                raise OSError(errno.EDQUOT, "Disk quota exceeded")
            return self.file.write(data)

    monkeypatch.setattr(cache, "open", QuotaAfterTwoBlocks, raising=False)
    warning = r"cannot be written \(\[Errno \d+\] Disk quota exceeded\).*delete .*\.unwritable"
    with pytest.warns(RuntimeWarning, match=warning) as record:
        train, test = decoded.decoded_splits(cfg, None, 0)
    assert record[0].filename == __file__  # (the caller of decoded_splits)
    assert isinstance(train, datasets.Dataset) and (len(train), len(test)) == (30, 6) and len(written) == 4
    assert [p.name for p in (tmp_path / "cache" / "decoded").iterdir() if p.is_dir()] == []  # no partial left
    expected = (fmnist_like_pixels(6, seed=1) / 255.0 - 0.286) / 0.353
    assert torch.allclose(to_image_tensors(test, cfg).images[:, 0], torch.from_numpy(expected).float(), atol=1e-5)
    monkeypatch.undo()
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    assert_later_processes_read_the_files(cfg, monkeypatch)


def test_an_image_that_cannot_be_decoded_fails_as_without_the_cache(tmp_path, monkeypatch):
    """PIL's error for a damaged file is an OSError, like a failed write's; it is raised as it is,
    with no note and nothing of the entry left."""
    from PIL import UnidentifiedImageError

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    cfg = image_folder(tmp_path / "images")
    (tmp_path / "images" / "train" / "cat" / "1.png").write_bytes(b"not a png")
    with pytest.raises(UnidentifiedImageError):
        decoded.decoded_splits(cfg, None, 0)
    assert not (tmp_path / "cache" / "decoded").exists() or [
        p.name for p in (tmp_path / "cache" / "decoded").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setenv(cache.CACHE_ENV, "")
    with pytest.raises(UnidentifiedImageError):  # (without the cache: the same error)
        to_image_tensors(decoded.decoded_splits(cfg, None, 0)[0], cfg)


def test_the_first_process_never_holds_a_whole_split_of_pixels(tmp_path, monkeypatch):
    """It decodes a block of rows at a time into the files (then maps them), so its memory does
    not grow with the data set (Tiny-ImageNet: 1.35 GB of pixels). Python's allocations, NumPy's
    included, traced while it decodes and reads back 3,000 images of 2.35 MB (blocks of 50 images;
    loading the files, Hugging Face datasets and Arrow, is done before): the code before, holding
    the decoded blocks and then their concatenation, peaked at twice that."""
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(image_tensors, "CHUNK_ROWS", 50)
    root = tmp_path / "many"
    write_parquet(root / "train.parquet", {"image": pil_images(3000, 28, mode="L", seed=3), "label": [1] * 3000})
    write_parquet(root / "test.parquet", {"image": pil_images(10, 28, mode="L", seed=4), "label": [2] * 10})
    cfg = DatasetConfig(name="fashion_mnist", path=str(root), image_size=28, channels=1, mean=[0.5], std=[0.5],
                        augment=False)
    loaded = splits.load_splits(cfg, None, 0)
    monkeypatch.setattr(decoded, "load_splits", lambda *args: loaded)
    tracemalloc.start()
    try:
        train, _ = decoded.decoded_splits(cfg, None, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(train, splits.ArraySplit) and train.images.shape == (3000, 1, 28, 28)
    assert np.array_equal(train.images[:, 0], np.stack([np.asarray(i) for i in pil_images(3000, 28, "L", 3)]))
    assert peak < 3000 * 28 * 28 / 2, f"{peak} bytes traced at the peak"


@pytest.mark.parametrize("dtype, shape, rows", [(np.int64, (3, 2), (2, 2, 0, 2)), (np.uint8, (1, 28, 28), (1024, 3)),
                                               (np.uint8, (3, 4, 4), ())])
def test_npy_rows_written_block_by_block_are_the_file_np_save_writes(tmp_path, dtype, shape, rows):
    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 200, (n, *shape)).astype(dtype) for n in rows]
    whole = np.concatenate([np.empty((0, *shape), dtype=dtype), *blocks])
    cache.write_npy_rows(tmp_path / "a.npy", dtype, whole.shape, iter(blocks))
    np.save(tmp_path / "b.npy", whole)
    assert (tmp_path / "a.npy").read_bytes() == (tmp_path / "b.npy").read_bytes()
    assert np.array_equal(np.load(tmp_path / "a.npy", mmap_mode="r"), whole)


def test_a_cache_folder_whose_filling_fails_leaves_nothing(tmp_path):
    def fill(folder, error):
        np.save(folder / "a.npy", np.zeros(3))
        raise error

    assert isinstance(cache.write_cache_folder(tmp_path / "e", lambda f: fill(f, OSError("full"))), OSError)
    with pytest.raises(ValueError, match="a bug"):
        cache.write_cache_folder(tmp_path / "e", lambda f: fill(f, ValueError("a bug")))
    assert list(tmp_path.iterdir()) == []
    assert cache.write_cache_folder(tmp_path / "e", lambda f: np.save(f / "a.npy", np.ones(2))) is None
    assert [p.name for p in tmp_path.iterdir()] == ["e"] and np.load(tmp_path / "e" / "a.npy").tolist() == [1, 1]


def test_npy_rows_refuse_blocks_that_do_not_make_up_the_array(tmp_path):
    block = np.zeros((2, 3), dtype=np.int64)
    for blocks, message in (([block], "2 rows written .* of 3"), ([block.astype(np.int32)], "int32"),
                            ([np.zeros((2, 4), dtype=np.int64)], r"\(2, 4\)"), ([block, block], "after 2 rows")):
        with pytest.raises(ValueError, match=message):
            cache.write_npy_rows(tmp_path / "a.npy", np.int64, (3, 3), blocks)


def test_processes_waiting_on_the_lock_find_the_note_of_a_failed_write(tmp_path, monkeypatch):
    """A process that waited while the first one failed to write reads the files as before: it
    does not decode the whole data set again."""
    import contextlib

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    cfg = fmnist_like(tmp_path / "fmnist")

    @contextlib.contextmanager
    def after_a_failed_write(path):  # the lock, taken once the first process has noted its failure
        path.parent.mkdir(parents=True, exist_ok=True)
        decoded._write_note(path, ".unwritable", "Disk quota exceeded")
        yield None

    monkeypatch.setattr(decoded, "exclusive", after_a_failed_write)
    monkeypatch.setattr(decoded, "image_chunks", None)
    train, _ = decoded.decoded_splits(cfg, None, 0)
    assert isinstance(train, datasets.Dataset) and len(train) == 30


def test_a_file_system_without_locks_reads_the_files_as_they_are(tmp_path, monkeypatch):
    import errno

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))

    flock = cache.fcntl.flock

    def refuse_blocking_locks(fd, operation):  # cache.exclusive's; datasets' own locks do not block
        if operation == cache.fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, "No locks available")
        return flock(fd, operation)

    monkeypatch.setattr(cache.fcntl, "flock", refuse_blocking_locks)
    with pytest.warns(RuntimeWarning, match=r"the lock .* cannot be taken: .*No locks available") as record:
        train, _ = decoded.decoded_splits(fmnist_like(tmp_path / "fmnist"), None, 0)
    assert record[0].filename == __file__  # (the caller of decoded_splits)
    assert isinstance(train, datasets.Dataset) and len(train) == 30


def test_hub_dataset_offline_fails_fast_with_a_helpful_message(tmp_path):
    cfg = DatasetConfig(name="cifar10", hub_path="uoft-cs/cifar10", image_column="img", **RGB_STATS)
    start = time.monotonic()
    with pytest.raises(splits.DatasetUnavailableError) as info:
        splits.load_splits(cfg, data_dir=str(tmp_path / "cache"))
    assert time.monotonic() - start < 30  # no network retries
    message = str(info.value)
    assert "uoft-cs/cifar10" in message and "dataset.path=" in message and "offline" in message
    assert "'img'" in message and "'label'" in message


def test_label_out_of_range_is_an_error(tmp_path):
    write_parquet(tmp_path / "train.parquet", {"img": pil_images(2, 8), "label": [0, 10]})
    write_parquet(tmp_path / "test.parquet", {"img": pil_images(1, 8), "label": [0]})
    cfg = DatasetConfig(name="cifar10", path=str(tmp_path), image_column="img", image_size=8, **RGB_STATS)
    with pytest.raises(ValueError, match=r"'label'.*\b10\b.*\[0, 10\)"):
        splits.load_splits(cfg, data_dir=str(tmp_path / "cache"))


def test_missing_column_and_bad_path_are_errors(tmp_path):
    write_parquet(tmp_path / "train.parquet", {"img": pil_images(2, 8), "label": [0, 1]})
    write_parquet(tmp_path / "test.parquet", {"img": pil_images(1, 8), "label": [0]})
    cfg = DatasetConfig(name="cifar100", path=str(tmp_path), image_column="img", label_column="fine_label",
                        num_classes=100, image_size=8, **RGB_STATS)
    with pytest.raises(ValueError, match="fine_label"):
        splits.load_splits(cfg, data_dir=str(tmp_path / "cache"))
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        splits.load_splits(DatasetConfig(name="cifar10", path=str(missing), **RGB_STATS))


# ----------------------------------------------------------------------------------------------
# batches


def indexed(n: int, size: int = 4) -> ImageTensors:
    """Images whose pixels all equal their row index, labels = row index."""
    images = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, size, size).contiguous()
    return ImageTensors(images, torch.arange(n))


def test_batch_stream_shapes_and_wraps_around_a_small_partition():
    stream = BatchStream(indexed(5), batch_size=12, augment=False, generator=batch_generator(0, 1, 0))
    images, labels = stream.next_batch()
    assert images.shape == (12, 1, 4, 4) and labels.shape == (12,)
    assert torch.equal(images[:, 0, 0, 0].long(), labels)  # images travel with their labels
    assert sorted(labels[:5].tolist()) == sorted(labels[5:10].tolist()) == [0, 1, 2, 3, 4]
    _, more = stream.next_batch()
    third_pass = torch.cat([labels[10:], more[:3]])
    assert sorted(third_pass.tolist()) == [0, 1, 2, 3, 4]


def test_batch_stream_reshuffles_every_pass_and_is_reproducible():
    def passes(seed):
        stream = BatchStream(indexed(20), 20, False, batch_generator(seed, 3, 7))
        return [stream.next_batch()[1].tolist() for _ in range(4)]

    first = passes(42)
    assert first == passes(42)
    assert first != passes(43)
    assert all(sorted(p) == list(range(20)) for p in first)
    assert len({tuple(p) for p in first}) == 4  # a new order each pass
    assert batch_generator(42, 3, 7).initial_seed() != batch_generator(42, 4, 7).initial_seed()


def test_augmentation_is_a_padded_crop_and_flip_of_each_sample():
    torch.manual_seed(0)
    n, size, pad = 6, 16, 2
    images = torch.randn(n, 3, size, size)
    plain = ImageTensors(images, torch.arange(n))
    stream = BatchStream(plain, n, augment=True, generator=batch_generator(1, 1, 1))
    assert stream.pad == pad
    out, labels = stream.next_batch()
    assert out.shape == images.shape
    assert not torch.equal(out, images[labels])
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))  # zero in normalized space
    for augmented, label in zip(out, labels):
        candidates = [
            crop.flip(-1) if flip else crop
            for top in range(2 * pad + 1) for left in range(2 * pad + 1) for flip in (False, True)
            for crop in [padded[label, :, top:top + size, left:left + size]]
        ]
        assert any(torch.equal(augmented, c) for c in candidates)


def test_no_augmentation_returns_the_rows_unchanged():
    images = torch.randn(8, 3, 16, 16)
    stream = BatchStream(ImageTensors(images, torch.arange(8)), 8, False, batch_generator(0, 0, 0))
    out, labels = stream.next_batch()
    assert torch.equal(out, images[labels])


def test_generator_device_must_match_the_data():
    same = _same_device
    assert same(torch.device("cuda"), torch.device("cuda:0")) and same(torch.device("cpu"), torch.device("cpu"))
    assert not same(torch.device("cpu"), torch.device("cuda:0"))
    assert not same(torch.device("cuda:1"), torch.device("cuda:0"))


def test_test_batches_cover_every_sample_once_in_order():
    batches = list(test_batches(indexed(23), 5))
    assert [len(b[1]) for b in batches] == [5, 5, 5, 5, 3]
    assert torch.equal(torch.cat([b[1] for b in batches]), torch.arange(23))
    assert torch.equal(torch.cat([b[0] for b in batches]), indexed(23).images)


# ----------------------------------------------------------------------------------------------
# The validation holdout (dataset.holdout_fraction)


def _holdout_config(fraction: float, seed: int = 3) -> Config:
    return Config(dataset=DatasetConfig(name="synthetic", num_train=240, num_test=60, channels=1,
                                        image_size=4, mean=[0.5], std=[0.5], augment=False,
                                        holdout_fraction=fraction),
                  partition=PartitionConfig(name="dirichlet", alpha=0.3), num_clients=5, seed=seed)


def _image_keys(tensors: ImageTensors) -> set[bytes]:
    """Each example's image bytes (synthetic images are continuous noise: no two are equal)."""
    return {image.numpy().tobytes() for image in tensors.images}


def test_validation_rows_are_disjoint_from_every_client_and_from_the_test_split():
    """The held-out rows are round(f * n) training rows that no client trains on and that are
    not test rows; clients and validation together are the whole training split."""
    cfg = _holdout_config(0.25)
    validation = data.load_validation(cfg)
    clients = [data.load_client_train(cfg, p, cfg.num_clients) for p in range(cfg.num_clients)]
    held = _image_keys(validation)
    assert len(validation) == len(held) == 60  # round(0.25 * 240), no duplicates
    client_keys = [_image_keys(c) for c in clients]
    for keys in client_keys:
        assert not keys & held
    assert not held & _image_keys(data.load_test(cfg))
    full = _image_keys(data.load_client_train(_holdout_config(0.0), 0, 1))
    assert held | set().union(*client_keys) == full and sum(map(len, client_keys)) == 180
    assert data.train_labels(cfg).size == 180  # what the partition and the preflight see


def test_holdout_rows_are_fixed_by_the_seed_and_off_at_zero():
    kept, held = partition.holdout_rows(100, 0.1, seed=7)
    again_kept, again_held = partition.holdout_rows(100, 0.1, seed=7)
    assert np.array_equal(held, again_held) and np.array_equal(kept, again_kept)
    assert held.size == 10 and np.array_equal(np.sort(np.concatenate([kept, held])), np.arange(100))
    assert not np.array_equal(held, partition.holdout_rows(100, 0.1, seed=8)[1])
    kept, held = partition.holdout_rows(100, 0.0, seed=7)
    assert held.size == 0 and np.array_equal(kept, np.arange(100))
    with pytest.raises(ValueError, match="holdout_fraction"):
        partition.holdout_rows(3, 0.1, seed=7)  # rounds to no row
    with pytest.raises(ValueError, match="no validation rows"):
        data.load_validation(_holdout_config(0.0))


def test_the_server_evaluates_on_the_validation_rows_under_val_names():
    """With a holdout the server's metrics are val_loss / val_accuracy, never test_*."""
    from fedact_app.tasks.vision import VisionTask

    task = VisionTask(_holdout_config(0.25))
    metrics = task.evaluate(task.build_model(), torch.device("cpu"))
    assert set(metrics) == {"val_loss", "val_accuracy"}
    assert set(VisionTask(_holdout_config(0.0)).evaluate(task.build_model(), torch.device("cpu"))) == {
        "test_loss", "test_accuracy"}
