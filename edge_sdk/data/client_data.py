"""One device's train/test data: its slice of a shared pool, or its own data.

`load_client_data` lets every (virtual) device compute the federation's partition on its own
from the shared seed and keep only its part, of a built-in dataset or of a user's data file;
`partition_client_data` does the same for a pool already in memory. `load_folder_data` and
`ClientData.from_arrays` load data a real device brings itself. All split 75/25, stratified
by class.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edge_sdk.data.datasets import Dataset, load_dataset
from edge_sdk.data.domains import apply_domain
from edge_sdk.data.partition import partition_indices, stratified_split
from edge_sdk.data.resolve import check_declared, resolve_task
from edge_sdk.data.task import TaskSpec
from edge_sdk.data.user_data import dataset_from_arrays, load_user_dataset

logger = logging.getLogger(__name__)

TEST_FRACTION = 0.25


@dataclass
class ClientData:
    """A client's normalized train and test samples and labels, its task, and the domain it sees."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    task: TaskSpec
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

    def holding_out(self, fraction: float, seed: int) -> ClientData:
        """This device's data for choosing hyperparameters: `fraction` of the training split held
        out (stratified by class, seeded by `seed`) as the evaluation split, the rest to train on.
        The test split is not carried over, so nothing trained or scored on the result reads it."""
        train_idx, held_idx = stratified_split(self.train_y, fraction, seed=seed)
        return ClientData(self.train_x[train_idx], self.train_y[train_idx], self.train_x[held_idx],
                          self.train_y[held_idx], self.task, self.domain)

    def for_run(self, validation_fraction: float, seed: int) -> ClientData:
        """What a device trains and is scored on in a run: all of this data, or, with a validation
        fraction, its held-out view (`holding_out`) seeded by the device's seed (`device_seed`), so
        that trainer and weak devices hold out alike and a rerun the same examples."""
        return self.holding_out(validation_fraction, seed) if validation_fraction else self

    @classmethod
    def from_arrays(cls, x: np.ndarray, y: np.ndarray, task: TaskSpec | None = None, seed: int = 0, *,
                    kind: str | None = None, class_names: Sequence[str] | None = None,
                    name: str = "arrays") -> ClientData:
        """A device's own data from numpy arrays, split 75/25 stratified with `seed`.

        `x` is laid out and `y` encoded as in a user's .npz (see `edge_sdk.data.samples`); the
        task is `task`, or inferred from the arrays (`kind` settles a 3-D `x`).
        """
        pool = dataset_from_arrays(x, y, task, kind=kind, class_names=class_names, name=name)
        return _split(pool.x, pool.y, pool.task, seed, None)


def device_seed(run_seed: int, client_id: str) -> int:
    """A device's own seed in a run: its batches, augmentations and held-out split draw from it."""
    return run_seed * 1_000_003 + sum(client_id.encode())


def _split_seed(seed: int, index: int) -> int:
    """A per-client split seed derived from the federation seed and the client index."""
    return int(np.random.SeedSequence((seed, index)).generate_state(1)[0])


def _split(x: np.ndarray, y: np.ndarray, task: TaskSpec, seed: int, domain: str | None) -> ClientData:
    train_idx, test_idx = stratified_split(y, TEST_FRACTION, seed=seed)
    return ClientData(x[train_idx], y[train_idx], x[test_idx], y[test_idx], task, domain)


def partition_client_data(
    pool: Dataset,
    *,
    num_clients: int,
    index: int,
    partition: str = "iid",
    seed: int = 0,
    alpha: float = 0.5,
    classes_per_client: int = 2,
) -> ClientData:
    """Client `index`'s part of `pool` partitioned among `num_clients` with `seed`.

    For the `domains` partition (images only) the client's images get its domain transform in
    pixel space (denormalized, transformed, normalized again). The part is split 75/25
    stratified with a seed derived from (seed, index).
    """
    if not 0 <= index < num_clients:
        raise ValueError(f"index must be in [0, {num_clients}), got {index}")
    task = pool.task
    if partition == "domains" and task.kind != "image":
        raise ValueError(f"the domains partition transforms images in pixel space; task {task.name!r} has "
                         f"{task.kind} samples: use iid, dirichlet or shards")
    parts = partition_indices(pool.y, num_clients, partition, seed=seed, alpha=alpha,
                              classes_per_client=classes_per_client)
    idx = parts[index]
    x, y = pool.x[idx], pool.y[idx]
    domain = None
    if partition == "domains":
        x01, domain = apply_domain(task.denormalize(x), index, seed)
        x = task.normalize(x01)
    logger.info("client %d/%d of %s (%s): %d examples", index, num_clients, task.name, partition, y.size)
    return _split(x, y, task, _split_seed(seed, index), domain)


def load_client_data(
    dataset: str | None,
    *,
    data: str | None = None,
    num_clients: int,
    index: int,
    partition: str = "iid",
    seed: int = 0,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    data_dir: str | None = None,
    task: TaskSpec | None = None,
    declared: dict | None = None,
) -> ClientData:
    """Load client `index`'s part of built-in `dataset`, or of the user's `data` file (one pool
    for the federation, partitioned as `partition_client_data` does).

    The task of `data` is `task`, or `resolve_task(dataset, data, data_dir, declared)`;
    `declared` may also name a CSV's `label_column`. Every device reading the same file with
    the same seed gets the same partition.
    """
    if data is None:
        if dataset is None:
            raise ValueError("load_client_data: name a built-in dataset or give data (a file or directory)")
        pool = load_dataset(dataset, data_dir)
    else:
        declared = check_declared(declared)
        task = task or resolve_task(dataset, data, data_dir, declared)
        pool = load_user_dataset(data, task, label_column=declared.get("label_column"))
    return partition_client_data(pool, num_clients=num_clients, index=index, partition=partition, seed=seed,
                                 alpha=alpha, classes_per_client=classes_per_client)


def load_folder_data(path: str, task: str | TaskSpec | None = None, *, seed: int = 0,
                     declared: dict | None = None) -> ClientData:
    """Load a device's own data: an `.npz` file, a CSV file or an ImageFolder directory.

    `task` is a TaskSpec (e.g. the run's), the name of a built-in task (its shape and
    normalization are used: images are resized to it), or a name for the task inferred from the
    data; `declared` is a `[task]` table. The data is split 75/25 stratified with `seed`.
    """
    declared = check_declared(declared)
    if not isinstance(task, TaskSpec):
        task = resolve_task(task, path, None, declared)
    pool = load_user_dataset(path, task, label_column=declared.get("label_column"))
    return _split(pool.x, pool.y, task, seed, None)
