"""Unit tests for `edge_sdk.augment.task_views`: the contrastive algorithms' two views of a
sample of any task kind."""

from __future__ import annotations

import torch

from edge_sdk.augment import task_views, two_views
from edge_sdk.data.task import TaskSpec

IMAGES = TaskSpec("images", "image", (3, 12, 10), 2, ("a", "b"), (0.0,) * 3, (1.0,) * 3)
FEATURES = TaskSpec("tabular", "features", (13,), 2, ("a", "b"), (0.0,) * 13, (1.0,) * 13)
SIGNALS = TaskSpec("vibration", "signal", (2, 40), 2, ("a", "b"), (0.0,) * 2, (1.0,) * 2)


def test_images_get_the_image_augmentations() -> None:
    # Prepare
    x = torch.randn(4, 3, 12, 10, generator=torch.Generator().manual_seed(0))

    # Execute
    views = task_views(x, IMAGES, torch.Generator().manual_seed(1))

    # Assert
    torch.testing.assert_close(views, two_views(x, 3, torch.Generator().manual_seed(1)))


def test_signals_and_feature_vectors_get_two_different_jittered_views() -> None:
    for task in (FEATURES, SIGNALS):
        # Prepare
        x = torch.randn(8, *task.input_shape, generator=torch.Generator().manual_seed(0))

        # Execute
        views = task_views(x, task, torch.Generator().manual_seed(1))
        again = task_views(x, task, torch.Generator().manual_seed(1))

        # Assert: the shape, reproducible, two different views, both close to the sample
        assert views.shape == (8, 2, *task.input_shape)
        torch.testing.assert_close(views, again)
        assert not torch.allclose(views[:, 0], views[:, 1])
        assert (views - x.unsqueeze(1)).abs().mean() < 0.5 * x.abs().mean()
