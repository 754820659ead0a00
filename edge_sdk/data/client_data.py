"""One device's train/test data: its slice of a shared dataset, or its own local images.

`load_client_data` lets every (virtual) device compute the federation's partition on its own
from the shared seed and keep only its part; `load_folder_data` loads data a real device
brings itself. Both split 75/25, stratified by class.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from edge_sdk.data.datasets import DATASETS, DatasetMeta, denormalize, load_dataset, normalize
from edge_sdk.data.domains import apply_domain
from edge_sdk.data.folder import read_folder
from edge_sdk.data.partition import partition_indices, stratified_split

logger = logging.getLogger(__name__)

TEST_FRACTION = 0.25


@dataclass
class ClientData:
    """A client's normalized train and test images and labels, and the domain it sees."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    task: DatasetMeta
    domain: str | None = None

    @property
    def num_train(self) -> int:
        """Number of training examples."""
        return int(self.train_y.shape[0])

    @property
    def num_test(self) -> int:
        """Number of test examples."""
        return int(self.test_y.shape[0])

    def class_counts(self) -> np.ndarray:
        """Training examples per class, length `task.num_classes` (the client's label skew)."""
        return np.bincount(self.train_y, minlength=self.task.num_classes)


def _split_seed(seed: int, index: int) -> int:
    """A per-client split seed derived from the federation seed and the client index."""
    return int(np.random.SeedSequence((seed, index)).generate_state(1)[0])


def _split(
    x: np.ndarray, y: np.ndarray, meta: DatasetMeta, seed: int, domain: str | None
) -> ClientData:
    train_idx, test_idx = stratified_split(y, TEST_FRACTION, seed=seed)
    return ClientData(x[train_idx], y[train_idx], x[test_idx], y[test_idx], meta, domain)


def load_client_data(
    dataset: str,
    *,
    num_clients: int,
    index: int,
    partition: str = "iid",
    seed: int = 0,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    data_dir: str | None = None,
) -> ClientData:
    """Load client `index`'s part of `dataset` partitioned among `num_clients` with `seed`.

    For the `domains` partition the client's images get its domain transform in pixel space
    (denormalized, transformed, normalized again). The part is split 75/25 stratified with a
    seed derived from (seed, index).
    """
    if not 0 <= index < num_clients:
        raise ValueError(f"index must be in [0, {num_clients}), got {index}")
    pool = load_dataset(dataset, data_dir)
    parts = partition_indices(
        pool.y,
        num_clients,
        partition,
        seed=seed,
        alpha=alpha,
        classes_per_client=classes_per_client,
    )
    idx = parts[index]
    x, y = pool.x[idx], pool.y[idx]
    domain = None
    if partition == "domains":
        x01, domain = apply_domain(denormalize(x, pool.meta), index, seed)
        x = normalize(x01, pool.meta)
    logger.info(
        "client %d/%d of %s (%s): %d examples", index, num_clients, dataset, partition, y.size
    )
    return _split(x, y, pool.meta, _split_seed(seed, index), domain)


def load_folder_data(path: str, meta_name: str | None = None, *, seed: int = 0) -> ClientData:
    """Load a device's own data from an `.npz` file (`x`, `y`) or an ImageFolder directory.

    With `meta_name` naming a known dataset the images are checked (npz) or resized (folders)
    to its shape and normalized with its mean/std; otherwise the meta is inferred from the
    data (and named `meta_name`, if given). The data is split 75/25 stratified with `seed`.
    """
    meta = DATASETS.get(meta_name) if meta_name is not None else None
    x01, y, meta = read_folder(path, meta)
    if meta_name is not None and meta_name not in DATASETS:
        logger.warning(
            "%r is not a known dataset (%s); inferred its meta from the data",
            meta_name,
            ", ".join(DATASETS),
        )
        meta = dataclasses.replace(meta, name=meta_name)
    return _split(normalize(x01, meta), y, meta, seed, None)
