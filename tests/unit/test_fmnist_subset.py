"""benchmarks/fmnist_subset.py writes idx files that the Fashion-MNIST loader reads back unchanged."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_sdk.data.datasets import FMNIST_FILES, _load_fmnist
from edge_sdk.data.idx import read_idx

from benchmark_scripts import load_benchmark


def load_script():
    return load_benchmark("fmnist_subset")


def test_written_idx_files_read_back_and_load_as_fashion_mnist(tmp_path: Path) -> None:
    # Prepare: 5 training and 3 test images of distinct bytes, labels 0..9
    script = load_script()
    generator = np.random.default_rng(0)
    arrays = [generator.integers(0, 256, (5, 28, 28), dtype=np.uint8), np.arange(5, dtype=np.uint8),
              generator.integers(0, 256, (3, 28, 28), dtype=np.uint8), np.array([7, 8, 9], dtype=np.uint8)]

    # Execute
    for name, array in zip(FMNIST_FILES, arrays):
        script.write_idx(tmp_path / name, array)
    x, y, task = _load_fmnist(str(tmp_path))

    # Assert: each file round-trips, and the loader pools them (train first) as the built-in task
    for name, array in zip(FMNIST_FILES, arrays):
        np.testing.assert_array_equal(read_idx(tmp_path / name), array)
    assert task.name == "fmnist" and x.shape[0] == 8
    np.testing.assert_array_equal(y, [0, 1, 2, 3, 4, 7, 8, 9])
