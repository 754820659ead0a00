"""Mechanics of DC-PFL on tiny data, without a broker: pooled statistics, virtual features,
what goes up, server-side validation and heterogeneous bodies."""

from __future__ import annotations

import dataclasses
from typing import Literal, cast

import numpy as np
import pytest
import torch
from torch import nn

from builtin_tasks import DIGITS, digits_client
from coordinator.aggregation.averaging import pool_class_stats
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms.dc_pfl import DcPflServer, sample_virtual_features, virtual_counts
from coordinator.rounds.inprocess import FixedUpdate, play_round
from edge_sdk import wire
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.dc_pfl import (
    GLOBAL_MEANS,
    STATS,
    CovarianceMode,
    DcPflDevice,
    Hyper,
    class_statistics,
    decode_stats,
    encode_stats,
)
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.data import ClientData
from edge_sdk.data.task import TaskSpec
from edge_sdk.params import check_arrays
from edge_sdk.protocol import Envelope, Kind, Reason, ValidationError
from edge_sdk.training import eval_mode

SETTINGS = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=32, lr=0.05, seed=0)
CONTEXT = ServerContext(model="cnn8", task=DIGITS, seed=0, rounds=2, clients=10)
DEFAULT_HYPER = Hyper()
"""The algorithm's default hyperparameters."""


def _device(index: int, hyper: Hyper = DEFAULT_HYPER, server: DcPflServer | None = None) -> DcPflDevice:
    data = digits_client(index, num_clients=10, partition="dirichlet", alpha=0.5, seed=0)
    assignment = server.assignment(f"dev{index:03d}") if server is not None else {}
    return DcPflDevice(hyper, SETTINGS, data, "cpu", client_seed=index, assignment=assignment)


def _round_trip(groups: dict) -> dict:
    """Groups as the server receives them: through the wire encoding."""
    return wire.decode(wire.encode(Envelope(Kind.TRAIN_RES, "dev000", groups=groups))).groups


# -- pooled statistics (Eq. 10-11) ------------------------------------------------------------
def test_pool_class_stats_equals_statistics_of_the_concatenated_features() -> None:
    # Prepare: three clients, class 0 everywhere, class 1 once on client 1 and absent on client 2,
    # class 2 only on client 2
    rng = np.random.default_rng(0)
    dim, classes = 5, 3
    clients = [
        (rng.normal(size=(40, dim)), np.r_[np.zeros(30, int), np.ones(10, int)]),
        (rng.normal(2.0, 3.0, size=(9, dim)), np.r_[np.zeros(8, int), 1]),
        (rng.normal(-1.0, 0.5, size=(20, dim)), np.r_[np.zeros(12, int), np.full(8, 2)]),
    ]
    stats = [class_statistics(z, y, classes) for z, y in clients]
    features = np.concatenate([z for z, _ in clients])
    labels = np.concatenate([y for _, y in clients])

    for c in range(classes):
        # Execute
        count, mean, cov = pool_class_stats([(n[c], m[c], s[c]) for n, m, s in stats])

        # Assert
        expected = features[labels == c]
        assert count == len(expected)
        np.testing.assert_allclose(mean, expected.mean(axis=0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(cov, np.cov(expected, rowvar=False, ddof=1), rtol=1e-10, atol=1e-12)


def test_pool_class_stats_of_absent_and_single_examples() -> None:
    # Prepare
    dim = 4
    mean = np.arange(dim, dtype=float)

    # Execute
    absent = pool_class_stats([(0, np.zeros(dim), np.zeros((dim, dim)))] * 2)
    single = pool_class_stats([(1, mean, np.zeros((dim, dim))), (0, np.ones(dim), np.eye(dim))])

    # Assert
    assert absent[0] == 0 and not absent[1].any() and not absent[2].any()
    assert single[0] == 1
    np.testing.assert_array_equal(single[1], mean)
    assert not single[2].any()


# -- virtual features (Sec. 4.4) --------------------------------------------------------------
def test_virtual_counts_are_proportional_to_global_counts_and_sum_to_1000() -> None:
    # Prepare
    counts = np.array([333, 333, 334, 0, 1, 17, 250, 90, 3, 9])

    # Execute
    sizes = virtual_counts(counts, 1000)

    # Assert
    assert sizes.sum() == 1000
    assert sizes[3] == 0
    assert np.all(np.abs(sizes - 1000 * counts / counts.sum()) < 1.0)


def test_virtual_features_follow_the_class_gaussians() -> None:
    # Prepare
    rng = np.random.default_rng(1)
    means = np.array([[0.0, 0.0], [5.0, -5.0]])
    covs = np.array([[[1.0, 0.8], [0.8, 1.0]], [[0.0, 0.0], [0.0, 0.0]]])

    # Execute
    features, labels = sample_virtual_features(means, covs, np.array([4000, 5]), rng)

    # Assert
    assert features.shape == (4005, 2) and np.bincount(labels).tolist() == [4000, 5]
    np.testing.assert_allclose(np.cov(features[labels == 0], rowvar=False), covs[0], atol=0.08)
    np.testing.assert_allclose(features[labels == 1], np.tile(means[1], (5, 1)))


def test_server_round_draws_1000_virtual_features_reproducibly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: two clients' statistics, and a spy on the drawn features
    rng = np.random.default_rng(2)
    dim = 128
    drawn: list[np.ndarray] = []
    real_sample = sample_virtual_features

    def spy(*args):
        features, labels = real_sample(*args)
        drawn.append(labels)
        return features, labels

    monkeypatch.setattr("coordinator.algorithms.dc_pfl.sample_virtual_features", spy)
    uploads = {}
    for cid in ("dev001", "dev000"):
        labels = rng.integers(0, 7, size=60)
        stats = class_statistics(rng.normal(size=(60, dim)), labels, 10)
        uploads[cid] = encode_stats(*stats, CovarianceMode("full"), "float32")
    states = []

    # Execute: the same round twice, replies in different orders
    for order in (["dev001", "dev000"], ["dev000", "dev001"]):
        server = DcPflServer(Hyper(), CONTEXT)
        play_round(server, {cid: FixedUpdate({STATS: uploads[cid]}, 60) for cid in order}, 3)
        states.append(server.state)

    # Assert
    global_counts = cast(np.ndarray, sum(u["counts"] for u in uploads.values()))
    assert len(drawn[0]) == 1000
    np.testing.assert_array_equal(np.bincount(drawn[0], minlength=10), virtual_counts(global_counts, 1000))
    for group in (SHARED, GLOBAL_MEANS):
        for name, array in states[0][group].items():
            np.testing.assert_array_equal(array, states[1][group][name])
    np.testing.assert_array_equal(states[0][GLOBAL_MEANS]["has_mean"], global_counts > 0)


# -- the device ---------------------------------------------------------------------------------
def test_upload_contains_only_class_statistics_of_the_updated_body() -> None:
    # Prepare
    device = _device(0)
    server = DcPflServer(Hyper(), CONTEXT)
    task = Task(1, server.task_groups(1), {"selected": ["dev000"]})

    # Execute
    result = device.fit(task)
    payload = wire.encode(Envelope(Kind.TRAIN_RES, "dev000", groups=result.groups, metrics=result.metrics))

    # Assert: only statistics, with no model key on the wire, and they are those of the body
    assert set(result.groups) == {STATS}
    check_arrays(STATS, result.groups[STATS], server.update_spec(1)[STATS])
    for key in device.model.state_dict():
        assert key.encode() not in payload
    assert b"body" not in payload and b"head" not in payload
    with torch.no_grad(), eval_mode(device.model):
        features = device.model.body(torch.as_tensor(device.data.train_x)).double().numpy()
    counts, means, _ = class_statistics(features, device.data.train_y, 10)
    np.testing.assert_array_equal(result.groups[STATS]["counts"], counts)
    np.testing.assert_allclose(result.groups[STATS]["means"], means, rtol=1e-4, atol=1e-4)


def test_auxiliary_loss_only_for_classes_with_a_global_mean() -> None:
    # Prepare
    device = _device(1, Hyper(lam=0.5))
    x, y = torch.as_tensor(device.data.train_x[:8]), torch.as_tensor(device.data.train_y[:8])
    assert device.model.feature_dim is not None
    means = torch.randn(10, device.model.feature_dim, generator=torch.Generator().manual_seed(0))
    has_mean = torch.zeros(10, dtype=torch.bool)
    has_mean[y[0]] = True

    # Execute
    with torch.no_grad(), eval_mode(device.model):
        plain = device.local_loss(None)(x, y)
        with_means = device.local_loss((means, has_mean))(x, y)
        z = device.model.body(x)

    # Assert
    rows = y == y[0]
    expected = 0.5 * ((z[rows] - means[y[0]]) ** 2).sum() / len(y)
    torch.testing.assert_close(with_means - plain, expected)


@pytest.mark.parametrize("covariance", ["full", "diag", "lowrank:4"])
@pytest.mark.parametrize("transport", ["fp32", "fp16"])
def test_every_mode_matches_its_update_spec_and_passes_validation(covariance: str,
                                                                  transport: Literal["fp32", "fp16"]) -> None:
    # Prepare
    hyper = Hyper(covariance=covariance, transport=transport)
    server = DcPflServer(hyper, CONTEXT)
    device = _device(2, hyper)

    # Execute
    groups = _round_trip(device.fit(Task(1, server.task_groups(1), {})).groups)
    spec = server.update_spec(1)

    # Assert
    assert set(groups) == set(spec)
    check_arrays(STATS, groups[STATS], spec[STATS])
    server.validate_update("dev002", groups, {"num_examples": device.data.num_train}, device.data.num_train)


def test_lowrank_keeps_the_diagonal_and_is_exact_at_full_rank() -> None:
    # Prepare
    rng = np.random.default_rng(3)
    counts, means, covs = class_statistics(rng.normal(size=(50, 6)), rng.integers(0, 2, size=50), 2)
    low2, low6 = CovarianceMode("lowrank", 2), CovarianceMode("lowrank", 6)

    # Execute
    low = decode_stats(encode_stats(counts, means, covs, low2, "float64"), low2)[2]
    full = decode_stats(encode_stats(counts, means, covs, low6, "float64"), low6)[2]

    # Assert
    np.testing.assert_allclose(np.diagonal(low, axis1=1, axis2=2), np.diagonal(covs, axis1=1, axis2=2), atol=1e-12)
    assert np.linalg.eigvalsh(low).min() > -1e-12
    np.testing.assert_allclose(full, covs, atol=1e-12)


def test_lowrank_factor_is_the_top_eigenspace_and_zero_for_an_absent_class() -> None:
    # Prepare: class 2 has no examples, so its covariance is zero
    rng = np.random.default_rng(5)
    counts, means, covs = class_statistics(rng.normal(size=(80, 12)), rng.integers(0, 2, size=80), 3)
    mode = CovarianceMode("lowrank", 3)

    # Execute
    factor = encode_stats(counts, means, covs, mode, "float64")["cov_factor"]

    # Assert: F F^T equals the rank-3 truncation of a full eigendecomposition
    eigenvalues, eigenvectors = np.linalg.eigh(covs[0])
    top = eigenvectors[:, -3:] * np.sqrt(eigenvalues[-3:])
    np.testing.assert_allclose(factor[0] @ factor[0].T, top @ top.T, atol=1e-10)
    assert not factor[2].any()


# -- server-side validation -----------------------------------------------------------------------
def _genuine_upload(hyper: Hyper = DEFAULT_HYPER) -> tuple[dict, int]:
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 10, size=200)
    counts, means, covs = class_statistics(np.abs(rng.normal(size=(200, 128))), labels, 10)
    return {STATS: encode_stats(counts, means, covs, hyper.mode, hyper.wire_dtype)}, 200


def _tampered(groups: dict, name: str, change) -> dict:
    stats = {k: np.array(v) for k, v in groups[STATS].items()}
    change(stats[name])
    return {STATS: stats}


def _set_negative_eigenvalue(cov: np.ndarray) -> None:
    cov[3] = np.eye(cov.shape[1], dtype=cov.dtype)
    cov[3, 0, 0] = -0.5


def _set_indefinite_off_diagonal(cov: np.ndarray) -> None:
    cov[4] = 0.0  # a zero matrix (skipped as PSD) but for one symmetric pair: eigenvalues +-1
    cov[4, 0, 1] = cov[4, 1, 0] = 1.0


@pytest.mark.parametrize(
    ("name", "change", "reason"),
    [
        ("cov", _set_negative_eigenvalue, Reason.MALFORMED),
        ("cov", _set_indefinite_off_diagonal, Reason.MALFORMED),
        ("cov", lambda cov: cov[1].__setitem__((0, 1), cov[1, 0, 1] + 1.0), Reason.MALFORMED),
        ("means", lambda means: means.__setitem__((2, 5), np.nan), Reason.NON_FINITE),
        ("cov", lambda cov: cov.__setitem__((0, 0, 0), np.inf), Reason.NON_FINITE),
        ("counts", lambda counts: counts.__setitem__(0, counts[0] + 1), Reason.MALFORMED),
        ("counts", lambda counts: counts.__setitem__(1, -1), Reason.MALFORMED),
    ],
    ids=["not-psd", "indefinite-near-zero", "not-symmetric", "nan-mean", "inf-cov", "count-above-registered",
         "negative-count"],
)
def test_validate_update_rejects_bad_statistics(name: str, change, reason: Reason) -> None:
    # Prepare
    server = DcPflServer(Hyper(), CONTEXT)
    genuine, registered = _genuine_upload()
    server.validate_update("dev000", genuine, {"num_examples": registered}, registered)
    bad = _tampered(genuine, name, change)

    # Execute / Assert
    with pytest.raises(ValidationError) as raised:
        server.validate_update("dev000", bad, {"num_examples": registered}, registered)
    assert raised.value.reason is reason


def test_validate_update_rejects_negative_variances_in_diag_mode() -> None:
    # Prepare
    hyper = Hyper(covariance="diag", transport="fp16")
    server = DcPflServer(hyper, CONTEXT)
    genuine, registered = _genuine_upload(hyper)
    server.validate_update("dev000", genuine, {"num_examples": registered}, registered)
    bad = _tampered(genuine, "var", lambda var: var.__setitem__((0, 0), -1.0))

    # Execute / Assert
    with pytest.raises(ValidationError, match="negative"):
        server.validate_update("dev000", bad, {"num_examples": registered}, registered)


def test_hyper_rejects_an_unknown_covariance_mode() -> None:
    with pytest.raises(ValueError, match="lowrank"):
        Hyper(covariance="lowrank:0")


# -- heterogeneous bodies ------------------------------------------------------------------------
def _synthetic(task: TaskSpec, seed: int) -> ClientData:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(24, 1, 28, 28)).astype(np.float32)
    y = np.tile(np.arange(task.num_classes), 6).astype(np.int64)
    x[:, 0, :4, :4] += y[:, None, None]  # a learnable cue
    return ClientData(x[:16], y[:16], x[16:], y[16:], task)


def test_heterogeneous_bodies_share_the_classifier() -> None:
    # Prepare: 28x28 data, bodies cnn28 and resnet18 (both d = 512) handed out round-robin;
    # diagonal covariances keep the 512 x 512 eigendecompositions out of validation
    task = dataclasses.replace(DIGITS, name="synthetic28", input_shape=(1, 28, 28), num_classes=4,
                               class_names=("0", "1", "2", "3"))
    hyper = Hyper(body_models="cnn28,resnet18", covariance="diag", virtual_features=100)
    server = DcPflServer(hyper, ServerContext(model="cnn28", task=task, seed=0, rounds=2, clients=3))
    settings = dataclasses.replace(SETTINGS, model="cnn28")
    devices = {cid: DcPflDevice(hyper, settings, _synthetic(task, i), "cpu", i, server.assignment(cid))
               for i, cid in enumerate(["a", "b", "c"])}

    # Execute: two rounds, then the deployed models
    for round_ in (1, 2):
        play_round(server, devices, round_)
    metrics = [device.evaluate(Task(2, server.eval_groups(), {"final": True})) for device in devices.values()]

    # Assert
    assert [d.network_spec() for d in devices.values()] == ["cnn28", "resnet18", "cnn28"]
    assert server.assignment("b") == {"model": "resnet18"}
    assert all(0.0 <= m["accuracy"] <= 1.0 and m["num_test"] == 8 for m in metrics)
    assert server.state[GLOBAL_MEANS]["has_mean"].all()
    head = server.state[SHARED]["head.weight"]
    for device in devices.values():
        np.testing.assert_array_equal(cast(nn.Linear, device.model.head).weight.detach().numpy(), head)


def test_body_models_must_share_the_feature_dimension() -> None:
    with pytest.raises(ValueError, match="feature dimension"):
        DcPflServer(Hyper(body_models="cnn8,resnet18"), CONTEXT)
