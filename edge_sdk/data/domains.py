"""Feature skew for the `domains` partition: each client sees its images through one transform.

Client k gets `DOMAIN_TRANSFORMS[k % 4]` with a strength fixed by (seed, k), so every device
derives the same domain for a client independently. Transforms work in [0, 1] pixel space
(before normalization); scipy is imported only when a transform needs it.
"""

from __future__ import annotations

import logging

import numpy as np

logger = logging.getLogger(__name__)

DOMAIN_TRANSFORMS = ("rotate", "invert", "noise", "blur")
NOISE_STD = 0.2
"""Standard deviation of the additive Gaussian noise, in [0, 1] pixel units."""


def apply_domain(x01: np.ndarray, client_index: int, seed: int) -> tuple[np.ndarray, str]:
    """Return client `client_index`'s transformed copy of images x01 [N, C, H, W] and its name.

    rotate: a fixed angle of 30..60 degrees (either direction); invert: 1 - x; noise: additive
    N(0, 0.2) noise from a (seed, client)-seeded generator; blur: a Gaussian of sigma ~1 at
    28 px, scaled with the image size. Results are clipped to [0, 1] and float32.
    """
    if client_index < 0:
        raise ValueError(f"client_index must be >= 0, got {client_index}")
    x01 = np.asarray(x01, dtype=np.float32)
    if x01.ndim != 4:
        raise ValueError(f"x01 must be [N, C, H, W], got shape {x01.shape}")
    name = DOMAIN_TRANSFORMS[client_index % len(DOMAIN_TRANSFORMS)]
    rng = np.random.default_rng(np.random.SeedSequence((seed, client_index)))
    if name == "rotate":
        from scipy import ndimage

        angle = rng.uniform(30.0, 60.0) * rng.choice((-1.0, 1.0))
        out = ndimage.rotate(x01, angle, axes=(3, 2), reshape=False, order=1, mode="constant")
        logger.debug("client %d: rotate by %.1f degrees", client_index, angle)
    elif name == "invert":
        out = 1.0 - x01
    elif name == "noise":
        out = x01 + rng.normal(0.0, NOISE_STD, size=x01.shape).astype(np.float32)
    else:
        from scipy import ndimage

        sigma = rng.uniform(0.8, 1.2) * x01.shape[-1] / 28.0
        out = ndimage.gaussian_filter(x01, sigma=(0, 0, sigma, sigma))
        logger.debug("client %d: blur with sigma %.2f", client_index, sigma)
    return np.clip(out, 0.0, 1.0).astype(np.float32, copy=False), name
