"""Unit tests for DualFed's mechanics on tiny digits data, without a broker.

The stage-wise local round freezes what it must, the ensemble is Eq. (5) (or the logit sum),
the server weights uniformly or by examples, and personal names never leave the device.
"""

from __future__ import annotations

import math
from typing import Literal, cast

import msgpack
import numpy as np
import pytest
import torch
from torch import nn

from builtin_tasks import DIGITS, digits_client
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms.dualfed import DualFedServer
from coordinator.rounds.inprocess import FixedUpdate, play_round
from edge_sdk import wire
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.dualfed import DualFedDevice, Hyper, ensemble
from edge_sdk.algorithms.part_sharing import SHARED
from edge_sdk.models import statistics_keys
from edge_sdk.protocol import Envelope, Kind

SETTINGS = TrainSettings(model="cnn8", rounds=3, local_epochs=1, batch_size=32, lr=0.05, seed=0)
DEFAULT_HYPER = Hyper()
"""The algorithm's default hyperparameters."""


def make_device(index: int = 0, hyper: Hyper = DEFAULT_HYPER) -> DualFedDevice:
    data = digits_client(index, num_clients=10, partition="dirichlet", seed=0)
    return DualFedDevice(hyper, SETTINGS, data, "cpu", client_seed=100 + index)


def make_server(hyper: Hyper = DEFAULT_HYPER) -> DualFedServer:
    return DualFedServer(hyper, ServerContext("cnn8", DIGITS, seed=0, rounds=3, clients=10))


def snapshot(module: nn.Module, part: str) -> dict[str, torch.Tensor]:
    """Parameters and buffers of one part."""
    return {k: v.detach().clone() for k, v in getattr(module, part).state_dict().items()}


def unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(before[k], after[k]) for k in before)


def test_the_model_has_exactly_the_four_parts() -> None:
    # Prepare / Execute
    model = make_device().model

    # Assert
    assert [name for name, _ in model.named_children()] == ["body", "projector", "head", "global_head"]
    assert isinstance(model.projector, nn.Sequential)
    kinds = [type(m) for m in model.projector]
    assert kinds == [nn.Linear, nn.ReLU, nn.BatchNorm1d, nn.Linear, nn.BatchNorm1d]
    first, last = cast(nn.Linear, model.projector[0]), cast(nn.Linear, model.projector[3])
    assert (first.in_features, first.out_features) == (128, 64)
    assert (last.in_features, last.out_features) == (64, 128)
    assert model.head.in_features == model.global_head.in_features == 128


def test_stage_a_trains_the_main_branch_with_the_global_head_frozen() -> None:
    # Prepare
    device = make_device()
    before = {part: snapshot(device.model, part) for part in ("body", "projector", "head", "global_head")}

    # Execute
    loss = device.train_main_branch(device.generator(1))

    # Assert
    after = {part: snapshot(device.model, part) for part in before}
    assert np.isfinite(loss)
    assert unchanged(before["global_head"], after["global_head"])
    for part in ("body", "projector", "head"):
        assert not unchanged(before[part], after[part]), part


def test_stage_b_trains_the_global_head_with_everything_else_frozen() -> None:
    # Prepare
    device = make_device()
    device.train_main_branch(device.generator(1))
    before = {part: snapshot(device.model, part) for part in ("body", "projector", "head", "global_head")}

    # Execute
    loss = device.train_global_head(device.generator(2))

    # Assert: parameters and BatchNorm statistics of the main branch do not move
    after = {part: snapshot(device.model, part) for part in before}
    assert np.isfinite(loss)
    for part in ("body", "projector", "head"):
        assert unchanged(before[part], after[part]), part
    assert not unchanged(before["global_head"], after["global_head"])


def test_fit_uploads_body_and_global_head_only() -> None:
    # Prepare
    server, device = make_server(), make_device()

    # Execute
    result = device.fit(Task(1, server.state, {"selected": ["dev000"]}))

    # Assert
    uploaded = set(result.groups[SHARED])
    assert set(result.groups) == {SHARED}
    assert {key.split(".", 1)[0] for key in uploaded} == {"body", "global_head"}
    assert uploaded.isdisjoint(statistics_keys(device.model))
    assert uploaded == set(server.update_spec(1)[SHARED])
    assert result.metrics["num_examples"] == device.data.num_train


def test_personal_names_never_appear_in_the_encoded_upload() -> None:
    # Prepare
    server, device = make_server(), make_device()
    result = device.fit(Task(1, server.state, {"selected": ["dev000"]}))

    # Execute
    payload = wire.encode(Envelope(Kind.TRAIN_RES, "dev000", groups=result.groups, metrics=result.metrics))

    # Assert: keys travel as msgpack strings ("head.weight" is also a substring of the shared
    # "global_head.weight", so the check is on the encoded string, length prefix included)
    personal = device.partition.personal
    assert any(k.startswith("projector.") for k in personal) and "head.weight" in personal
    for key in device.partition.shared:
        assert msgpack.packb(key) in payload
    for key in personal:
        assert msgpack.packb(key) not in payload
    assert b"projector" not in payload and b"running_mean" not in payload


def _softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def test_ensemble_sums_probabilities_or_logits() -> None:
    # Prepare: a case where the two rules disagree
    g, p = [0.0, 3.0, 4.0], [3.0, 0.0, 0.0]
    expected_prob = [a + b for a, b in zip(_softmax(g), _softmax(p), strict=True)]  # [0.9227, 0.3107, 0.7667]

    # Execute
    prob = ensemble(torch.tensor([g], dtype=torch.float64), torch.tensor([p], dtype=torch.float64), "prob")
    logit = ensemble(torch.tensor([g]), torch.tensor([p]), "logit")

    # Assert
    assert prob[0].tolist() == pytest.approx(expected_prob, rel=1e-12)
    assert logit[0].tolist() == [3.0, 3.0, 4.0]
    assert int(prob.argmax()) == 0 and int(logit.argmax()) == 2


def test_evaluate_reports_the_ensemble_and_the_global_classifier() -> None:
    # Prepare
    server, device = make_server(), make_device()
    device.fit(Task(1, server.state, {"selected": ["dev000"]}))
    model = device.model

    # Execute
    metrics = device.evaluate(Task(1, server.state, {"selected": [], "final": True}))

    # Assert
    model.eval()
    with torch.no_grad():
        g, p = model(device.test_x)
    expected = float((ensemble(g, p, "prob").argmax(1) == device.test_y).float().mean())
    expected_global = float((g.argmax(1) == device.test_y).float().mean())
    assert metrics["accuracy"] == pytest.approx(expected)
    assert metrics["global_accuracy"] == pytest.approx(expected_global)
    assert metrics["num_test"] == device.data.num_test


@pytest.mark.parametrize(("weighting", "expected"), [("uniform", 3.0), ("examples", 2.0)])
def test_server_weights_uniformly_or_by_examples(weighting: Literal["uniform", "examples"], expected: float) -> None:
    # Prepare
    server = make_server(Hyper(weighting=weighting))
    first = {k: np.full_like(v, 1.0) for k, v in server.state[SHARED].items()}
    second = {k: np.full_like(v, 5.0) for k, v in server.state[SHARED].items()}

    # Execute
    play_round(server, {"a": FixedUpdate({SHARED: first}, 30), "b": FixedUpdate({SHARED: second}, 10)}, 1)

    # Assert: uniform (1 + 5) / 2 = 3; by examples (30 * 1 + 10 * 5) / 40 = 2
    assert all(np.allclose(v, expected) for v in server.state[SHARED].values())


@pytest.mark.parametrize(("lr", "expected"), [(0.01, 0.01), (None, SETTINGS.lr)])
def test_optimizer_uses_the_hyper_lr_or_the_run_lr(lr: float | None, expected: float) -> None:
    # Prepare
    device = make_device(hyper=Hyper(lr=lr))

    # Execute
    optimizer = device.optimizer(list(device.model.head.parameters()))

    # Assert
    assert optimizer.param_groups[0]["lr"] == expected
    assert optimizer.param_groups[0]["momentum"] == 0.5
