"""Unit tests for model factories: resolving a spec, declaring a split, measuring the feature
dimension, and the signature comparison the coordinator refuses mismatching devices with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import user_models
from edge_sdk.data.task import TaskSpec
from edge_sdk.models import (
    BUILTINS,
    ModelError,
    PartedNet,
    build_body,
    build_model,
    first_mismatch,
    model_signature,
    resolve_factory,
    split,
)
from edge_sdk.models.signature import Signature

WINE = TaskSpec("wine", "features", (13,), 3, ("a", "b", "c"), (0.0,) * 13, (1.0,) * 13)
CAMERA = TaskSpec("camera", "image", (3, 12, 10), 7, tuple("abcdefg"), (0.5,) * 3, (0.25,) * 3)
VIBRATION = TaskSpec("vibration", "signal", (2, 40), 4, tuple("abcd"), (0.0,) * 2, (1.0,) * 2)


# -- resolve_factory ---------------------------------------------------------------------------
def test_a_builtin_name_resolves_to_its_factory() -> None:
    assert resolve_factory("cnn8") is BUILTINS["cnn8"]


def test_auto_resolves_from_the_task() -> None:
    assert resolve_factory("auto", VIBRATION) is BUILTINS["cnn1d"]
    with pytest.raises(ModelError, match="auto.*task"):
        resolve_factory("auto")


def test_an_import_path_resolves_to_the_module_attribute() -> None:
    assert resolve_factory("user_models:tiny_mlp") is user_models.tiny_mlp


def test_a_callable_is_its_own_factory() -> None:
    assert resolve_factory(user_models.tiny_cnn) is user_models.tiny_cnn


def test_an_entry_point_of_an_installed_distribution_resolves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a distribution that declares `tiny = user_models:tiny_mlp` in group edgepfl.models
    info = tmp_path / "fake_models-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-models\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[edgepfl.models]\ntiny = user_models:tiny_mlp\nbroken = no_such_module:f\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    # Execute
    factory = resolve_factory("tiny")

    # Assert
    assert factory is user_models.tiny_mlp
    with pytest.raises(ModelError, match="'broken'.*no_such_module:f.*does not load"):
        resolve_factory("broken")


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_package.nets:tiny", "'no_such_package.nets:tiny'.*cannot import module 'no_such_package.nets'"),
    ("user_models:missing", "'user_models:missing'.*has no attribute 'missing'"),
    ("user_models:NOT_A_FACTORY", "'user_models:NOT_A_FACTORY'.*int, not a factory"),
    ("vgg11", "unknown model 'vgg11'.*cnn8.*entry-point group 'edgepfl.models'"),
])
def test_a_spec_that_does_not_resolve_is_named_with_the_reason(spec: str, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        resolve_factory(spec)


# -- split and the feature dimension -------------------------------------------------------------
def test_split_of_a_sequential_keeps_the_forward_and_names_the_parts() -> None:
    # Prepare
    seq = nn.Sequential(nn.Linear(13, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 13)
    expected = seq(x)

    # Execute
    model = build_model(lambda task: split(seq, head="2"), WINE)

    # Assert
    assert isinstance(model, PartedNet) and model.feature_dim == 8
    assert {k.split(".", 1)[0] for k in model.state_dict()} == {"body", "head"}
    assert model.head.weight.shape == (3, 8)
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize(("builder", "head", "feature_dim"), [
    ("resnet18", "fc", 512),
    ("mobilenet_v3_small", "classifier.3", 1024),
    ("mobilenet_v3_small", "classifier", 576),
])
def test_split_of_torchvision_models(builder: str, head: str, feature_dim: int) -> None:
    # Prepare
    import torchvision.models

    def factory(task: TaskSpec) -> nn.Module:
        return split(getattr(torchvision.models, builder)(weights=None, num_classes=task.num_classes), head=head)

    # Execute
    model = build_model(factory, CAMERA, seed=0).eval()
    logits = model(torch.randn(2, *CAMERA.input_shape))

    # Assert
    assert model.feature_dim == feature_dim
    assert logits.shape == (2, CAMERA.num_classes)
    assert all(key.startswith(("body.", "head.")) for key in model.state_dict())


def test_a_module_with_body_and_head_children_is_used_as_it_is() -> None:
    # Prepare
    module = user_models.AttentionNet(WINE)

    # Execute
    model = build_model(lambda task: module, WINE)

    # Assert
    assert model.body is module.body and model.head is module.head
    assert model.feature_dim == 13


def test_a_split_naming_no_submodule_lists_the_submodules() -> None:
    with pytest.raises(ModelError, match="no submodule 'fc'.*0, 1, 2"):
        split(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), head="fc")


def test_a_module_without_a_split_is_refused_with_the_fix() -> None:
    with pytest.raises(ModelError, match="without `body` and `head`.*split\\(model, head="):
        build_model(lambda task: nn.Sequential(nn.Linear(13, 3)), WINE)


def test_state_outside_the_parts_is_refused_by_name() -> None:
    # Prepare
    module = user_models.AttentionNet(WINE)
    module.temperature = nn.Parameter(torch.ones(1))

    # Execute / Assert
    with pytest.raises(ModelError, match="'temperature' lies outside `body` and `head`"):
        build_model(lambda task: module, WINE)


def test_a_body_whose_output_is_not_flat_features_is_refused() -> None:
    # Prepare: a conv body without pooling and flatten
    def factory(task: TaskSpec) -> nn.Module:
        return split(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(8, 7)), head="1")

    # Execute / Assert
    with pytest.raises(ModelError, match=r"\[2, 4, 10, 8\].*not features \[B, D\]"):
        build_model(factory, CAMERA)


@pytest.mark.parametrize(("task", "name", "feature_dim"), [(WINE, "mlp", 128), (VIBRATION, "cnn1d", 128),
                                                            (CAMERA, "cnn_adaptive", 128), (CAMERA, "mlp", 128)])
def test_builtins_for_other_kinds_of_task(task: TaskSpec, name: str, feature_dim: int) -> None:
    # Execute
    model = build_model(name, task, seed=0).eval()
    logits = model(torch.randn(3, *task.input_shape))

    # Assert
    assert model.feature_dim == feature_dim
    assert logits.shape == (3, task.num_classes)


def test_a_builtin_refuses_a_task_kind_it_cannot_take() -> None:
    with pytest.raises(ModelError, match="'cnn1d' takes signal tasks, not the features task 'wine'"):
        build_model("cnn1d", WINE)
    with pytest.raises(ModelError, match="'cnn8' takes images of size 8x8, not 12x10"):
        build_model("cnn8", CAMERA)


def test_a_user_factory_builds_the_same_weights_for_the_same_seed() -> None:
    # Execute
    a, b = (build_model("user_models:tiny_cnn", CAMERA, seed=5).state_dict() for _ in range(2))
    c = build_model("user_models:tiny_cnn", CAMERA, seed=6).state_dict()

    # Assert
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_build_body_of_a_user_factory_is_its_body() -> None:
    # Execute
    body, feature_dim = build_body("user_models:tiny_mlp", WINE, seed=0)

    # Assert
    assert feature_dim == 32
    assert body(torch.randn(4, 13)).shape == (4, 32)


# -- signatures ----------------------------------------------------------------------------------
def test_equal_models_have_no_mismatch() -> None:
    signature = model_signature(build_model("user_models:tiny_mlp", WINE))
    assert first_mismatch(signature, model_signature(build_model("user_models:tiny_mlp", WINE))) is None


def test_the_first_mismatching_parameter_is_named() -> None:
    # Prepare: the same MLP on a task with another number of features
    narrower = TaskSpec("wine10", "features", (10,), 3, ("a", "b", "c"), (0.0,) * 10, (1.0,) * 10)
    expected = model_signature(build_model("user_models:tiny_mlp", WINE))

    # Execute
    message = first_mismatch(expected, model_signature(build_model("user_models:tiny_mlp", narrower)))

    # Assert
    assert message == "parameter 'body.1.weight': the coordinator's has shape [32, 13], this one [32, 10]"


def test_another_architecture_is_named_by_its_first_differing_name() -> None:
    # Prepare: the built-in mlp has a second hidden layer where tiny_mlp has its head
    expected = model_signature(build_model("mlp", WINE))
    actual = expected[:2] + [("head.weight", (3, 128)), ("head.bias", (3,))]

    # Execute
    message = first_mismatch(expected, actual)

    # Assert
    assert message == ("parameter 2: the coordinator's model has 'body.3.weight' [128, 128], "
                       "this one 'head.weight' [3, 128]")


def test_a_missing_parameter_is_named() -> None:
    expected: Signature = [("body.0.weight", (4, 2)), ("head.weight", (3, 4))]
    message = first_mismatch(expected, expected[:1])
    assert message is not None and "'head.weight' [3, 4] of the coordinator's model is missing" in message
