"""Two-view augmentations for the contrastive algorithms, batched on the training device.

Grayscale digit-like images (digits, MNIST, Fashion-MNIST) get small random affine changes
(rotation, shift, scale); natural colour images (CIFAR) get a random crop after padding and a
horizontal flip. Inputs are normalized [B, C, H, W] tensors. Signals and feature vectors,
where a geometric change means nothing, get a random per-sample scale and Gaussian noise
(`task_views`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .data.task import TaskSpec


def family_of(channels: int) -> str:
    return "natural" if channels == 3 else "digits"


def random_affine(x: torch.Tensor, generator: torch.Generator, *, degrees: float = 10.0,
                  shift: float = 0.1, scale: tuple[float, float] = (0.9, 1.1)) -> torch.Tensor:
    """Each image rotated, shifted and scaled by its own small random amount."""
    b = x.shape[0]
    rand = torch.rand(b, 4, generator=generator).to(x.device)
    angle = (rand[:, 0] * 2 - 1) * math.radians(degrees)
    factor = scale[0] + rand[:, 1] * (scale[1] - scale[0])
    tx, ty = (rand[:, 2] * 2 - 1) * shift * 2, (rand[:, 3] * 2 - 1) * shift * 2
    cos, sin = torch.cos(angle) / factor, torch.sin(angle) / factor
    theta = torch.stack([torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    background = x.amin(dim=(1, 2, 3), keepdim=True)
    return F.grid_sample(x - background, grid, align_corners=False, padding_mode="zeros") + background


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, *, padding: int = 4) -> torch.Tensor:
    """Pad by `padding` (reflect), crop back to size at a random offset, flip half the images."""
    b, _, h, w = x.shape
    padded = F.pad(x, (padding,) * 4, mode="reflect")
    offsets = torch.randint(0, 2 * padding + 1, (b, 2), generator=generator)
    rows = (offsets[:, 0:1] + torch.arange(h)).to(x.device)
    cols = (offsets[:, 1:2] + torch.arange(w)).to(x.device)
    index = torch.arange(b, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[index, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    flip = (torch.rand(b, generator=generator) < 0.5).to(x.device)
    return torch.where(flip[:, None, None, None], out.flip(3), out)


def two_views(x: torch.Tensor, channels: int, generator: torch.Generator) -> torch.Tensor:
    """[B, C, H, W] -> [B, 2, C, H, W]: two independent augmentations of every image."""
    augment = random_crop_flip if family_of(channels) == "natural" else random_affine
    return torch.stack([augment(x, generator), augment(x, generator)], dim=1)


def jitter(x: torch.Tensor, generator: torch.Generator, *, scale: float = 0.1, noise: float = 0.1) -> torch.Tensor:
    """Each sample multiplied by its own factor 1 + scale * N(0, 1), plus noise * N(0, 1) per
    entry (inputs are normalized, so `noise` is in units of a feature's standard deviation)."""
    factor = 1.0 + scale * torch.randn((x.shape[0],) + (1,) * (x.dim() - 1), generator=generator)
    return x * factor.to(x.device) + noise * torch.randn(x.shape, generator=generator).to(x.device)


def task_views(x: torch.Tensor, task: TaskSpec, generator: torch.Generator) -> torch.Tensor:
    """[B, *input_shape] -> [B, 2, *input_shape]: two augmentations of every sample of `task`:
    `two_views` for images, `jitter` for signals and feature vectors."""
    if task.kind == "image":
        return two_views(x, task.channels, generator)
    return torch.stack([jitter(x, generator), jitter(x, generator)], dim=1)
