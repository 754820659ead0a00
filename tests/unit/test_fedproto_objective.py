"""FedProto's objectives against the paper's equations written out here: the device's Eq. (7)
(with the official code's MSE as L_R, Eq. 8), its local prototypes (Eq. 3) and what goes up, the
server's count-weighted global prototypes (Eq. 6) unsharded, in shard partial sums and as a
secure sum, the deployed model, and the personal state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from builtin_tasks import DIGITS, digits_client
from coordinator.aggregation.averaging import PartialSum
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms.fedproto import FedProtoServer
from coordinator.rounds.inprocess import FixedUpdate, play_round
from edge_sdk.algorithms.base import Task
from edge_sdk.algorithms.fedproto import GLOBAL_PROTOTYPES, PROTOTYPES, FedProtoDevice, local_prototypes
from edge_sdk.algorithms.hyper.fedproto import Hyper
from edge_sdk.protocol import ValidationError
from edge_sdk.secagg.vector import VectorLayout
from edge_sdk.settings import TrainSettings
from objectives import assert_same_objective, cross_entropy, snapshot, tiny_batch

LAM, CLASSES, DIM = 0.7, 10, 128
SETTINGS = TrainSettings(model="cnn8", rounds=2, local_epochs=1, batch_size=32, lr=0.05, seed=0)
CONTEXT = ServerContext(model="cnn8", task=DIGITS, seed=0, rounds=2, clients=3)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_device(index: int = 5, **hyper) -> FedProtoDevice:
    data = digits_client(index, num_clients=10, partition="dirichlet", seed=0)
    return FedProtoDevice(Hyper(**{"lam": LAM, **hyper}), SETTINGS, data, "cpu", client_seed=index)


def global_prototypes(present: np.ndarray) -> dict[str, np.ndarray]:
    """Seeded global prototypes for the classes in the boolean mask `present`, zeros elsewhere."""
    prototypes = np.random.default_rng(3).normal(size=(CLASSES, DIM)).astype(np.float32)
    return {"prototypes": np.where(present[:, None], prototypes, 0).astype(np.float32), "has_prototype": present}


def upload(counts: dict[int, int], means: dict[int, np.ndarray], num_examples: int) -> dict[str, np.ndarray]:
    """A device's upload written from its counts |D_j| and prototypes C^(j): shares and feature sums over N."""
    shares, sums = np.zeros(CLASSES), np.zeros((CLASSES, DIM))
    for c, n in counts.items():
        shares[c], sums[c] = n / num_examples, n / num_examples * means[c]
    return {"class_shares": shares.astype(np.float32), "feature_sums": sums.astype(np.float32)}


# -- the device: Eq. (7) --------------------------------------------------------------------------
def test_the_local_loss_is_eq_7_in_value_and_gradient() -> None:
    # Prepare: global prototypes for the even classes only
    device = make_device()
    device.model.train()
    x, y = tiny_batch(device.data, 10)
    arrays = global_prototypes(np.arange(CLASSES) % 2 == 0)
    prototypes, has_prototype = torch.from_numpy(arrays["prototypes"]), torch.from_numpy(arrays["has_prototype"])
    assert has_prototype[y].any() and not has_prototype[y].all()
    loss = device.local_loss((prototypes, has_prototype))

    def reference() -> torch.Tensor:
        z = device.model.body(x)
        logits = z @ device.model.head.weight.T + device.model.head.bias
        squared = [((z[i] - prototypes[int(c)]) ** 2).sum() if has_prototype[int(c)] else z[i].sum() * 0
                   for i, c in enumerate(y)]
        return cross_entropy(logits, y) + LAM * torch.stack(squared).sum() / (len(y) * DIM)

    # Execute / Assert
    assert_same_objective(lambda: loss(x, y), reference, dict(device.model.named_parameters()))


def test_without_global_prototypes_the_loss_is_cross_entropy_alone() -> None:
    # Prepare: the first round's state (no class has a prototype), and a mask with none in the batch
    device = make_device()
    device.model.train()
    x, y = tiny_batch(device.data, 10)
    first_round = Task(1, FedProtoServer(Hyper(), CONTEXT).task_groups(1), {})
    absent = np.ones(CLASSES, bool)
    absent[y.numpy()] = False
    arrays = global_prototypes(absent)
    others = device.local_loss((torch.from_numpy(arrays["prototypes"]), torch.from_numpy(arrays["has_prototype"])))

    def reference() -> torch.Tensor:
        return cross_entropy(device.model.body(x) @ device.model.head.weight.T + device.model.head.bias, y)

    # Execute / Assert
    assert device.global_prototypes(first_round) is None
    assert_same_objective(lambda: device.local_loss(None)(x, y), reference, dict(device.model.named_parameters()))
    assert_same_objective(lambda: others(x, y), reference, dict(device.model.named_parameters()))


def test_lambda_pulls_the_features_towards_the_global_prototypes() -> None:
    # Prepare: every class has a prototype
    near, free = make_device(lam=5.0), make_device(lam=0.0)
    arrays = global_prototypes(np.ones(CLASSES, bool))
    task = Task(2, {GLOBAL_PROTOTYPES: arrays}, {})

    # Execute
    near.fit(task)
    free.fit(task)

    # Assert
    def distance(device: FedProtoDevice) -> float:
        z = device.features(device.train_x)
        return float(((z - torch.from_numpy(arrays["prototypes"])[device.train_y]) ** 2).sum(dim=1).mean())

    assert distance(near) < distance(free)


# -- the device: Eq. (3) and the upload -----------------------------------------------------------
def test_the_upload_is_the_per_class_mean_features_with_their_counts_and_no_parameter() -> None:
    # Prepare
    device = make_device()
    before = snapshot(device.model)

    # Execute
    result = device.fit(Task(2, {GLOBAL_PROTOTYPES: global_prototypes(np.ones(CLASSES, bool))}, {}))

    # Assert: the prototypes of the trained body in evaluation mode, and nothing else
    assert any(not torch.equal(before[k], v) for k, v in device.model.state_dict().items())
    assert set(result.groups) == {PROTOTYPES}
    assert set(result.groups[PROTOTYPES]) == {"class_shares", "feature_sums"}
    assert not set(result.groups[PROTOTYPES]) & set(device.model.state_dict())
    assert sum(a.size for a in result.groups[PROTOTYPES].values()) == CLASSES * (DIM + 1)
    num_examples = int(result.metrics["num_examples"])
    counts, means = local_prototypes(result.groups[PROTOTYPES], num_examples)
    labels = device.data.train_y
    device.model.eval()
    with torch.no_grad():
        z = device.model.body(torch.from_numpy(device.data.train_x)).double().numpy()
    assert num_examples == len(labels)
    for c in range(CLASSES):
        assert counts[c] == (labels == c).sum(), c
        expected = z[labels == c].mean(axis=0) if counts[c] else np.zeros(DIM)
        np.testing.assert_allclose(means[c], expected, rtol=1e-5, atol=1e-5, err_msg=str(c))
    assert (counts == 0).any() and (counts > 0).sum() > 1  # a skewed device: absent classes are covered


# -- the server: Eq. (6) --------------------------------------------------------------------------
def upload_of(device: FixedUpdate) -> tuple[np.ndarray, np.ndarray]:
    """The counts and prototypes a FixedUpdate uploads."""
    return local_prototypes(device.groups[PROTOTYPES], device.num_examples)


def three_devices() -> tuple[dict[str, FixedUpdate], np.ndarray, np.ndarray]:
    """Three devices' uploads (class 9 held by nobody) and Eq. (6) written out: the global
    prototypes [C, d] and which classes have one."""
    rng = np.random.default_rng(4)
    held = {"dev000": ({0: 5, 1: 20, 2: 1}, 30), "dev001": ({1: 3, 3: 40}, 43), "dev002": ({0: 50, 3: 2, 4: 7}, 59)}
    means = {cid: {c: rng.normal(size=DIM) for c in counts} for cid, (counts, _) in held.items()}
    expected, present = np.zeros((CLASSES, DIM)), np.zeros(CLASSES, bool)
    for c in range(CLASSES):
        having = [cid for cid, (counts, _) in held.items() if c in counts]
        if having:
            total = sum(held[cid][0][c] for cid in having)
            expected[c] = sum(held[cid][0][c] * means[cid][c] for cid in having) / total
            present[c] = True
    devices = {cid: FixedUpdate({PROTOTYPES: upload(counts, means[cid], n)}, n) for cid, (counts, n) in held.items()}
    return devices, expected, present


def test_the_global_prototypes_are_the_count_weighted_means_over_the_devices_having_each_class() -> None:
    # Prepare
    server = FedProtoServer(Hyper(), CONTEXT)
    devices, expected, present = three_devices()
    device_mean = np.mean([upload_of(d)[1] for d in devices.values()], axis=0)

    # Execute: replies arrive in the reverse of id order
    play_round(server, dict(reversed(devices.items())), 1)

    # Assert
    state = server.state[GLOBAL_PROTOTYPES]
    np.testing.assert_array_equal(state["has_prototype"], present)
    assert not present[9] and not state["prototypes"][9].any()
    np.testing.assert_allclose(state["prototypes"], expected, rtol=1e-5, atol=1e-5)
    assert np.abs(device_mean[0] - expected[0]).max() > 0.1  # the counts matter, not just who has the class


def test_each_round_has_the_prototypes_of_its_own_reports_only() -> None:
    # Prepare
    server = FedProtoServer(Hyper(), CONTEXT)
    devices, _, _ = three_devices()
    play_round(server, devices, 1)

    # Execute: round 2 hears from dev001 only (classes 1 and 3)
    play_round(server, {"dev001": devices["dev001"]}, 2)

    # Assert
    state = server.state[GLOBAL_PROTOTYPES]
    np.testing.assert_array_equal(np.flatnonzero(state["has_prototype"]), [1, 3])
    np.testing.assert_allclose(state["prototypes"][[1, 3]], upload_of(devices["dev001"])[1][[1, 3]], rtol=1e-5,
                               atol=1e-5)


def test_shard_partial_sums_and_a_secure_sum_give_the_same_global_prototypes() -> None:
    # Prepare
    devices, expected, present = three_devices()
    sent = FedProtoServer(Hyper(), CONTEXT).task_groups(1)
    shards = [["dev000", "dev002"], ["dev001"]]
    sharded, secure = FedProtoServer(Hyper(), CONTEXT), FedProtoServer(Hyper(), CONTEXT)
    layout = VectorLayout(sharded.update_spec(1))
    largest = max(d.num_examples for d in devices.values())
    vectors = [layout.encode(d.groups, sent, 1e9, d.num_examples / largest) for d in devices.values()]

    # Execute: each shard sums its devices, the coordinator folds the partials; and the secure sum
    partials = []
    for members in shards:
        aggregator = FedProtoServer(Hyper(), CONTEXT)
        aggregator.begin_partial(1, sent)
        for cid in members:
            aggregator.accumulate(cid, devices[cid].groups, {}, devices[cid].num_examples)
        partials.append(aggregator.partial())
    sharded.begin_round(1)
    for partial in partials:
        sharded.fold_partial(1, partial)
    sharded.end_round(1)
    sums, weight = layout.decode(np.sum(vectors, axis=0))
    secure.begin_round(1)
    secure.fold_partial(1, {group: PartialSum(arrays, weight, len(vectors)) for group, arrays in sums.items()})
    secure.end_round(1)

    # Assert
    spec = sharded.partial_spec(1)[PROTOTYPES]
    assert all(value.dtype.name == spec[key][1] for p in partials for key, value in p[PROTOTYPES].sums.items())
    for server in (sharded, secure):
        state = server.state[GLOBAL_PROTOTYPES]
        np.testing.assert_array_equal(state["has_prototype"], present)
        np.testing.assert_allclose(state["prototypes"], expected, rtol=1e-5, atol=1e-5)


def test_an_upload_whose_class_shares_are_not_shares_is_refused() -> None:
    # Prepare
    server = FedProtoServer(Hyper(), CONTEXT)
    devices, _, _ = three_devices()
    good = devices["dev000"].groups

    def with_shares(shares: np.ndarray) -> dict:
        return {PROTOTYPES: {**good[PROTOTYPES], "class_shares": shares.astype(np.float32)}}

    # Execute / Assert
    server.validate_update("dev000", good, {}, 30)
    for shares in (np.full(CLASSES, 0.2), np.r_[-0.1, np.full(CLASSES - 1, 0.1)], np.r_[np.nan, np.zeros(9)]):
        with pytest.raises(ValidationError):
            server.validate_update("dev000", with_shares(shares), {}, 30)


# -- deployment -----------------------------------------------------------------------------------
def test_the_deployed_model_is_the_devices_own_and_prototype_accuracy_is_the_nearest_global_prototype() -> None:
    # Prepare: prototypes for classes 0-7 only
    device = make_device()
    device.fit(Task(1, {}, {}))
    present = np.arange(CLASSES) < 8
    arrays = global_prototypes(present)
    device.model.eval()
    with torch.no_grad():
        z = device.model.body(torch.from_numpy(device.data.test_x)).numpy()
    nearest = [min(np.flatnonzero(present), key=lambda c: np.linalg.norm(f - arrays["prototypes"][c])) for f in z]

    # Execute
    metrics = device.evaluate(Task(2, {GLOBAL_PROTOTYPES: arrays}, {}))
    first = device.evaluate(Task(1, FedProtoServer(Hyper(), CONTEXT).eval_groups(), {}))

    # Assert
    assert metrics["accuracy"] == device.test_accuracy(device.model) == first["accuracy"]
    assert metrics["prototype_accuracy"] == pytest.approx(np.mean(np.array(nearest) == device.data.test_y))
    assert "prototype_accuracy" not in first


def test_the_personal_state_is_the_whole_model_and_a_restart_keeps_it() -> None:
    # Prepare
    device = make_device()
    device.fit(Task(1, {}, {}))
    restarted = make_device()

    # Execute
    restarted.load_personal_state(device.personal_state())

    # Assert
    assert set(device.personal_state()) == set(device.model.state_dict())
    saved = snapshot(device.model)
    assert all(torch.equal(saved[k], v) for k, v in snapshot(restarted.model).items())
    task = Task(2, {GLOBAL_PROTOTYPES: global_prototypes(np.ones(CLASSES, bool))}, {})
    assert restarted.evaluate(task) == device.evaluate(task)


def test_no_body_is_held_so_a_release_is_refused_and_other_models_may_be_assigned() -> None:
    # Prepare
    server = FedProtoServer(Hyper(body_models="cnn8,mlp"), CONTEXT)
    assignments = [server.assignment(cid) for cid in ("dev000", "dev001", "dev002")]
    devices = {cid: FedProtoDevice(Hyper(), SETTINGS, digits_client(i, num_clients=3, partition="iid", seed=0),
                                   "cpu", client_seed=i, assignment=assignments[i])
               for i, cid in enumerate(("dev000", "dev001", "dev002"))}

    # Execute
    play_round(server, devices, 1)

    # Assert
    assert not server.shares_body()
    assert [a["model"] for a in assignments] == ["cnn8", "mlp", "cnn8"]
    assert devices["dev000"].model.state_dict().keys() != devices["dev001"].model.state_dict().keys()
    assert server.state[GLOBAL_PROTOTYPES]["has_prototype"].all()
    with pytest.raises(ValueError, match="feature dimension"):
        FedProtoServer(Hyper(body_models="cnn8,resnet18"), CONTEXT)
