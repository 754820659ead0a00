"""Unit tests for edge_sdk.data: dataset loading, partitions, domains and per-client data."""

from __future__ import annotations

import gzip
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.data import (
    BUILTIN_TASKS,
    DOMAIN_TRANSFORMS,
    PARTITIONS,
    DatasetNotFoundError,
    apply_domain,
    load_client_data,
    load_dataset,
    load_folder_data,
    partition_indices,
    stratified_split,
)
from edge_sdk.data import datasets as datasets_module
from edge_sdk.data.idx import read_idx

SYSTEM_FMNIST = Path("/usr/share/datasets/fashion-mnist")


def _write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as a real idx file (gzip-compressed when the name ends in .gz)."""
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)


def _balanced_labels(num_classes: int, per_class: int) -> np.ndarray:
    return np.repeat(np.arange(num_classes), per_class)


def _no_torchvision(*args, **kwargs):
    raise RuntimeError("network disabled in tests")


# --- datasets -------------------------------------------------------------------------------


def test_digits_pool_is_normalized_float32_nchw():
    # Execute
    pool = load_dataset("digits")

    # Assert
    assert pool.x.shape == (1797, 1, 8, 8)
    assert pool.x.dtype == np.float32
    assert pool.y.dtype == np.int64
    assert abs(float(pool.x.mean())) < 0.01
    assert abs(float(pool.x.std()) - 1.0) < 0.01
    assert set(np.unique(pool.y)) == set(range(10))
    assert load_dataset("digits") is pool  # cached per process


def test_unknown_dataset_names_the_known_ones():
    with pytest.raises(ValueError, match="cifar10.*digits|digits.*cifar10"):
        load_dataset("imagenet")


@pytest.mark.skipif(
    not SYSTEM_FMNIST.is_dir(),
    reason="needs the Debian package dataset-fashion-mnist (/usr/share/datasets/fashion-mnist)",
)
def test_fmnist_loads_from_system_directory():
    # Execute
    pool = load_dataset("fmnist")

    # Assert
    assert pool.x.shape == (70000, 1, 28, 28)
    assert pool.x.dtype == np.float32
    assert np.bincount(pool.y).tolist() == [7000] * 10
    assert abs(float(pool.x.mean())) < 0.01


def test_fmnist_reads_tiny_idx_files_from_data_dir(tmp_path):
    # Prepare: 5 train + 3 test images with known pixels; one file gzipped
    rng = np.random.default_rng(1)
    train_x = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    test_x = rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8)
    train_y = np.array([0, 1, 2, 3, 4], dtype=np.uint8)
    test_y = np.array([9, 8, 7], dtype=np.uint8)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", train_x)
    _write_idx(tmp_path / "train-labels-idx1-ubyte", train_y)
    _write_idx(tmp_path / "t10k-images-idx3-ubyte", test_x)
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", test_y)

    # Execute
    pool = load_dataset("fmnist", data_dir=str(tmp_path))

    # Assert: train then test, pixels scaled to [0, 1] and normalized with fmnist's stats
    assert pool.x.shape == (8, 1, 28, 28)
    assert pool.y.tolist() == [0, 1, 2, 3, 4, 9, 8, 7]
    expected01 = np.concatenate([train_x, test_x])[:, None] / 255.0
    np.testing.assert_allclose(pool.task.denormalize(pool.x), expected01, atol=1e-5)


def test_read_idx_rejects_truncated_file(tmp_path):
    # Prepare: header says 2x3 but only 5 bytes of data follow
    path = tmp_path / "bad-idx1-ubyte"
    path.write_bytes(bytes([0, 0, 0x08, 2]) + struct.pack(">2I", 2, 3) + bytes(5))

    # Execute / Assert
    with pytest.raises(ValueError, match="header says"):
        read_idx(path)


def test_missing_fmnist_lists_every_place_looked(tmp_path, monkeypatch):
    # Prepare: no system copy, torchvision cannot download
    nowhere = tmp_path / "no-system-copy"
    data_dir = tmp_path / "empty"
    data_dir.mkdir()
    monkeypatch.setattr(datasets_module, "SYSTEM_FMNIST_DIRS", (str(nowhere),))
    monkeypatch.setattr(datasets_module, "_torchvision_pool", _no_torchvision)

    # Execute
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("fmnist", data_dir=str(data_dir))

    # Assert
    message = str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    for place in (data_dir, data_dir / "fashion-mnist", data_dir / "FashionMNIST" / "raw", nowhere):
        assert str(place) in message
    assert "torchvision FashionMNIST" in message
    assert "apt-get install dataset-fashion-mnist" in message
    assert "--data-dir" in message


def test_missing_torchvision_dataset_raises_not_found(tmp_path, monkeypatch):
    # Prepare
    monkeypatch.setattr(datasets_module, "_torchvision_pool", _no_torchvision)

    # Execute / Assert
    with pytest.raises(DatasetNotFoundError, match=re.escape(str(tmp_path))):
        load_dataset("cifar10", data_dir=str(tmp_path))


# --- partitions -----------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", PARTITIONS)
def test_partition_is_disjoint_covering_and_seeded(scheme):
    # Prepare
    labels = np.random.default_rng(0).integers(0, 10, size=2000)

    # Execute
    parts = partition_indices(labels, 8, scheme, seed=3)
    again = partition_indices(labels, 8, scheme, seed=3)
    other = partition_indices(labels, 8, scheme, seed=4)

    # Assert
    assert len(parts) == 8
    merged = np.concatenate(parts)
    assert np.array_equal(np.sort(merged), np.arange(labels.size))  # disjoint and covering
    assert all(np.array_equal(np.sort(p), p) for p in parts)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


@pytest.mark.parametrize("scheme", ["iid", "domains"])
def test_iid_partitions_have_equal_sizes(scheme):
    parts = partition_indices(np.zeros(103, dtype=np.int64), 4, scheme, seed=0)
    assert sorted(p.size for p in parts) == [25, 26, 26, 26]


def test_dirichlet_respects_min_size():
    # Prepare
    labels = _balanced_labels(10, 100)

    # Execute
    parts = partition_indices(labels, 20, "dirichlet", seed=0, alpha=0.1, min_size=15)

    # Assert
    assert min(p.size for p in parts) >= 15


def test_dirichlet_gives_up_with_a_hint():
    labels = _balanced_labels(10, 10)
    with pytest.raises(ValueError, match="larger alpha"):
        partition_indices(labels, 10, "dirichlet", seed=0, alpha=0.01, min_size=10)


def _classes_above(parts: list[np.ndarray], labels: np.ndarray, share: float) -> float:
    """Mean number of classes holding more than `share` of a client's data."""
    counts = [np.bincount(labels[p], minlength=10) / p.size for p in parts]
    return float(np.mean([(c > share).sum() for c in counts]))


def test_small_alpha_skews_labels_more_than_large_alpha():
    # Prepare
    labels = _balanced_labels(10, 200)

    # Execute
    skewed = partition_indices(labels, 10, "dirichlet", seed=0, alpha=0.1, min_size=5)
    uniform = partition_indices(labels, 10, "dirichlet", seed=0, alpha=100.0, min_size=5)

    # Assert
    assert _classes_above(skewed, labels, 0.05) < 5 < _classes_above(uniform, labels, 0.05)


@pytest.mark.parametrize("classes_per_client", [1, 2, 3, 5])
def test_shards_give_each_client_exactly_its_classes(classes_per_client):
    # Prepare
    labels = _balanced_labels(10, 60)

    # Execute
    parts = partition_indices(labels, 10, "shards", seed=7, classes_per_client=classes_per_client)

    # Assert
    assert [np.unique(labels[p]).size for p in parts] == [classes_per_client] * 10
    assert all(p.size == 60 for p in parts)  # 600 examples in equal shards


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"num_clients": 0, "scheme": "iid"}, "num_clients"),
        ({"num_clients": 4, "scheme": "dirichlet", "alpha": 0.0}, "alpha"),
        ({"num_clients": 4, "scheme": "shards", "classes_per_client": 0}, "classes_per_client"),
        ({"num_clients": 4, "scheme": "shards", "classes_per_client": 11}, "classes_per_client"),
        ({"num_clients": 4, "scheme": "by-weather"}, "scheme"),
    ],
)
def test_partition_rejects_bad_arguments(kwargs, argument):
    labels = _balanced_labels(10, 20)
    with pytest.raises(ValueError, match=argument):
        partition_indices(labels, seed=0, **kwargs)


def test_stratified_split_per_class_counts():
    # Prepare: class sizes 8, 4, 1, 10 -> test 2, 1, 0 (singleton stays), 3 (2.5 rounds up)
    labels = np.array([0] * 8 + [1] * 4 + [2] * 1 + [3] * 10)

    # Execute
    train, test = stratified_split(labels, 0.25, seed=5)

    # Assert
    assert np.bincount(labels[test], minlength=4).tolist() == [2, 1, 0, 3]
    assert np.bincount(labels[train], minlength=4).tolist() == [6, 3, 1, 7]
    assert np.intersect1d(train, test).size == 0
    again_train, again_test = stratified_split(labels, 0.25, seed=5)
    assert np.array_equal(train, again_train) and np.array_equal(test, again_test)
    _, other_test = stratified_split(labels, 0.25, seed=6)
    assert not np.array_equal(test, other_test)


# --- domains --------------------------------------------------------------------------------


def _pixels(size: int = 16) -> np.ndarray:
    return np.random.default_rng(2).random((4, 1, size, size), dtype=np.float32)


def test_each_client_gets_its_domain_transform():
    # Prepare
    x01 = _pixels()

    # Execute
    results = [apply_domain(x01, k, seed=0) for k in range(8)]

    # Assert
    assert [name for _, name in results] == list(DOMAIN_TRANSFORMS) * 2
    for out, _ in results:
        assert out.shape == x01.shape and out.dtype == np.float32
        assert out.min() >= 0.0 and out.max() <= 1.0
        assert not np.allclose(out, x01)
    # Clients 0 and 4 both rotate, with different (client-dependent) angles.
    assert not np.allclose(results[0][0], results[4][0])
    assert not np.allclose(results[2][0], results[6][0])


def test_domain_is_deterministic_and_inversion_exact():
    # Prepare
    x01 = _pixels()

    # Execute
    noise_a, _ = apply_domain(x01, 2, seed=9)
    noise_b, _ = apply_domain(x01, 2, seed=9)
    inverted, name = apply_domain(x01, 1, seed=9)

    # Assert
    assert np.array_equal(noise_a, noise_b)
    assert name == "invert"
    assert np.array_equal(inverted, 1.0 - x01)


# --- client data ----------------------------------------------------------------------------


def test_digits_clients_cover_the_pool_disjointly():
    # Prepare
    pool = load_dataset("digits")

    # Execute
    clients = [
        load_client_data("digits", num_clients=10, index=k, partition="iid", seed=1)
        for k in range(10)
    ]

    # Assert
    rows = np.concatenate(
        [np.concatenate([c.train_x, c.test_x]).reshape(-1, 64) for c in clients]
    )
    assert rows.shape[0] == 1797
    assert np.unique(rows, axis=0).shape[0] == 1797  # pool images are unique, so disjoint
    all_y = np.concatenate([np.concatenate([c.train_y, c.test_y]) for c in clients])
    assert np.array_equal(np.bincount(all_y), np.bincount(pool.y))
    for c in clients:
        total = c.num_train + c.num_test
        assert total in (179, 180)
        assert abs(c.num_test - 0.25 * total) <= 5  # per-class rounding of ~18 examples each
        assert c.class_counts().sum() == c.num_train and c.class_counts().size == 10
        assert c.domain is None


def test_client_index_out_of_range():
    with pytest.raises(ValueError, match="index"):
        load_client_data("digits", num_clients=4, index=4)


def test_domains_partition_transforms_client_images():
    # Execute
    plain = load_client_data("digits", num_clients=4, index=1, partition="iid", seed=0)
    inverted = load_client_data("digits", num_clients=4, index=1, partition="domains", seed=0)

    # Assert: same examples (iid and domains split alike), pixels inverted
    task = BUILTIN_TASKS["digits"]
    assert inverted.domain == "invert"
    assert np.array_equal(plain.train_y, inverted.train_y)
    np.testing.assert_allclose(
        task.denormalize(inverted.train_x), 1.0 - task.denormalize(plain.train_x), atol=1e-5
    )


def test_folder_data_from_uint8_npz(tmp_path):
    # Prepare: 48 uint8 8x8 images (N, H, W), 4 classes x 12 -> 9 train + 3 test per class
    rng = np.random.default_rng(3)
    x = rng.integers(0, 256, size=(48, 8, 8), dtype=np.uint8)
    y = np.repeat(np.arange(4), 12)
    path = tmp_path / "mine.npz"
    np.savez(path, x=x, y=y)

    # Execute
    inferred = load_folder_data(str(path), seed=0)
    as_digits = load_folder_data(str(path), "digits", seed=0)

    # Assert
    assert inferred.train_x.shape == (36, 1, 8, 8) and inferred.test_x.shape == (12, 1, 8, 8)
    assert inferred.task.num_classes == 4 and inferred.task.class_names == ("0", "1", "2", "3")
    assert inferred.task.kind == "image" and inferred.task.name == "mine"
    assert inferred.class_counts().tolist() == [9, 9, 9, 9]
    all_x = np.concatenate([inferred.train_x, inferred.test_x])
    assert abs(float(all_x.mean())) < 1e-4 and abs(float(all_x.std()) - 1.0) < 1e-3
    assert as_digits.task is BUILTIN_TASKS["digits"]
    train_idx, _ = stratified_split(y, 0.25, seed=0)
    np.testing.assert_allclose(
        as_digits.task.denormalize(as_digits.train_x), x[train_idx][:, None] / 255.0, atol=1e-5
    )


def test_folder_npz_shape_mismatch_names_expected_and_got(tmp_path):
    # Prepare
    path = tmp_path / "wrong.npz"
    np.savez(path, x=np.zeros((4, 10, 10), dtype=np.uint8), y=np.arange(4))

    # Execute / Assert
    with pytest.raises(ValueError, match=r"\(1, 8, 8\).*got \(1, 10, 10\)"):
        load_folder_data(str(path), "digits")


def test_folder_data_from_image_folder(tmp_path):
    # Prepare: two class folders with 4 grayscale 6x6 PNGs each
    image_module = pytest.importorskip("PIL.Image", reason="Pillow is needed to write PNGs")
    rng = np.random.default_rng(4)
    for name in ("3", "7"):
        (tmp_path / name).mkdir()
        for i in range(4):
            pixels = rng.integers(0, 256, size=(6, 6), dtype=np.uint8)
            image_module.fromarray(pixels, mode="L").save(tmp_path / name / f"{i}.png")

    # Execute
    inferred = load_folder_data(str(tmp_path), seed=0)
    as_digits = load_folder_data(str(tmp_path), "digits", seed=0)

    # Assert
    assert inferred.task.class_names == ("3", "7")
    assert inferred.task.input_shape == (1, 6, 6)
    assert (inferred.num_train, inferred.num_test) == (6, 2)
    assert inferred.class_counts().tolist() == [3, 3]
    assert as_digits.train_x.shape == (6, 1, 8, 8)  # resized to the digits shape
    assert sorted(np.unique(as_digits.train_y).tolist()) == [3, 7]
