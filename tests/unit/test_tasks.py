"""Unit tests for tasks: the built-in feature and signal tasks, a user's data (.npz, CSV, ImageFolder,
numpy arrays) read and its task inferred or declared, and partitions of a user's data."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from edge_sdk.data import (
    BUILTIN_TASKS,
    ClientData,
    TaskSpec,
    load_client_data,
    load_dataset,
    load_folder_data,
    read_user_data,
    resolve_task,
)
from edge_sdk.data.synthetic import VIBRATION_CLASSES, vibration_windows


def _write_csv(path, header: str, rows: list[str]) -> None:
    path.write_text("\n".join([header, *rows]) + "\n")


def _tabular_csv(path, n: int = 60, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A CSV of 3 float features and a text label in {"cat", "dog", "owl"}; returns (features, label index)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(5.0, 2.0, (n, 3)).round(3)
    y = rng.integers(0, 3, n)
    names = ("cat", "dog", "owl")
    _write_csv(path, "a,b,label,c", [f"{r[0]},{r[1]},{names[k]},{r[2]}" for r, k in zip(x, y, strict=True)])
    return x.astype(np.float32), y


# --- built-in tasks -------------------------------------------------------------------------


@pytest.mark.parametrize("name, loader, shape, classes", [
    ("breast_cancer", "load_breast_cancer", (30,), 2),
    ("wine", "load_wine", (13,), 3),
])
def test_tabular_builtin_tasks_are_standardized_with_the_pool_stats(name, loader, shape, classes):
    # Prepare
    import sklearn.datasets

    raw = getattr(sklearn.datasets, loader)().data

    # Execute
    pool = load_dataset(name)

    # Assert
    task = BUILTIN_TASKS[name]
    assert task.kind == "features" and task.input_shape == shape and task.num_classes == classes
    np.testing.assert_allclose(task.mean, raw.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(task.std, raw.std(axis=0), rtol=1e-6)
    assert pool.x.shape == (raw.shape[0], *shape) and pool.x.dtype == np.float32
    np.testing.assert_allclose(pool.x.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(pool.x.std(axis=0), 1.0, atol=1e-4)


def test_synthetic_vibration_is_seeded_and_its_stats_are_the_pools():
    # Execute
    first, labels = vibration_windows(5, seed=3)
    again, labels_again = vibration_windows(5, seed=3)
    other, _ = vibration_windows(5, seed=4)
    pool = load_dataset("synthetic_vibration")

    # Assert
    assert first.shape == (20, 3, 128) and first.dtype == np.float32
    assert np.bincount(labels).tolist() == [5] * len(VIBRATION_CLASSES)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(labels, labels_again)
    assert not np.allclose(first, other)
    task = BUILTIN_TASKS["synthetic_vibration"]
    assert task.kind == "signal" and task.input_shape == (3, 128) and task.class_names == VIBRATION_CLASSES
    raw = task.denormalize(pool.x)
    np.testing.assert_allclose(task.mean, raw.mean(axis=(0, 2), dtype=np.float64), atol=1e-5)
    np.testing.assert_allclose(task.std, raw.std(axis=(0, 2), dtype=np.float64), rtol=1e-5)


def test_synthetic_vibration_classes_differ_in_frequency_content():
    # Prepare: per-axis amplitude spectra
    x, y = vibration_windows(60, seed=1)
    spectra = np.abs(np.fft.rfft(x, axis=2)).reshape(len(y), -1)
    train, test = np.arange(len(y)) < 160, np.arange(len(y)) >= 160

    # Execute: nearest class mean of the spectra
    means = np.stack([spectra[train & (y == c)].mean(axis=0) for c in range(len(VIBRATION_CLASSES))])
    predicted = np.argmin(((spectra[test][:, None] - means[None]) ** 2).sum(axis=2), axis=1)

    # Assert: far above chance (0.25)
    assert np.mean(predicted == y[test]) >= 0.7


# --- a user's data: .npz --------------------------------------------------------------------


def test_npz_feature_vectors_get_per_feature_stats_and_a_constant_feature_std_one(tmp_path):
    # Prepare: feature 1 is constant
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, (40, 4))
    x[:, 1] = 7.0
    y = np.repeat([0, 1], 20)
    np.savez(tmp_path / "sensors.npz", x=x, y=y)

    # Execute
    task = resolve_task(data=str(tmp_path / "sensors.npz"))

    # Assert
    assert (task.name, task.kind, task.input_shape, task.class_names) == ("sensors", "features", (4,), ("0", "1"))
    np.testing.assert_allclose(task.mean, x.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(np.delete(task.std, 1), np.delete(x.std(axis=0), 1), rtol=1e-5)
    assert task.std[1] == 1.0


def test_npz_kind_entry_reads_a_three_d_array_as_signals(tmp_path):
    # Prepare: 2-channel windows of length 16, with class names
    rng = np.random.default_rng(1)
    x = rng.normal(0.0, 3.0, (30, 2, 16)).astype(np.float32)
    x[:, 1] += 10.0
    np.savez(tmp_path / "windows.npz", x=x, y=np.arange(30) % 3, kind="signal",
             class_names=np.array(["idle", "walk", "run"]))

    # Execute
    task = resolve_task(data=str(tmp_path / "windows.npz"))
    data = load_folder_data(str(tmp_path / "windows.npz"), seed=0)

    # Assert
    assert (task.kind, task.input_shape, task.class_names) == ("signal", (2, 16), ("idle", "walk", "run"))
    np.testing.assert_allclose(task.mean, x.mean(axis=(0, 2)), atol=1e-5)
    np.testing.assert_allclose(task.std, x.std(axis=(0, 2)), rtol=1e-5)
    assert data.train_x.shape[1:] == (2, 16) and data.num_train + data.num_test == 30
    all_x = np.concatenate([data.train_x, data.test_x])
    np.testing.assert_allclose(all_x.mean(axis=(0, 2)), 0.0, atol=1e-4)


def test_a_three_d_float_array_is_read_as_images_unless_declared_a_signal(tmp_path):
    # Prepare: signal values outside [0, 1], no kind entry
    x = np.random.default_rng(2).normal(0.0, 5.0, (12, 3, 20))
    np.savez(tmp_path / "raw.npz", x=x, y=np.arange(12) % 2)

    # Execute
    declared = resolve_task(data=str(tmp_path / "raw.npz"), declared={"kind": "signal"})

    # Assert
    assert (declared.kind, declared.input_shape) == ("signal", (3, 20))
    with pytest.raises(ValueError, match="declare kind = 'signal'"):
        resolve_task(data=str(tmp_path / "raw.npz"))


def test_npz_images_channels_last_and_not_square(tmp_path):
    # Prepare: 12 RGB images of 10 x 6 (H x W), channels last, uint8
    x = np.random.default_rng(3).integers(0, 256, (12, 10, 6, 3), dtype=np.uint8)
    np.savez(tmp_path / "camera.npz", x=x, y=np.arange(12) % 4)

    # Execute
    data = load_folder_data(str(tmp_path / "camera.npz"), seed=0)

    # Assert
    assert data.task.kind == "image" and data.task.input_shape == (3, 10, 6)
    restored = data.task.denormalize(np.concatenate([data.train_x, data.test_x]))
    assert restored.min() >= -1e-5 and restored.max() <= 1 + 1e-5
    assert data.task.num_classes == 4


def test_npz_refusals_name_the_problem(tmp_path):
    # Prepare
    np.savez(tmp_path / "nox.npz", y=np.arange(3))
    np.savez(tmp_path / "nan.npz", x=np.array([[1.0, np.nan], [0.0, 1.0]]), y=np.array([0, 1]))
    np.savez(tmp_path / "kinds.npz", x=np.zeros((4, 3)), y=np.arange(4), kind="signal")
    (tmp_path / "data.parquet").write_bytes(b"PAR1")

    # Execute / Assert
    with pytest.raises(ValueError, match=r"missing arrays \['x'\]"):
        resolve_task(data=str(tmp_path / "nox.npz"))
    with pytest.raises(ValueError, match=r"x\[0, 1\] is not a finite number"):
        resolve_task(data=str(tmp_path / "nan.npz"))
    with pytest.raises(ValueError, match="signals are \\[N, C, L\\]"):
        resolve_task(data=str(tmp_path / "kinds.npz"))
    with pytest.raises(ValueError, match="unknown data format '.parquet'"):
        resolve_task(data=str(tmp_path / "data.parquet"))
    with pytest.raises(FileNotFoundError):
        resolve_task(data=str(tmp_path / "absent.npz"))


# --- a user's data: CSV ---------------------------------------------------------------------


def test_csv_label_column_and_float_features(tmp_path):
    # Prepare
    x, y = _tabular_csv(tmp_path / "animals.csv")

    # Execute
    task = resolve_task(data=str(tmp_path / "animals.csv"))
    data = read_user_data(tmp_path / "animals.csv")

    # Assert: the label column is left out wherever it stands; classes sorted
    assert (task.kind, task.input_shape, task.class_names) == ("features", (3,), ("cat", "dog", "owl"))
    np.testing.assert_allclose(data.x, x, rtol=1e-6)
    np.testing.assert_array_equal(data.y, y)
    np.testing.assert_allclose(task.mean, x.mean(axis=0), rtol=1e-5)


def test_csv_numeric_labels_sort_as_numbers_and_a_declared_label_column_is_used(tmp_path):
    # Prepare: the label column is "kind"; a column named y is a feature here
    _write_csv(tmp_path / "t.csv", "y,kind", ["0.5,10", "1.5,2", "2.5,10", "3.5,9"])

    # Execute
    data = read_user_data(tmp_path / "t.csv", label_column="kind")
    task = resolve_task(data=str(tmp_path / "t.csv"), declared={"label_column": "kind"})

    # Assert
    assert data.class_names == ("2", "9", "10")
    np.testing.assert_array_equal(data.y, [2, 0, 2, 1])
    np.testing.assert_allclose(data.x[:, 0], [0.5, 1.5, 2.5, 3.5])
    assert task.input_shape == (1,)


@pytest.mark.parametrize("header, rows, error", [
    ("a,b,label", ["1,2,x", "3,oops,y"], r"line 3, column 'b': 'oops' is not a number"),
    ("a,b,label", ["1,2,x", "3,4"], r"line 3 has 2 cells, the header 3"),
    ("a,b,target", ["1,2,x"], r"no label column 'label' or 'y'"),
    ("a,b,label", [], r"no data rows"),
    ("a,label", ["1,x", "inf,y"], r"line 3, column 'a': 'inf' is not a finite number"),
])
def test_csv_bad_input_names_the_line_and_column(tmp_path, header, rows, error):
    # Prepare
    _write_csv(tmp_path / "bad.csv", header, rows)

    # Execute / Assert
    with pytest.raises(ValueError, match=error):
        read_user_data(tmp_path / "bad.csv")


def test_csv_of_a_builtin_task_is_standardized_with_its_stats(tmp_path):
    # Prepare: 12 rows of wine features with labels given by class name and by index
    import sklearn.datasets

    bunch = sklearn.datasets.load_wine()
    rows = [",".join([*map(str, bunch.data[i]), "class_1" if i % 2 else "2"]) for i in range(0, 178, 15)]
    _write_csv(tmp_path / "mine.csv", ",".join([*(f"f{j}" for j in range(13)), "label"]), rows)

    # Execute
    data = load_folder_data(str(tmp_path / "mine.csv"), "wine", seed=0)

    # Assert
    assert data.task is BUILTIN_TASKS["wine"]
    restored = np.sort(data.task.denormalize(np.concatenate([data.train_x, data.test_x]))[:, 0])
    np.testing.assert_allclose(restored, np.sort(bunch.data[::15, 0]), rtol=1e-5)
    assert set(np.concatenate([data.train_y, data.test_y]).tolist()) == {1, 2}


def test_data_that_does_not_fit_the_named_task_is_refused(tmp_path):
    # Prepare: 4 features, wine has 13
    _write_csv(tmp_path / "few.csv", "a,b,c,d,label", ["1,2,3,4,0", "1,2,3,5,1"])

    # Execute / Assert
    with pytest.raises(ValueError, match=r"samples of shape \[4\] do not fit the task's input shape \[13\]"):
        load_folder_data(str(tmp_path / "few.csv"), "wine")


# --- a user's data: ImageFolder -------------------------------------------------------------


def test_image_folder_of_any_size_is_resized_to_the_first_image_or_the_declared_shape(tmp_path):
    # Prepare: RGB images of different, non-square sizes (W x H: 8 x 5 first)
    image = pytest.importorskip("PIL.Image", reason="Pillow is needed to write PNGs")
    rng = np.random.default_rng(5)
    sizes = [(5, 8), (7, 4), (6, 6), (9, 3)]
    for name in ("left", "right"):
        (tmp_path / name).mkdir()
        for i, (h, w) in enumerate(sizes):
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            image.fromarray(pixels, mode="RGB").save(tmp_path / name / f"{i}.png")

    # Execute
    inferred = resolve_task(data=str(tmp_path))
    data = load_folder_data(str(tmp_path), seed=0)
    declared = load_folder_data(str(tmp_path), seed=0, declared={"input_shape": [1, 4, 10]})

    # Assert
    assert inferred.kind == "image" and inferred.input_shape == (3, 5, 8)
    assert inferred.class_names == ("left", "right")
    assert data.train_x.shape[1:] == (3, 5, 8) and data.num_train + data.num_test == 8
    assert declared.task.input_shape == (1, 4, 10) and declared.train_x.shape[1:] == (1, 4, 10)


def test_image_folder_refuses_a_non_image_task(tmp_path):
    # Prepare
    (tmp_path / "a").mkdir()

    # Execute / Assert
    with pytest.raises(ValueError, match="holds images, the task's kind is 'features'"):
        resolve_task(data=str(tmp_path), declared={"kind": "features"})


# --- numpy arrays ---------------------------------------------------------------------------


def test_client_data_from_arrays_infers_or_takes_the_task():
    # Prepare: text labels
    rng = np.random.default_rng(6)
    x = rng.normal(0.0, 1.0, (40, 5)).astype(np.float32)
    y = np.array(["ok", "fault"] * 20)

    # Execute
    inferred = ClientData.from_arrays(x, y, seed=1, name="plant")
    given = ClientData.from_arrays(x, y, inferred.task, seed=1)

    # Assert
    assert inferred.task.name == "plant" and inferred.task.class_names == ("fault", "ok")
    assert (inferred.num_train, inferred.num_test) == (30, 10)
    np.testing.assert_array_equal(inferred.train_x, given.train_x)
    np.testing.assert_array_equal(inferred.class_counts(), [15, 15])
    with pytest.raises(ValueError, match="do not fit the task's input shape"):
        ClientData.from_arrays(x[:, :3], y, inferred.task)


# --- declarations ---------------------------------------------------------------------------


def test_a_declaration_overrides_what_is_inferred(tmp_path):
    # Prepare
    _, y = _tabular_csv(tmp_path / "animals.csv")
    declared = {"name": "zoo", "class_names": ["owl", "dog", "cat"], "mean": [0, 0, 0], "std": [1, 2, 4]}

    # Execute
    task = resolve_task(data=str(tmp_path / "animals.csv"), declared=declared)
    data = load_client_data(None, data=str(tmp_path / "animals.csv"), declared=declared, num_clients=1, index=0)

    # Assert: the declared class order numbers the labels
    assert task == TaskSpec("zoo", "features", (3,), 3, ("owl", "dog", "cat"), (0.0, 0.0, 0.0), (1.0, 2.0, 4.0))
    assert np.bincount(np.concatenate([data.train_y, data.test_y])).tolist() == np.bincount(2 - y).tolist()


def test_a_declaration_alone_gives_a_task_without_normalization():
    # Execute
    task = resolve_task("vibration", declared={"kind": "signal", "input_shape": [3, 64], "class_names": ["a", "b"]})

    # Assert
    assert task == TaskSpec("vibration", "signal", (3, 64), 2, ("a", "b"), (0.0,) * 3, (1.0,) * 3)


@pytest.mark.parametrize("kwargs, error", [
    ({"declared": {"kind": "image", "colour": "red"}}, r"unknown key\(s\) colour"),
    ({"declared": {"input_shape": [3, 2.5]}}, r"input_shape = \[3, 2.5\] is not a valid input_shape"),
    ({"dataset": "imagenet"}, r"unknown dataset 'imagenet'"),
    ({}, r"no task: name a built-in dataset"),
])
def test_bad_declarations_and_missing_tasks_are_named(kwargs, error):
    with pytest.raises(ValueError, match=error):
        resolve_task(**kwargs)


def test_a_builtin_dataset_gives_its_task_with_declared_overrides():
    # Execute
    task = resolve_task("digits", declared={"name": "my_digits"})

    # Assert
    assert task.name == "my_digits" and task.input_shape == BUILTIN_TASKS["digits"].input_shape
    assert resolve_task("breast_cancer") is BUILTIN_TASKS["breast_cancer"]


# --- partitions of a user's data ------------------------------------------------------------


def test_a_user_file_is_partitioned_alike_on_every_device(tmp_path):
    # Prepare: the same file at two paths (two devices, no shared cache)
    _tabular_csv(tmp_path / "a.csv", n=90)
    shutil.copy(tmp_path / "a.csv", tmp_path / "b.csv")

    # Execute
    here = [load_client_data(None, data=str(tmp_path / "a.csv"), num_clients=3, index=k, partition="dirichlet",
                             seed=4, alpha=1.0) for k in range(3)]
    there = [load_client_data("a", data=str(tmp_path / "b.csv"), num_clients=3, index=k, partition="dirichlet",
                              seed=4, alpha=1.0) for k in range(3)]

    # Assert
    for mine, theirs in zip(here, there, strict=True):
        np.testing.assert_array_equal(mine.train_x, theirs.train_x)
        np.testing.assert_array_equal(mine.test_y, theirs.test_y)
        assert mine.task == theirs.task
    rows = np.concatenate([np.concatenate([c.train_x, c.test_x]) for c in here])
    assert rows.shape[0] == 90 and np.unique(rows, axis=0).shape[0] == 90


@pytest.mark.parametrize("source", ["breast_cancer", "csv"])
def test_the_domains_partition_is_refused_for_feature_vectors(tmp_path, source):
    # Prepare
    _tabular_csv(tmp_path / "animals.csv")
    kwargs = {"dataset": "breast_cancer"} if source == "breast_cancer" else {
        "dataset": None, "data": str(tmp_path / "animals.csv")}

    # Execute / Assert
    with pytest.raises(ValueError, match=r"domains partition .* has features samples"):
        load_client_data(**kwargs, num_clients=2, index=0, partition="domains")


def test_labels_may_be_whole_number_floats_but_not_negative(tmp_path):
    # Prepare
    x = np.random.default_rng(7).normal(0.0, 1.0, (6, 2))
    np.savez(tmp_path / "floats.npz", x=x, y=np.array([0.0, 1.0, 2.0, 0.0, 1.0, 2.0]))
    np.savez(tmp_path / "negative.npz", x=x, y=np.array([0, 1, -1, 0, 1, 2]))

    # Execute
    task = resolve_task(data=str(tmp_path / "floats.npz"))

    # Assert
    assert task.class_names == ("0", "1", "2")
    with pytest.raises(ValueError, match="integer labels must be non-negative, got -1"):
        resolve_task(data=str(tmp_path / "negative.npz"))
