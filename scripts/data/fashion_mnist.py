"""Fashion-MNIST from the Debian package's idx files to the parquet folder the app reads.

    sudo apt-get install dataset-fashion-mnist
    python3 scripts/data/fashion_mnist.py --out /data/fashion_mnist
    python3 scripts/data/fashion_mnist.py --out /tmp/fmnist-small --limit-train 3000 --limit-test 1000
    python3 -m fedact_app.cli.launch --app . --overrides "dataset=fashion_mnist dataset.path=/data/fashion_mnist"

Reads ``<source>/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz`` (``--source`` defaults to the
package's folder, :data:`DEBIAN_SOURCE`) and writes ``<out>/train/train.parquet`` and
``<out>/test/test.parquet`` in the hub copy's schema (``zalando-datasets/fashion_mnist``):
``image`` (a Hugging Face ``Image``: PNG bytes of the 28x28 8-bit grayscale image, exactly the
idx file's pixels) and ``label`` (a ``ClassLabel`` over :data:`CLASS_NAMES`, stored as int64).
A split's file is replaced when it exists.

``--limit-train N`` / ``--limit-test N`` keep the first N rows of a split, in the idx files'
order. That order is fixed and already shuffled across classes, so the first few thousand rows
hold every class about equally often (the first 3,000 training rows: 282 to 321 per class).

This is a script, not part of ``fedact_app``: turning one Debian package into files is a one-off
step on the machine that holds the data, which no ServerApp or ClientApp ever runs; the app reads
the result like any other local copy (``dataset.path``).
"""

from __future__ import annotations

import argparse
import gzip
import io
import sys
from pathlib import Path

import numpy as np

DEBIAN_SOURCE = Path("/usr/share/datasets/fashion-mnist")
INSTALL_HINT = "install it with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu), or pass --source"
SPLITS = {"train": "train", "test": "t10k"}  # the app's split name -> the idx files' prefix
CLASS_NAMES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
               "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
IMAGE_MAGIC, LABEL_MAGIC = 0x00000803, 0x00000801  # idx: unsigned bytes, 3 resp. 1 dimensions


def idx_files(source: Path, split: str) -> tuple[Path, Path]:
    """The (images, labels) idx files of ``split`` ("train" or "test") under ``source``."""
    prefix = SPLITS[split]
    return source / f"{prefix}-images-idx3-ubyte.gz", source / f"{prefix}-labels-idx1-ubyte.gz"


def read_idx(path: Path, magic: int) -> np.ndarray:
    """The uint8 array of a gzipped idx file, shaped by its header; ValueError naming the file
    when its magic number is not ``magic`` or its size does not match the header."""
    raw = gzip.decompress(path.read_bytes())
    ndim = magic & 0xFF
    found = int.from_bytes(raw[:4], "big")
    if found != magic or len(raw) < 4 * (1 + ndim):
        raise ValueError(f"{path}: idx magic number {found:#010x}, expected {magic:#010x} and {ndim} dimensions")
    shape = tuple(int(n) for n in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 * (1 + ndim))
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {body.size} data bytes, the header's shape {shape} needs {int(np.prod(shape))}")
    return body.reshape(shape)


def read_split(source: Path, split: str, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The first ``limit`` (all when None) images (N, 28, 28) and labels (N,) of ``split``.

    FileNotFoundError naming the missing file and how to install it; ValueError when the files
    disagree on the number of rows, a label is not a class id, or ``limit`` is not in [1, rows].
    """
    images_file, labels_file = idx_files(source, split)
    for file in (images_file, labels_file):
        if not file.is_file():
            raise FileNotFoundError(f"Fashion-MNIST file {file} does not exist: {INSTALL_HINT}")
    images, labels = read_idx(images_file, IMAGE_MAGIC), read_idx(labels_file, LABEL_MAGIC)
    if len(images) != len(labels):
        raise ValueError(f"{images_file} holds {len(images)} images but {labels_file} {len(labels)} labels")
    if labels.max() >= len(CLASS_NAMES):
        raise ValueError(f"{labels_file} holds the label {labels.max()}, outside [0, {len(CLASS_NAMES)})")
    if limit is not None and not 1 <= limit <= len(labels):
        raise ValueError(f"the {split} split has {len(labels)} rows; a limit must lie in [1, {len(labels)}], got {limit}")
    return images[:limit], labels[:limit]


def png_bytes(image: np.ndarray) -> bytes:
    """A 2-D uint8 array as an 8-bit grayscale PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image, mode="L").save(buffer, format="PNG")
    return buffer.getvalue()


def convert(out: Path, source: Path = DEBIAN_SOURCE, limit_train: int | None = None,
            limit_test: int | None = None) -> dict[str, Path]:
    """Write ``<out>/<split>/<split>.parquet`` for both splits (see the module docstring);
    returns the file of each split. Both splits are read before anything is written."""
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(CLASS_NAMES))})
    splits = {"train": read_split(source, "train", limit_train), "test": read_split(source, "test", limit_test)}
    files = {}
    for split, (images, labels) in splits.items():
        rows = {"image": [{"bytes": png_bytes(image), "path": None} for image in images],
                "label": labels.astype(np.int64)}
        files[split] = out / split / f"{split}.parquet"
        files[split].parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(files[split]))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write train/ and test/ into")
    parser.add_argument("--source", type=Path, default=DEBIAN_SOURCE,
                        help=f"folder of the gzipped idx files (default: {DEBIAN_SOURCE})")
    parser.add_argument("--limit-train", type=int, default=None, metavar="N", help="keep the first N training rows")
    parser.add_argument("--limit-test", type=int, default=None, metavar="N", help="keep the first N test rows")
    args = parser.parse_args(argv)
    try:
        files = convert(args.out, args.source, args.limit_train, args.limit_test)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for split, file in files.items():
        print(f"{split}: {file}")
    print(f"use: dataset=fashion_mnist dataset.path={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
