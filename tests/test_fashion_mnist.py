"""Real data: Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` through
scripts/data/fashion_mnist.py, the app's loader and Dirichlet partitioner, and one short FedACT
and one short FedAdamW run on real Flower.

The tests on the package's files skip, saying so, where /usr/share/datasets/fashion-mnist is
absent (``sudo apt-get install dataset-fashion-mnist``); the converter's own tests run on small
idx files written here. A module fixture converts the first TRAIN_ROWS / TEST_ROWS rows once.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fedact_app.tasks.vision import data, partition, splits
from fedact_app.config import compose

APP_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(APP_DIR / "scripts" / "data"))

import fashion_mnist  # noqa: E402

SOURCE = fashion_mnist.DEBIAN_SOURCE
needs_package = pytest.mark.skipif(
    not SOURCE.is_dir(), reason=f"{SOURCE} is absent: the Debian package dataset-fashion-mnist is not installed "
                                "(sudo apt-get install dataset-fashion-mnist)")
TRAIN_ROWS, TEST_ROWS = 3000, 1000
# The runs: 4 clients, all in every round, 3 rounds of 30 local steps, cnn_small (19k parameters)
# on 28x28 grayscale; one learning rate and seed for both methods, so they differ only in the method.
RUN = ("dataset=fashion_mnist dataset.augment=false num_clients=4 fraction_train=1.0 min_train_nodes=4 "
       "num_rounds=3 local_steps=30 algorithm.lr=3e-3 tensorboard=false")
METHODS = ("fedact", "fedadamw")


@pytest.fixture(autouse=True)
def _fresh_caches():
    data.clear_caches()
    yield
    data.clear_caches()


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory) -> Path:
    """The first TRAIN_ROWS / TEST_ROWS rows of the package, converted into a temporary folder."""
    if not SOURCE.is_dir():
        pytest.skip(needs_package.kwargs["reason"])
    out = tmp_path_factory.mktemp("fashion_mnist")
    fashion_mnist.convert(out, SOURCE, TRAIN_ROWS, TEST_ROWS)
    return out


def overrides(folder: Path) -> str:
    """Overrides reading the converted ``folder``, the datasets cache beside it."""
    return f"dataset=fashion_mnist dataset.path={folder} data_dir={folder.parent / 'hf-cache'}"


def decoded(file: Path) -> tuple[np.ndarray, np.ndarray]:
    """The (N, 28, 28) uint8 pixels and labels of a converted parquet file, decoded with PIL;
    fails unless every image is an 8-bit grayscale 28x28 PNG."""
    table = pq.read_table(file).to_pydict()
    images = [Image.open(io.BytesIO(cell["bytes"])) for cell in table["image"]]
    assert {(image.format, image.mode, image.size) for image in images} == {("PNG", "L", (28, 28))}
    return np.stack([np.asarray(image) for image in images]), np.asarray(table["label"])


def write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    """A gzipped idx file of a uint8 array (big-endian header: magic, then each dimension)."""
    header = np.array([magic, *array.shape], dtype=">u4").tobytes()
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


# ----------------------------------------------------------------------------------------------
# The converter


def test_converter_writes_the_idx_pixels_and_labels_as_pngs(tmp_path):
    """Handmade idx files (random pixels, labels 0..9): each split's parquet holds the first
    ``limit`` rows, PNG-decoded to exactly the written pixels, with their labels."""
    rng = np.random.default_rng(0)
    written = {}
    for split, rows in (("train", 12), ("test", 7)):
        images, labels = rng.integers(0, 256, (rows, 28, 28), dtype=np.uint8), rng.permutation(rows) % 10
        images_file, labels_file = fashion_mnist.idx_files(tmp_path, split)
        write_idx(images_file, images, fashion_mnist.IMAGE_MAGIC)
        write_idx(labels_file, labels, fashion_mnist.LABEL_MAGIC)
        written[split] = images, labels
    files = fashion_mnist.convert(tmp_path / "out", tmp_path, limit_train=10)
    assert files == {split: tmp_path / "out" / split / f"{split}.parquet" for split in ("train", "test")}
    for split, rows in (("train", 10), ("test", 7)):
        images, labels = decoded(files[split])
        assert np.array_equal(images, written[split][0][:rows])
        assert np.array_equal(labels, written[split][1][:rows])


def test_converter_refuses_a_file_with_the_wrong_idx_header(tmp_path):
    images_file, labels_file = fashion_mnist.idx_files(tmp_path, "train")
    write_idx(images_file, np.zeros(5, np.uint8), fashion_mnist.LABEL_MAGIC)  # labels under the images' name
    write_idx(labels_file, np.zeros(5, np.uint8), fashion_mnist.LABEL_MAGIC)
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: idx magic number 0x00000801, expected 0x00000803 and 3 dimensions"):
        fashion_mnist.read_split(tmp_path, "train")


def test_missing_files_name_the_path_and_the_debian_package(tmp_path, capsys):
    """The command line exits 2 with one line naming the missing file and the apt-get fix; nothing is written."""
    assert fashion_mnist.main(["--out", str(tmp_path / "out"), "--source", str(tmp_path / "none")]) == 2
    error = capsys.readouterr().err
    assert f"{tmp_path / 'none' / 'train-images-idx3-ubyte.gz'} does not exist" in error
    assert "apt-get install dataset-fashion-mnist" in error
    assert not (tmp_path / "out").exists()


@needs_package
def test_the_package_holds_fashion_mnist():
    """The idx parser on the package: 60,000 + 10,000 28x28 images, 6,000 / 1,000 per class, and
    the first labels of the published files (ankle boot, T-shirt, T-shirt, dress, ...)."""
    for split, rows, first in (("train", 60000, [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]),
                               ("test", 10000, [9, 2, 1, 1, 6, 1, 4, 6, 5, 7])):
        images, labels = fashion_mnist.read_split(SOURCE, split)
        assert images.shape == (rows, 28, 28) and images.dtype == np.uint8
        assert labels[:10].tolist() == first
        assert np.bincount(labels).tolist() == [rows // 10] * 10


def test_converted_pngs_hold_the_package_pixels_and_labels(fmnist):
    for split, rows in (("train", TRAIN_ROWS), ("test", TEST_ROWS)):
        images, labels = decoded(fmnist / split / f"{split}.parquet")
        expected_images, expected_labels = fashion_mnist.read_split(SOURCE, split, rows)
        assert np.array_equal(images, expected_images) and np.array_equal(labels, expected_labels)


# ----------------------------------------------------------------------------------------------
# The app's loader and partitioner


def test_loader_reads_the_converted_folder(fmnist):
    """``dataset=fashion_mnist dataset.path=<folder>``: the row counts, (1, 28, 28) tensors that
    are the package's pixels normalized with the config's mean/std (so about zero mean, unit std),
    and the package's labels, every class present."""
    cfg = compose(overrides(fmnist))
    train, test_split = splits.load_splits(cfg.dataset, cfg.data_dir)
    assert (len(train), len(test_split)) == (TRAIN_ROWS, TEST_ROWS)
    test = data.load_test(cfg)
    assert test.images.shape == (TEST_ROWS, 1, 28, 28)
    assert abs(test.images.mean().item()) < 0.1 and abs(test.images.std().item() - 1) < 0.1
    pixels, labels = fashion_mnist.read_split(SOURCE, "test", TEST_ROWS)
    mean, std = cfg.dataset.mean[0], cfg.dataset.std[0]
    assert np.array_equal(np.rint((test.images[:, 0].numpy() * std + mean) * 255), pixels)
    assert np.array_equal(test.labels.numpy(), labels)
    assert np.bincount(labels, minlength=10).min() >= 50


def max_class_share(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """The mean over clients of the share of a client's most frequent label."""
    return float(np.mean([np.bincount(labels[rows]).max() / rows.size for rows in parts]))


def test_dirichlet_partition_of_the_converted_folder(fmnist):
    """10 clients at Dirichlet alpha 0.1: every row on exactly one client, every client holds
    data (its decoded tensors are its rows), and a client's labels are dominated by one class
    (mean top-class share above 0.5, where the IID partition stays below 0.2)."""
    cfg = compose(f"{overrides(fmnist)} num_clients=10 partition=dirichlet partition.alpha=0.1")
    labels = data.train_labels(cfg)
    parts = partition.partition_indices(labels, 10, cfg.partition, cfg.seed)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(TRAIN_ROWS))
    for client, rows in enumerate(parts):
        assert np.array_equal(data.load_client_train(cfg, client, 10).labels.numpy(), labels[rows])
    assert min(rows.size for rows in parts) > 0
    iid = partition.partition_indices(labels, 10, compose("partition=iid").partition, cfg.seed)
    assert max_class_share(labels, parts) > 0.5 > 0.2 > max_class_share(labels, iid)


# ----------------------------------------------------------------------------------------------
# FedACT and FedAdamW on real Flower


@pytest.fixture(scope="module")
def runs(fmnist, flower_engine, on_flower_engine) -> dict:
    """method -> (output folder, RunResult) of RUN for FedACT and FedAdamW, on the session's engine."""

    def run(method):
        output = fmnist.parent / f"run-{method}"
        try:
            result = flower_engine.run(APP_DIR, overrides=f"{RUN} algorithm={method} {overrides(fmnist)} "
                                                          f"output_dir={output}", num_supernodes=4, timeout=300)
        except Exception as err:  # reported by that method's test only
            result = err
        return method, (output, result)

    return dict(on_flower_engine(run, METHODS))


@pytest.mark.e2e
@pytest.mark.timeout(400)  # both runs start in the first test's setup
@pytest.mark.parametrize("method", METHODS)
def test_short_run_learns_fashion_mnist(method, runs):
    """3 rounds of 4 clients complete with finite losses, no rejected reply, and test accuracy
    well above chance (0.1): above 0.3 and 0.15 above the untrained model."""
    output, result = runs[method]
    if isinstance(result, Exception):
        raise result
    assert result.completed, f"{result.status} {result.details}\n{result.tail(60)}"
    (folder,) = output.iterdir()
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert all(r["clients"] == 4 and r["rejected"] == 0 for r in rows[1:])
    assert all(math.isfinite(r["train_loss"]) and math.isfinite(r["test_loss"]) for r in rows[1:])
    assert rows[-1]["test_accuracy"] > max(0.3, rows[0]["test_accuracy"] + 0.15)
    print(f"{method}: test accuracy {rows[0]['test_accuracy']:.3f} -> {rows[-1]['test_accuracy']:.3f}")
