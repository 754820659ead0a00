"""Split a labelled pool among federated clients (iid, Dirichlet, pathological shards, domains).

Every device computes the same partition independently from the federation seed, so all
functions here are deterministic for a given seed and use numpy only.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

PARTITIONS = ("iid", "dirichlet", "shards", "domains")
_DIRICHLET_TRIES = 100


def _as_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    return labels


def partition_indices(
    labels: np.ndarray,
    num_clients: int,
    scheme: str,
    *,
    seed: int,
    alpha: float = 0.5,
    classes_per_client: int = 2,
    min_size: int = 10,
) -> list[np.ndarray]:
    """Split positions 0..len(labels)-1 into `num_clients` disjoint, sorted index arrays.

    `iid` and `domains` shuffle and cut into equal parts (the `domains` feature skew is applied
    later by `apply_domain`); `dirichlet` draws per-class client proportions from Dir(alpha);
    `shards` gives each client `classes_per_client` label shards (the FedAvg pathological split).
    """
    labels = _as_labels(labels)
    if scheme not in PARTITIONS:
        raise ValueError(f"scheme must be one of {PARTITIONS}, got {scheme!r}")
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > labels.size:
        raise ValueError(
            f"num_clients ({num_clients}) exceeds the number of examples ({labels.size})"
        )
    rng = np.random.default_rng(seed)
    if scheme == "dirichlet":
        parts = _dirichlet(labels, num_clients, rng, alpha, min_size)
    elif scheme == "shards":
        parts = _shards(labels, num_clients, rng, classes_per_client)
    else:
        parts = np.array_split(rng.permutation(labels.size), num_clients)
    return [np.sort(part).astype(np.int64) for part in parts]


def _dirichlet(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, alpha: float, min_size: int
) -> list[np.ndarray]:
    """Per class, hand out examples in Dir(alpha) proportions; redraw until all have min_size."""
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    if num_clients * min_size > labels.size:
        raise ValueError(
            f"min_size={min_size} for {num_clients} clients needs {num_clients * min_size} "
            f"examples, only {labels.size} available; use a smaller min_size or fewer clients"
        )
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for attempt in range(1, _DIRICHLET_TRIES + 1):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for idx in by_class:
            idx = rng.permutation(idx)
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            cuts = np.floor(np.cumsum(proportions)[:-1] * idx.size).astype(np.int64)
            for part, chunk in zip(parts, np.split(idx, cuts), strict=True):
                part.append(chunk)
        merged = [np.concatenate(part) for part in parts]
        if min(m.size for m in merged) >= min_size:
            logger.debug("dirichlet partition found after %d draw(s)", attempt)
            return merged
    raise ValueError(
        f"dirichlet partition (alpha={alpha}) gave some of the {num_clients} clients fewer than "
        f"min_size={min_size} examples in {_DIRICHLET_TRIES} draws; "
        "use a larger alpha or fewer clients"
    )


def _shards_per_class(counts: np.ndarray, total: int) -> np.ndarray:
    """Share `total` shards among classes proportionally to `counts`, at least one each."""
    alloc = np.minimum(np.maximum(1, np.floor(counts * total / counts.sum())), counts)
    alloc = alloc.astype(np.int64)
    while alloc.sum() > total:  # take from the class with the smallest shards
        alloc[np.where(alloc > 1, counts / alloc, np.inf).argmin()] -= 1
    while alloc.sum() < total:  # give to the class with the largest shards
        alloc[np.where(alloc < counts, counts / alloc, -np.inf).argmax()] += 1
    return alloc


def _shards(
    labels: np.ndarray, num_clients: int, rng: np.random.Generator, classes_per_client: int
) -> list[np.ndarray]:
    """Cut label-sorted examples into num_clients*classes_per_client shards, deal them out.

    Shards are single-class whenever there are at least as many shards as classes. They are
    ordered by class (in a seeded random class order) and client k receives every
    num_clients-th shard, so a class with at most num_clients shards (always, on a balanced
    label set) never gives a client two of its shards.
    """
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    if not 1 <= classes_per_client <= classes.size:
        raise ValueError(
            f"classes_per_client must be in [1, {classes.size}] (the number of classes), "
            f"got {classes_per_client}"
        )
    num_shards = num_clients * classes_per_client
    if num_shards > labels.size:
        raise ValueError(
            f"num_clients * classes_per_client = {num_shards} shards exceed the "
            f"{labels.size} examples"
        )
    class_order = rng.permutation(classes.size)
    by_class = [rng.permutation(np.flatnonzero(inverse == c)) for c in class_order]
    if num_shards >= classes.size:
        alloc = _shards_per_class(counts[class_order], num_shards)
        shards = [s for idx, n in zip(by_class, alloc, strict=True) for s in np.array_split(idx, n)]
    else:  # fewer shards than classes: shards must span class boundaries
        shards = np.array_split(np.concatenate(by_class), num_shards)
    owners = rng.permutation(num_clients)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for j, shard in enumerate(shards):
        parts[owners[j % num_clients]].append(shard)
    return [np.concatenate(part) for part in parts]


def stratified_split(
    labels: np.ndarray, test_fraction: float = 0.25, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Split positions into `labels` into sorted (train_idx, test_idx), class by class.

    Each class sends round-half-up(test_fraction * count) examples to test, but always keeps at
    least one in train (so a single-example class stays in train), keeping per-client label
    distributions equal between a client's train and test data.
    """
    labels = _as_labels(labels)
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train = [np.empty(0, dtype=np.int64)]
    test = [np.empty(0, dtype=np.int64)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = min(int(np.floor(test_fraction * idx.size + 0.5)), idx.size - 1)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
