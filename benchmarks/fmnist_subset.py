"""Write a small Fashion-MNIST (the first --train training and --test test images) as idx files.

`edgepfl simulate --dataset fmnist --data-dir DIR` then runs on it with the built-in task and
partitions (e.g. `domains`), so that a federation probe of a loss term fits a shared 2-core
machine: issue 23's probes of CD2-pFed's distillation and FediOS's L_re (benchmarks/README.md).

    python benchmarks/fmnist_subset.py --train 6000 --test 2000 --out /tmp/fmnist-8k
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's packages, installed or not

from edge_sdk.data.datasets import FMNIST_FILES, SYSTEM_FMNIST_DIRS, _fmnist_dirs, _idx_file  # noqa: E402
from edge_sdk.data.idx import read_idx  # noqa: E402


def write_idx(path: Path, array: np.ndarray) -> None:
    """An uncompressed idx file of unsigned bytes: magic 0x0000 08 ndim, big-endian sizes, data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=6000, help="leading training images kept")
    parser.add_argument("--test", type=int, default=2000, help="leading test images kept")
    parser.add_argument("--data-dir", default=None, help=f"where the full idx files are (default: {SYSTEM_FMNIST_DIRS})")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    source = next((d for d in _fmnist_dirs(args.data_dir) if all(_idx_file(d, f) for f in FMNIST_FILES)), None)
    if source is None:
        print("Fashion-MNIST idx files not found (apt-get install dataset-fashion-mnist, or --data-dir)")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for name, keep in zip(FMNIST_FILES, (args.train, args.train, args.test, args.test)):
        write_idx(args.out / name, read_idx(_idx_file(source, name))[:keep])
    print(f"{args.train} + {args.test} images from {source} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
