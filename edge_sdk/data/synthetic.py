"""A synthetic 3-axis vibration sensor: the built-in 1-D signal task, generated from a seed.

No real 1-D sensor data set ships offline in a light package (the time-series toolkits that bundle
small real sets pull in numba and pandas), so the signal task is synthetic and named so:
`synthetic_vibration`. A window is 128 samples of three accelerometer axes (x, y radial, z axial)
of a machine whose shaft turns at a random speed. The four classes differ in frequency content,
as the classic rotating-machine faults do:

- `normal`: the shaft's fundamental (1x) on every axis, small;
- `imbalance`: a strong 1x on the radial axes, in quadrature;
- `misalignment`: a strong 2x harmonic, largest on the axial axis;
- `bearing_fault`: short bursts of a high-frequency resonance, repeating at the fault rate.

Gaussian sensor noise is added everywhere, so the classes overlap a little. Numpy only; the same
seed gives the same arrays on every machine (numpy's PCG64 stream is stable).
"""

from __future__ import annotations

import numpy as np

VIBRATION_CLASSES: tuple[str, ...] = ("normal", "imbalance", "misalignment", "bearing_fault")
VIBRATION_AXES = 3
VIBRATION_LENGTH = 128
NOISE_STD = 0.5
RESONANCE = 0.31
"""The bearing resonance, in cycles per sample."""


def _burst_train(t: np.ndarray, rate: float, offset: float, decay: float) -> np.ndarray:
    """Decaying resonance bursts starting every 1/rate samples (from `offset`)."""
    since = (t - offset) % (1.0 / rate)
    return np.exp(-since / decay) * np.sin(2 * np.pi * RESONANCE * since)


def vibration_windows(per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`per_class` windows of each class in a seeded order: (x float32 [N, 3, 128], y int64 [N])."""
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    rng = np.random.default_rng(seed)
    y = rng.permutation(np.repeat(np.arange(len(VIBRATION_CLASSES), dtype=np.int64), per_class))
    t = np.arange(VIBRATION_LENGTH, dtype=np.float64)
    x = np.empty((y.size, VIBRATION_AXES, VIBRATION_LENGTH), dtype=np.float32)
    for i, label in enumerate(y):
        speed = rng.uniform(0.02, 0.05)  # cycles per sample
        phase = rng.uniform(0.0, 2 * np.pi, VIBRATION_AXES)
        turn = 2 * np.pi * speed * t
        window = rng.uniform(0.2, 0.4, (VIBRATION_AXES, 1)) * np.sin(turn + phase[:, None])
        name = VIBRATION_CLASSES[label]
        if name == "imbalance":
            strength = rng.uniform(1.0, 1.6)
            window[0] += strength * np.sin(turn + phase[0])
            window[1] += strength * np.cos(turn + phase[0])
        elif name == "misalignment":
            strengths = rng.uniform(0.8, 1.3) * np.array([[0.5], [0.5], [1.0]])
            window += strengths * np.sin(2 * turn + phase[:, None])
        elif name == "bearing_fault":
            bursts = _burst_train(t, rng.uniform(0.06, 0.1), rng.uniform(0.0, 10.0), rng.uniform(2.0, 4.0))
            window += rng.uniform(1.0, 1.8) * np.array([[1.0], [0.7], [0.3]]) * bursts
        x[i] = window + rng.normal(0.0, NOISE_STD, window.shape)
    return x, y
