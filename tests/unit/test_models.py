"""Unit tests for the model registry: shapes, named parts, BN statistics, seeding, usability."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from edge_sdk.data.task import TaskSpec

from edge_sdk.models import (
    MODEL_NAMES,
    PartedNet,
    build_body,
    build_model,
    count_parameters,
    default_model_for,
    part_keys,
    state_nbytes,
    statistics_keys,
)

# (name, in_channels, image_size): every model at a size it takes; torchvision ones at two sizes.
CASES = [
    ("cnn8", 1, 8),
    ("cnn28", 1, 28),
    ("cnn32", 3, 32),
    ("resnet18", 1, 28),
    ("resnet18", 3, 32),
    ("mobilenet_v3_small", 1, 28),
    ("mobilenet_v3_small", 3, 32),
]
EXPECTED_FEATURES = {"cnn8": 128, "cnn8_wide": 128, "cnn28": 512, "cnn32": 512, "resnet18": 512,
                     "mobilenet_v3_small": 576, "cnn_adaptive": 128, "cnn1d": 128, "mlp": 128}
STAT_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked")


def image_task(channels: int, size: int, height: int | None = None) -> TaskSpec:
    """A 10-class image task of `channels` x `height` (default `size`) x `size` pixels."""
    return TaskSpec("images", "image", (channels, height or size, size), 10, tuple(str(i) for i in range(10)),
                    (0.5,) * channels, (0.25,) * channels)


def test_model_names_are_the_registry() -> None:
    assert MODEL_NAMES == ("cnn8", "cnn8_wide", "cnn28", "cnn32", "resnet18", "mobilenet_v3_small",
                           "cnn_adaptive", "cnn1d", "mlp")


@pytest.mark.parametrize(("name", "channels", "size"), CASES)
def test_model_maps_inputs_to_logits_and_features(name: str, channels: int, size: int) -> None:
    # Prepare
    model = build_model(name, image_task(channels, size), seed=0)
    x = torch.randn(2, channels, size, size)

    # Execute
    logits = model(x)
    features = model.features(x)

    # Assert
    assert isinstance(model, PartedNet)
    assert model.feature_dim == EXPECTED_FEATURES[name]
    assert logits.shape == (2, 10)
    assert features.shape == (2, model.feature_dim)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", [n for n in MODEL_NAMES if n != "cnn1d"])
def test_build_body_returns_the_feature_dim(name: str) -> None:
    # Prepare
    size = {"cnn8": 8, "cnn8_wide": 8, "cnn28": 28}.get(name, 32)

    # Execute
    body, feature_dim = build_body(name, image_task(3, size))
    out = body.eval()(torch.randn(2, 3, size, size))

    # Assert
    assert feature_dim == EXPECTED_FEATURES[name]
    assert out.shape == (2, feature_dim)


@pytest.mark.parametrize(("name", "channels", "size"), CASES[:5])
def test_parts_partition_the_state_dict(name: str, channels: int, size: int) -> None:
    # Prepare
    model = build_model(name, image_task(channels, size))

    # Execute
    parts = part_keys(model)

    # Assert
    assert set(parts) == {"body", "head"}
    all_keys = [k for keys in parts.values() for k in keys]
    assert sorted(all_keys) == sorted(model.state_dict())
    assert len(all_keys) == len(set(all_keys))
    assert all(k.startswith(f"{part}.") for part, keys in parts.items() for k in keys)
    assert parts["head"] == ["head.weight", "head.bias"]


def test_part_keys_rejects_state_outside_children() -> None:
    # Prepare
    model = build_model("cnn8", image_task(1, 8))
    model.scale = nn.Parameter(torch.ones(1))

    # Execute / Assert
    with pytest.raises(ValueError, match="scale"):
        part_keys(model)


def test_statistics_keys_finds_exactly_the_batchnorm_buffers() -> None:
    # Prepare
    model = build_model("cnn28", image_task(1, 28))
    parameter_keys = {name for name, _ in model.named_parameters()}

    # Execute
    keys = statistics_keys(model)

    # Assert: 2 BN layers x 3 buffers, all BN statistics, no weights
    assert len(keys) == 6
    assert all(k.startswith("body.") and k.endswith(STAT_SUFFIXES) for k in keys)
    assert not keys & parameter_keys
    assert {k.rsplit(".", 1)[0] for k in keys} == {
        name for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)
    }


def test_statistics_keys_goes_by_module_type_not_name() -> None:
    # Prepare: a non-BN module with a BN-like buffer name, and a BN without running stats
    class Impostor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("running_mean", torch.zeros(3))

    model = nn.Sequential(Impostor(), nn.BatchNorm1d(3), nn.BatchNorm1d(3, track_running_stats=False))

    # Execute
    keys = statistics_keys(model)

    # Assert
    assert keys == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}


@pytest.mark.parametrize("name", ["cnn32", "resnet18"])
def test_seeded_builds_are_reproducible_and_seed_dependent(name: str) -> None:
    # Prepare
    task = image_task(3, 32)
    torch.manual_seed(123)
    global_before = torch.random.get_rng_state()

    # Execute
    a = build_model(name, task, seed=7).state_dict()
    b = build_model(name, task, seed=7).state_dict()
    c = build_model(name, task, seed=8).state_dict()

    # Assert
    assert torch.equal(torch.random.get_rng_state(), global_before)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_seeded_builds_in_concurrent_threads_get_the_same_weights() -> None:
    # Prepare: devices of one process (threads) build their models at the same moment
    threads = 6
    start = threading.Barrier(threads)
    built: list[dict[str, torch.Tensor]] = []

    def build() -> None:
        start.wait()
        built.append(build_model("resnet18", image_task(1, 28), seed=7).state_dict())

    # Execute
    workers = [threading.Thread(target=build) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()

    # Assert
    reference = build_model("resnet18", image_task(1, 28), seed=7).state_dict()
    assert len(built) == threads
    assert all(torch.equal(state[k], reference[k]) for state in built for k in reference)


@pytest.mark.parametrize(("name", "size", "allowed"),
                         [("cnn8", 28, "8x8"), ("cnn28", 32, "28x28"), ("cnn32", 28, "32x32")])
def test_wrong_image_size_names_the_allowed_sizes(name: str, size: int, allowed: str) -> None:
    with pytest.raises(ValueError, match=allowed):
        build_model(name, image_task(1, size))


def test_unknown_model_lists_the_names() -> None:
    with pytest.raises(ValueError, match="vgg11.*cnn8.*mobilenet_v3_small"):
        build_body("vgg11", image_task(3, 32))


def test_default_model_for_each_kind_of_task() -> None:
    # Prepare
    signal = TaskSpec("vibration", "signal", (3, 50), 4, tuple("abcd"), (0.0,) * 3, (1.0,) * 3)
    features = TaskSpec("tabular", "features", (13,), 3, tuple("abc"), (0.0,) * 13, (1.0,) * 13)

    # Execute
    images = [default_model_for(image_task(1, s)) for s in (8, 28, 32)]
    others = [default_model_for(t) for t in (image_task(3, 64), image_task(3, 8, height=12), signal, features)]

    # Assert
    assert images == ["cnn8", "cnn28", "cnn32"]
    assert others == ["cnn_adaptive", "cnn_adaptive", "cnn1d", "mlp"]


def test_size_reports() -> None:
    # Prepare
    model = build_model("cnn8", image_task(1, 8))
    n_params = count_parameters(model)
    n_float_buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())

    # Execute
    nbytes = state_nbytes(model)

    # Assert: float state at 4 bytes each, plus 2 int64 num_batches_tracked counters
    assert n_params == (1 * 32 * 9) + 2 * 32 + (32 * 64 * 9) + 2 * 64 + (1024 * 128 + 128) + (128 * 10 + 10)
    assert nbytes == 4 * (n_params + n_float_buffers) + 2 * 8


def test_cnn8_learns_digits() -> None:
    # Prepare
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=0, stratify=digits.target
    )
    x_train, y_train = torch.from_numpy(x_train), torch.from_numpy(y_train)
    model = build_model("cnn8", image_task(1, 8), seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)

    # Execute: 5 epochs of mini-batch Adam
    model.train()
    for _ in range(5):
        for idx in torch.randperm(len(x_train), generator=generator).split(64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        predictions = model(torch.from_numpy(x_test)).argmax(dim=1).numpy()

    # Assert
    assert (predictions == y_test).mean() >= 0.9


def test_place_gives_conv_models_channels_last_weights_and_the_same_outputs() -> None:
    # Prepare
    from edge_sdk.training import place, state_arrays

    model = build_model("cnn32", image_task(3, 32), seed=0).eval()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    expected = model(x)
    keys = list(model.state_dict())
    arrays = state_arrays(model, keys)

    # Execute
    placed = place(model, torch.device("cpu"))
    linear = place(nn.Linear(4, 2), torch.device("cpu"))

    # Assert: NHWC weights, the same function, and state that leaves as ordinary C-ordered arrays
    conv_weight = placed.get_parameter("body.4.weight")  # the second convolution: 64 x 32 x 5 x 5
    assert conv_weight.is_contiguous(memory_format=torch.channels_last) and not conv_weight.is_contiguous()
    torch.testing.assert_close(placed(x), expected, rtol=1e-4, atol=1e-5)
    for key, value in state_arrays(placed, keys).items():
        assert value.flags["C_CONTIGUOUS"]
        np.testing.assert_array_equal(value, arrays[key])
    assert linear.weight.is_contiguous()
