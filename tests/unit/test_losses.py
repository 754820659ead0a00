"""Unit tests for `edge_sdk.losses.supcon_loss` and `edge_sdk.augment` (two-view augmentation).

The loss is checked against a literal loop over anchors (`tests/objectives.py`): Khosla et al.'s
Eq. 2 (`out`) and RepPer's Eq. 5 (`in`), anchors without positives left out of the mean.
"""

from __future__ import annotations


import pytest
import torch

from edge_sdk.augment import random_affine, random_crop_flip, two_views
from edge_sdk.losses import supcon_loss
from objectives import supcon


@pytest.mark.parametrize("variant", ["out", "in"])
@pytest.mark.parametrize(("views", "labels"), [
    (2, [0, 1, 0, 2, 1, 0]),  # every anchor has its other view as a positive
    (1, [0, 1, 0, 2, 1, 0]),  # label 2 appears once: that anchor has no positive
    (3, [4, 4, 4, 4]),  # one class only
])
def test_supcon_matches_the_equations_anchor_by_anchor(variant: str, views: int, labels: list[int]) -> None:
    # Prepare
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(len(labels), views, 5, generator=generator, dtype=torch.float64)
    y = torch.tensor(labels)

    # Execute
    loss = supcon_loss(features, y, temperature=0.1, variant=variant)

    # Assert
    assert float(loss) == pytest.approx(float(supcon(features, y, 0.1, variant)), rel=1e-9)


def test_supcon_variants_differ_with_several_positives_and_agree_with_one() -> None:
    # Prepare
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(4, 2, 6, generator=generator, dtype=torch.float64)

    # Execute
    several = [supcon_loss(features, torch.tensor([0, 0, 1, 1]), 0.1, v) for v in ("out", "in")]
    one = [supcon_loss(features, torch.tensor([0, 1, 2, 3]), 0.1, v) for v in ("out", "in")]

    # Assert: log of a mean >= mean of logs (Jensen), equal with a single positive per anchor
    assert float(several[0]) > float(several[1])
    assert float(one[0]) == pytest.approx(float(one[1]), rel=1e-12)


@pytest.mark.parametrize("variant", ["out", "in"])
def test_supcon_gradient_is_finite_with_anchors_without_positives(variant: str) -> None:
    # Prepare
    features = torch.randn(4, 1, 3, generator=torch.Generator().manual_seed(2), requires_grad=True)

    # Execute
    supcon_loss(features, torch.tensor([0, 0, 1, 2]), 0.1, variant).backward()

    # Assert
    assert features.grad is not None
    assert torch.isfinite(features.grad).all()
    assert features.grad[2:].abs().sum() > 0  # negatives of the anchors with positives still get gradient


def test_supcon_without_any_positive_is_zero_and_differentiable() -> None:
    # Prepare
    features = torch.randn(3, 1, 4, generator=torch.Generator().manual_seed(3), requires_grad=True)

    # Execute
    loss = supcon_loss(features, torch.tensor([0, 1, 2]), 0.1, "in")
    loss.backward()

    # Assert
    assert float(loss.detach()) == 0.0
    assert features.grad is not None and torch.equal(features.grad, torch.zeros_like(features))


def test_supcon_is_invariant_to_feature_scale() -> None:
    # Prepare
    features = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 0, 2])

    # Execute
    plain, scaled = supcon_loss(features, labels, 0.2), supcon_loss(features * 7.5, labels, 0.2)

    # Assert
    assert float(plain) == pytest.approx(float(scaled), rel=1e-12)


@pytest.mark.parametrize(("shape", "variant"), [((4, 3), "out"), ((4, 2, 3), "sideways")])
def test_supcon_rejects_bad_shapes_and_variants(shape: tuple[int, ...], variant: str) -> None:
    # Prepare
    features = torch.zeros(shape)

    # Execute / Assert
    with pytest.raises(ValueError):
        supcon_loss(features, torch.zeros(4, dtype=torch.long), 0.1, variant)


# -- two_views -----------------------------------------------------------------------------

@pytest.mark.parametrize(("channels", "size"), [(1, 8), (1, 28), (3, 32)])
def test_two_views_shape_and_dtype(channels: int, size: int) -> None:
    # Prepare
    x = torch.randn(5, channels, size, size, generator=torch.Generator().manual_seed(0))

    # Execute
    views = two_views(x, channels, torch.Generator().manual_seed(1))

    # Assert
    assert views.shape == (5, 2, channels, size, size)
    assert views.dtype == x.dtype
    assert torch.isfinite(views).all()


@pytest.mark.parametrize(("channels", "size"), [(1, 8), (3, 32)])
def test_two_views_are_deterministic_per_seed_and_differ(channels: int, size: int) -> None:
    # Prepare
    x = torch.randn(6, channels, size, size, generator=torch.Generator().manual_seed(0))

    # Execute
    first = two_views(x, channels, torch.Generator().manual_seed(7))
    again = two_views(x, channels, torch.Generator().manual_seed(7))
    other = two_views(x, channels, torch.Generator().manual_seed(8))

    # Assert
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert not torch.allclose(first[:, 0], first[:, 1])  # the two views of an image differ
    assert not torch.allclose(first[:, 0], x)


def test_random_affine_without_change_is_the_identity() -> None:
    # Prepare
    x = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))

    # Execute
    out = random_affine(x, torch.Generator().manual_seed(1), degrees=0.0, shift=0.0, scale=(1.0, 1.0))

    # Assert
    assert torch.allclose(out, x, atol=1e-5)


def test_random_affine_keeps_the_background_value() -> None:
    # Prepare: a constant (normalized) background: shifting and rotating must not bring in zeros
    x = torch.full((4, 1, 8, 8), -0.81)

    # Execute
    out = random_affine(x, torch.Generator().manual_seed(2))

    # Assert
    assert torch.allclose(out, x, atol=1e-5)


def test_random_crop_flip_without_padding_only_flips() -> None:
    # Prepare
    x = torch.randn(16, 3, 6, 6, generator=torch.Generator().manual_seed(0))

    # Execute
    out = random_crop_flip(x, torch.Generator().manual_seed(3), padding=0)

    # Assert
    flipped = [torch.equal(o, xi.flip(2)) for o, xi in zip(out, x, strict=True)]
    kept = [torch.equal(o, xi) for o, xi in zip(out, x, strict=True)]
    assert all(f or k for f, k in zip(flipped, kept, strict=True))
    assert any(flipped) and any(kept)
