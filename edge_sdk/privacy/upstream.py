"""The device's half of the upstream path under DP: clip, then noise, before the upload codec.

What a trainer uploads under `--dp` is its change from what came down, clipped as one vector
(every floating array of every group together) to the L2 bound C: that bound is the
sensitivity every DP guarantee of the run rests on. Under local DP the device then adds
Gaussian noise of standard deviation z*C to every coordinate itself, so nobody (broker,
coordinator, other devices) sees its clipped change in the clear. Under distributed DP it adds
its share, of standard deviation z*C/sqrt(m) for the round's m expected participants, before its
upload is masked (secure aggregation): only the sum of m shares, N(0, z^2 C^2), is ever seen.
Integer arrays (BatchNorm's batch counters) carry no gradient: they go up as they came down, so
they say nothing of the data. The coordinator clips again under central DP: it does not rely on a device's honesty.
No torch here: weak devices import this package.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import from_mapping
from ..params import aligned_reference, blocks, flat
from ..protocol import ArrayGroup
from .settings import PrivacySettings

PRIVACY = "privacy"
"""The WELCOME (and STATUS) config key that carries a private run's `[privacy]` settings."""
ROUND_CLIP = "dp_clip"
"""The TRAIN config key of the round's clip bound under adaptive clipping."""
WITHIN_CLIP = "dp_within_clip"
"""The TRAIN_RES metric under adaptive clipping: 1 when the device's change was within the bound, else 0."""
NOISE_SHARES = "dp_shares"
"""The TRAIN config key under distributed DP: m, the round's expected participants, over which
the noise is shared (each device adds N(0, z^2 C^2 / m))."""


class UploadRefused(ValueError):
    """An upload the DP mechanism cannot treat (an integer array that did not come down)."""


@dataclass(frozen=True)
class UploadPrivacy:
    """What a device needs to privatize its uploads: the mode (central or local), C and z, the
    evaluation treatment, and whether noise is drawn from the run's seed."""

    mode: str
    clip: float
    noise: float
    evaluation: str
    eval_noise: float
    reproducible: bool
    seed: int

    @classmethod
    def announced(cls, config: dict[str, Any], seed: int) -> tuple[PrivacySettings, UploadPrivacy | None]:
        """The `[privacy]` settings a WELCOME announces (`config["privacy"]`, the coordinator's,
        noise multiplier resolved; defaults when absent; a bad one raises ConfigError naming the
        key), and the uploads' privacy (None for a run without DP of the uploads)."""
        settings = from_mapping(PrivacySettings, config.get(PRIVACY, {}), where=PRIVACY)
        if not settings.enabled:
            return settings, None
        return settings, cls(mode=settings.dp, clip=settings.dp_clip, noise=settings.dp_noise,
                             evaluation=settings.dp_evaluation, eval_noise=settings.dp_eval_noise,
                             reproducible=settings.dp_reproducible_noise, seed=seed)

    @property
    def local(self) -> bool:
        """The device adds the noise itself (local DP)."""
        return self.mode == "local"

    @property
    def distributed(self) -> bool:
        """The device adds a share of the noise, hidden by secure aggregation (distributed DP)."""
        return self.mode == "distributed"

    @property
    def noises_evaluations(self) -> bool:
        """The device noises the accuracy it reports itself: local and distributed DP, which do not
        trust the coordinator (an evaluation is not securely aggregated, so a share would not do)."""
        return self.local or self.distributed

    def noise_std(self, clip: float, config: dict[str, Any]) -> float:
        """The standard deviation of the noise this device adds to each coordinate of a round's
        upload clipped to `clip`, whose TRAIN carries `config`: z*C (local), z*C/sqrt(m) (distributed,
        m from the TRAIN), 0 (central: the coordinator adds it)."""
        if self.local:
            return self.noise * clip
        if not self.distributed:
            return 0.0
        shares = config.get(NOISE_SHARES)
        if isinstance(shares, bool) or not isinstance(shares, (int, float)) or not math.isfinite(shares) or shares <= 0:
            raise ValueError(f"TRAIN config {NOISE_SHARES} must be a positive number under distributed DP, got "
                             f"{shares!r}")
        return self.noise * clip / math.sqrt(shares)

    def generator(self, client_id: str, round_: int, purpose: str) -> np.random.Generator:
        """Where this device's noise comes from: the operating system's entropy, or (reproducible
        runs) a generator of the run's seed, the device and the round."""
        if not self.reproducible:
            return np.random.default_rng()
        digest = hashlib.sha256(f"{client_id}/{purpose}".encode()).digest()
        return np.random.default_rng([self.seed, round_, int.from_bytes(digest[:8], "little")])


def change_norm(groups: dict[str, ArrayGroup], received: dict[str, ArrayGroup]) -> float:
    """The L2 norm of the floating arrays' change from what came down, over every group."""
    total = 0.0
    for group, arrays in groups.items():
        for key, value in arrays.items():
            if value.dtype.kind == "f":
                reference = _reference(received.get(group, {}), key, value)
                flat_value, flat_reference = flat(value), flat(reference)
                for part in blocks(flat_value.size):
                    diff = flat_value[part].astype(np.float64)
                    if flat_reference is not None:
                        diff -= flat_reference[part]
                    total += float(np.dot(diff, diff))
    return math.sqrt(total)


def round_clip(config: dict[str, Any], privacy: UploadPrivacy) -> float:
    """The clip bound of a round: the TRAIN's (adaptive clipping), else the run's."""
    clip = config.get(ROUND_CLIP, privacy.clip)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0:
        raise ValueError(f"TRAIN config {ROUND_CLIP} must be a positive number, got {clip!r}")
    return float(clip)


def privatize(groups: dict[str, ArrayGroup], received: dict[str, ArrayGroup], privacy: UploadPrivacy,
              rng: np.random.Generator, clip: float | None = None,
              config: dict[str, Any] | None = None) -> tuple[dict[str, ArrayGroup], float]:
    """`groups` as they go up under `privacy`, and the norm of their change before clipping:
    every floating array's change from `received` scaled so that all of them together have an
    L2 norm of at most `clip` (default: the run's C); plus, per coordinate, N(0, (z C)^2) under
    local DP or the device's share N(0, (z C)^2 / m) under distributed DP (`config`: the TRAIN's,
    which carries m). Raises UploadRefused for an integer array with no value that came down."""
    bound = privacy.clip if clip is None else clip
    norm = change_norm(groups, received)
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    std = privacy.noise_std(bound, config or {})
    out: dict[str, ArrayGroup] = {}
    for group, arrays in groups.items():
        out[group] = {}
        for key, value in arrays.items():
            reference = _reference(received.get(group, {}), key, value)
            if value.dtype.kind != "f":
                if reference is None:
                    raise UploadRefused(f"{group}/{key}: an integer array that did not come down has no DP "
                                        "treatment")
                out[group][key] = np.array(reference, dtype=value.dtype)
                continue
            base = np.zeros(value.shape) if reference is None else reference.astype(np.float64)
            moved = base + scale * (value.astype(np.float64) - base)
            if std > 0:
                moved += rng.normal(0.0, std, size=value.shape)
            out[group][key] = moved.astype(value.dtype)
    return out, norm


def private_metrics(metrics: dict[str, float], privacy: UploadPrivacy, rng: np.random.Generator) -> dict[str, float]:
    """The evaluation figures a device reports under DP. `outside`: as measured (they are outside
    the guarantee, and the run says so). `private`: the accuracy alone, which the coordinator
    releases as a noised mean (central), or (local and distributed DP) plus N(0, eval_noise^2) of
    the device's own."""
    if privacy.evaluation == "outside":
        return metrics
    accuracy = float(metrics["accuracy"])
    if privacy.noises_evaluations:
        accuracy += float(rng.normal(0.0, privacy.eval_noise))
    return {"accuracy": accuracy}


def _reference(received: ArrayGroup, key: str, value: np.ndarray) -> np.ndarray | None:
    base = received.get(key)
    return None if base is None else aligned_reference(np.asarray(base), value)
