"""torchvision's ResNet-18 and MobileNetV3-Small adapted to small images, as feature bodies.

Weights are always random (`weights=None`): devices have no internet, and federated runs train from
scratch. torchvision is imported inside the builders so that importing the registry stays cheap.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

RESNET18_FEATURES = 512
MOBILENET_V3_SMALL_FEATURES = 576
_SMALL_IMAGE_MAX = 32  # images up to this size keep full resolution in MobileNet's stem


def resnet18_body(in_channels: int) -> tuple[nn.Module, int]:
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool (CIFAR style) and no classifier."""
    from torchvision.models import resnet18

    model = resnet18(weights=None)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    model.fc = nn.Identity()
    return model, RESNET18_FEATURES


def mobilenet_v3_small_body(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """MobileNetV3-Small features + global average pool, without torchvision's classifier.

    The stem convolution takes `in_channels` inputs and, for images of at most 32 px, stride 1 so
    that small images are not downsampled to nothing.
    """
    from torchvision.models import mobilenet_v3_small

    model = mobilenet_v3_small(weights=None)
    stem: nn.Conv2d = model.features[0][0]
    stride = 1 if image_size <= _SMALL_IMAGE_MAX else 2
    new_stem = nn.Conv2d(
        in_channels, stem.out_channels, kernel_size=(stem.kernel_size[0], stem.kernel_size[1]), stride=stride,
        padding=stem.padding if isinstance(stem.padding, str) else (stem.padding[0], stem.padding[1]), bias=False,
    )
    nn.init.kaiming_normal_(new_stem.weight, mode="fan_out")
    model.features[0][0] = new_stem
    body = nn.Sequential(
        OrderedDict(features=model.features, avgpool=model.avgpool, flatten=nn.Flatten())
    )
    return body, MOBILENET_V3_SMALL_FEATURES
