"""Byzantine behaviour for robustness experiments: a device that corrupts what it uploads.

Used by `edgepfl simulate --adversaries K --attack ...` to measure what robust aggregation
buys; an honest device never imports it for anything else.
"""

from __future__ import annotations

import numpy as np

from .protocol import ArrayGroup

ATTACKS = ("sign_flip", "noise", "nan")
SIGN_FLIP_SCALE = 10.0


def corrupt(attack: str, uploaded: dict[str, ArrayGroup], received: dict[str, ArrayGroup],
            rng: np.random.Generator) -> dict[str, ArrayGroup]:
    """The upload an adversary sends instead of `uploaded`.

    sign_flip: the change from what came down, reversed and scaled by 10; noise: Gaussian noise of
    standard deviation 1 added; nan: every floating value NaN (the coordinator must reject it).
    """
    if attack not in ATTACKS:
        raise ValueError(f"attack must be one of {', '.join(ATTACKS)}, got {attack!r}")
    out: dict[str, ArrayGroup] = {}
    for group, arrays in uploaded.items():
        reference = received.get(group, {})
        out[group] = {}
        for key, value in arrays.items():
            if value.dtype.kind != "f":
                out[group][key] = value
                continue
            base = reference.get(key)
            base = base if base is not None and base.shape == value.shape else np.zeros_like(value)
            if attack == "sign_flip":
                corrupted = base - SIGN_FLIP_SCALE * (value - base)
            elif attack == "noise":
                corrupted = value + rng.normal(0.0, 1.0, value.shape)
            else:
                corrupted = np.full_like(value, np.nan)
            out[group][key] = corrupted.astype(value.dtype)
    return out
