"""benchmarks/fmnist_subset.py writes idx files that the Fashion-MNIST loader reads back unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks import fmnist_subset
from edge_sdk.data import load_dataset
from edge_sdk.data.datasets import FMNIST_FILES, fmnist_idx_files
from edge_sdk.data.idx import read_idx


def test_written_idx_files_read_back_and_load_as_fashion_mnist(tmp_path: Path) -> None:
    # Prepare: 5 training and 3 test images of distinct bytes, labels 0..9
    generator = np.random.default_rng(0)
    arrays = [generator.integers(0, 256, (5, 28, 28), dtype=np.uint8), np.arange(5, dtype=np.uint8),
              generator.integers(0, 256, (3, 28, 28), dtype=np.uint8), np.array([7, 8, 9], dtype=np.uint8)]

    # Execute
    for name, array in zip(FMNIST_FILES, arrays, strict=True):
        fmnist_subset.write_idx(tmp_path / name, array)
    found = fmnist_idx_files(str(tmp_path))
    pool = load_dataset("fmnist", str(tmp_path))

    # Assert: each file round-trips, and the loader pools them (train first) as the built-in task
    for name, array in zip(FMNIST_FILES, arrays, strict=True):
        np.testing.assert_array_equal(read_idx(tmp_path / name), array)
    assert found == [tmp_path / name for name in FMNIST_FILES]
    assert pool.task.name == "fmnist" and pool.x.shape[0] == 8
    np.testing.assert_array_equal(pool.y, [0, 1, 2, 3, 4, 7, 8, 9])
