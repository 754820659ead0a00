"""Write a small Fashion-MNIST (the first --train training and --test test images) as idx files.

`edgepfl simulate --dataset fmnist --data-dir DIR` then runs on it with the built-in task and
partitions (e.g. `domains`), so that a federation probe of a loss term fits a shared 2-core
machine: the probes of CD2-pFed's distillation and FediOS's L_re (benchmarks/docs/papers.md).

    python -m benchmarks.fmnist_subset --train 6000 --test 2000 --out /tmp/fmnist-8k
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

import numpy as np

from edge_sdk.data.datasets import FMNIST_FILES, SYSTEM_FMNIST_DIRS, fmnist_idx_files
from edge_sdk.data.idx import read_idx


def write_idx(path: Path, array: np.ndarray) -> None:
    """An uncompressed idx file of unsigned bytes: magic 0x0000 08 ndim, big-endian sizes, data."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=6000, help="leading training images kept")
    parser.add_argument("--test", type=int, default=2000, help="leading test images kept")
    parser.add_argument("--data-dir", default=None,
                        help=f"where the full idx files are (default: {SYSTEM_FMNIST_DIRS})")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    files = fmnist_idx_files(args.data_dir)
    if files is None:
        print("Fashion-MNIST idx files not found (apt-get install dataset-fashion-mnist, or --data-dir)")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for name, source, keep in zip(FMNIST_FILES, files, (args.train, args.train, args.test, args.test), strict=True):
        write_idx(args.out / name, read_idx(source)[:keep])
    print(f"{args.train} + {args.test} images from {files[0].parent} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
