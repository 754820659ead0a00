"""Small bodies: CNNs with BatchNorm for 8x8, 28x28, 32x32 and any-size images, a 1-D CNN for
signals and an MLP for feature vectors.

Each builder returns `(body, feature_dim)`: the body maps a batch of inputs to [B, feature_dim].
They are small enough to train on an edge device, and the CNNs' BatchNorm layers give the
personalization algorithms running statistics to keep local.
"""

from __future__ import annotations

from torch import nn


def _conv_bn_relu(in_channels: int, out_channels: int, kernel_size: int, padding: int) -> list[nn.Module]:
    """Return a conv-BN-ReLU triple; the conv has no bias because BatchNorm adds one."""
    return [
        nn.Conv2d(in_channels, out_channels, kernel_size, padding=padding, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(inplace=True),
    ]


def _two_convs_to_128(in_channels: int, pool: nn.Module) -> tuple[nn.Module, int]:
    """Two 3x3 conv-BN-ReLU blocks (32, 64 channels), `pool` down to 64 x 4 x 4, 128 features."""
    feature_dim = 128
    body = nn.Sequential(
        *_conv_bn_relu(in_channels, 32, kernel_size=3, padding=1),
        *_conv_bn_relu(32, 64, kernel_size=3, padding=1),
        pool,
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, feature_dim),
        nn.ReLU(inplace=True),
    )
    return body, feature_dim


def cnn8(in_channels: int) -> tuple[nn.Module, int]:
    """Body for 8x8 images (e.g. sklearn digits): two 3x3 convs, one pool, 128 features."""
    return _two_convs_to_128(in_channels, nn.MaxPool2d(2))


def cnn8_wide(in_channels: int) -> tuple[nn.Module, int]:
    """A wider 8x8 body (64 and 128 channels) with cnn8's 128 features: a second architecture for
    algorithms whose devices may differ in body (DC-PFL)."""
    feature_dim = 128
    body = nn.Sequential(
        *_conv_bn_relu(in_channels, 64, kernel_size=3, padding=1),
        *_conv_bn_relu(64, 128, kernel_size=3, padding=1),
        nn.MaxPool2d(2),  # 128 x 4 x 4
        nn.Flatten(),
        nn.Linear(128 * 4 * 4, feature_dim),
        nn.ReLU(inplace=True),
    )
    return body, feature_dim


def _fedavg_cnn(in_channels: int, flat_dim: int) -> tuple[nn.Module, int]:
    """PFLlib's FedAvgCNN feature extractor with BatchNorm; `flat_dim` depends on the image size."""
    feature_dim = 512
    body = nn.Sequential(
        *_conv_bn_relu(in_channels, 32, kernel_size=5, padding=0),
        nn.MaxPool2d(2),
        *_conv_bn_relu(32, 64, kernel_size=5, padding=0),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat_dim, feature_dim),
        nn.ReLU(inplace=True),
    )
    return body, feature_dim


def cnn28(in_channels: int) -> tuple[nn.Module, int]:
    """Body for 28x28 images (MNIST-like): 64 x 4 x 4 maps, 512 features."""
    return _fedavg_cnn(in_channels, flat_dim=64 * 4 * 4)


def cnn32(in_channels: int) -> tuple[nn.Module, int]:
    """Body for 32x32 images (CIFAR-like): 64 x 5 x 5 maps, 512 features."""
    return _fedavg_cnn(in_channels, flat_dim=64 * 5 * 5)


def cnn_adaptive(in_channels: int) -> tuple[nn.Module, int]:
    """Body for images of any H x W (e.g. a 96x64 camera): two 3x3 convs, then adaptive average
    pooling to 4 x 4 maps whatever the input size, 128 features."""
    return _two_convs_to_128(in_channels, nn.AdaptiveAvgPool2d(4))


def cnn1d(in_channels: int) -> tuple[nn.Module, int]:
    """Body for 1-D signals [C, L] of any length (e.g. vibration windows): two convs of width 5,
    adaptive average pooling to 8 steps, 128 features."""
    feature_dim = 128
    body = nn.Sequential(
        nn.Conv1d(in_channels, 32, kernel_size=5, padding=2, bias=False),
        nn.BatchNorm1d(32),
        nn.ReLU(inplace=True),
        nn.Conv1d(32, 64, kernel_size=5, padding=2, bias=False),
        nn.BatchNorm1d(64),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool1d(8),  # 64 x 8
        nn.Flatten(),
        nn.Linear(64 * 8, feature_dim),
        nn.ReLU(inplace=True),
    )
    return body, feature_dim


def mlp(in_features: int, hidden: int = 128) -> tuple[nn.Module, int]:
    """Body for flat feature vectors (or any input, flattened): two hidden layers of `hidden`."""
    body = nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
    )
    return body, hidden
