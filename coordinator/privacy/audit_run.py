"""One audited run: a fleet with canary devices played through the project's own DP mechanisms,
round by round, and the canaries scored from what the auditor sees.

The run's DP is `RunPrivacy`, as a training run has it: z calibrated to (epsilon, delta) over
the planned rounds and fraction, the round's sample drawn by its `select`, the accountant
composed by `round_ended`. Every selected device's upload goes through the device's
`privatize` (clip; plus the noise under local DP, or the device's noise share under distributed
DP), and the coordinator's side is the run's: under central DP its `PrivateMean` (clip again,
N(0, (z C)^2) on the sum, the fixed denominator); under distributed DP the sum of the noised
uploads over the same denominator, summed here in the clear: secure aggregation reveals exactly
that sum and nothing else, so the auditor sees what the coordinator would.

The first m devices are canaries: each is in (its change is C times its own random unit
direction) with probability 1/2, else out (its change is zero: the device is there and uploads,
but its data moves nothing, a neighbouring fleet under either sampling's adjacency). The auditor
sees what the run releases. Under central and distributed DP that is each round's global model:
a canary's score is the sum over rounds of <released change, its direction>; the auditor is not
told who was selected (the guarantee is amplified by the secret sample). Under local DP every
upload is seen, with its sender: a canary's score is the sum of <its uploads, its direction>.

What the audit covers: the aggregation mechanism of every round, composed over the planned
rounds, on the model's arrays and the fleet's size. What it does not: the evaluation figures, the
selection's secrecy in a deployment (the audit draws it from the seed), adaptive clipping, DP-SGD
and the transport; and a lower bound below the accountant's epsilon proves nothing: it only fails
to find a violation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from edge_sdk.privacy import PrivacySettings
from edge_sdk.privacy.upstream import UploadPrivacy, privatize
from edge_sdk.protocol import ArrayGroup

from .audit import CONFIDENCE, epsilon_lower_bound, score_guesses
from .audit_updates import UpdateSource, floating_keys
from .mechanism import PrivateMean
from .run import RunPrivacy

AUDITED_MODES = ("central", "local", "distributed")
GROUP = "model"
"""The one group the audit's uploads carry."""


@dataclass(frozen=True)
class AuditPlan:
    """An audit's settings: the DP of the run (`privacy`, its mode one of AUDITED_MODES), the
    fleet of `clients` devices of which `canaries` are canaries, `rounds` rounds at `fraction`,
    and the guesses: "in" for the `guess_in` highest scores, "out" for the `guess_out` lowest."""

    privacy: PrivacySettings
    clients: int
    rounds: int
    fraction: float
    canaries: int
    guess_in: int
    guess_out: int
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.privacy.dp in AUDITED_MODES, "dp", "central, local or distributed", self.privacy.dp),
            (self.clients >= 1, "clients", "at least 1", self.clients),
            (self.rounds >= 1, "rounds", "at least 1", self.rounds),
            (0 < self.fraction <= 1, "fraction", "in (0, 1]", self.fraction),
            (1 <= self.canaries <= self.clients, "canaries", f"between 1 and clients ({self.clients})", self.canaries),
            (self.guess_in >= 0, "guess_in", "zero or more", self.guess_in),
            (self.guess_out >= 0, "guess_out", "zero or more", self.guess_out),
            (0 < self.guess_in + self.guess_out <= self.canaries, "guess_in",
             f"with guess_out, between 1 and the canaries ({self.canaries})", self.guess_in + self.guess_out),
        ]
        for ok, key, what, value in checks:
            if not ok:
                raise ValueError(f"{key} must be {what}, got {value!r}")


@dataclass(frozen=True)
class AuditResult:
    """One audit's figures (the command's table row and JSON)."""

    mode: str
    epsilon: float
    delta: float
    noise_multiplier: float
    accountant_epsilon: float
    lower_bound: float
    ceiling: float
    canaries: int
    included: int
    guesses: int
    correct: int
    noise_scale: float

    @property
    def violated(self) -> bool:
        """The empirical lower bound exceeds the accountant's epsilon: the implementation does
        not keep its claim (with probability at least CONFIDENCE)."""
        return self.lower_bound > self.accountant_epsilon

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "confidence": CONFIDENCE, "violated": self.violated}


class _Canaries:
    """The canaries' random unit directions over the floating arrays (regenerated from the seed
    when needed: m of them at the model's size would not fit in memory)."""

    def __init__(self, reference: ArrayGroup, seed: int):
        self.keys = floating_keys(reference)
        self.shapes = {key: np.shape(reference[key]) for key in self.keys}
        self.sizes = [int(np.prod(self.shapes[key])) for key in self.keys]
        self.seed = seed

    def direction(self, index: int) -> np.ndarray:
        vector = np.random.default_rng([self.seed, 7, index]).standard_normal(sum(self.sizes))
        return vector / np.linalg.norm(vector)

    def arrays(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        parts = np.split(vector, np.cumsum(self.sizes)[:-1])
        return {key: part.reshape(self.shapes[key]) for key, part in zip(self.keys, parts, strict=True)}

    def flat(self, arrays: ArrayGroup, reference: ArrayGroup) -> np.ndarray:
        """The float64 change of `arrays` from `reference`, flattened in the directions' order."""
        return np.concatenate([np.asarray(arrays[key], dtype=np.float64).ravel()
                               - np.asarray(reference[key], dtype=np.float64).ravel() for key in self.keys])


def _moved(reference: ArrayGroup, change: dict[str, np.ndarray]) -> ArrayGroup:
    """What a device trained to: the reference plus its change, in the reference's dtypes."""
    return {key: (np.asarray(value) + change[key]).astype(np.asarray(value).dtype) if key in change
            else np.array(value) for key, value in reference.items()}


def run_audit(plan: AuditPlan, reference: ArrayGroup, updates: UpdateSource, *,
              _noise_scale: float = 1.0) -> AuditResult:
    """Audit `plan` on a model whose initial arrays are `reference`, the non-canary devices
    uploading what `updates` gives. Repeats exactly for the same plan (its seed).

    `_noise_scale` is for the tests and the benchmark alone: it scales the noise the mechanism
    adds (0: none) while the accountant keeps claiming the calibrated z, to show the audit finds
    a broken mechanism. The noise is always drawn from the plan's seed, and the evaluation is not
    audited (no evaluation release is accounted)."""
    settings = replace(plan.privacy, dp_reproducible_noise=True, dp_evaluation="outside")
    population = plan.clients
    run = RunPrivacy(settings, devices=population, population=population, fraction=plan.fraction,
                     rounds=plan.rounds, evaluations=0, seed=plan.seed)
    canaries = _Canaries(reference, plan.seed)
    included = np.random.default_rng([plan.seed, 5]).random(plan.canaries) < 0.5
    ids = [f"canary-{i}" for i in range(plan.canaries)] + [f"device-{i}" for i in range(population - plan.canaries)]
    device = UploadPrivacy(mode=settings.dp, clip=run.clip, noise=run.noise * _noise_scale, evaluation="outside",
                           eval_noise=settings.dp_eval_noise, reproducible=True, seed=plan.seed)
    released = np.zeros(sum(canaries.sizes))
    seen = np.zeros(plan.canaries)  # local DP: the canaries' own uploads, projected
    current = dict(reference)
    for round_ in range(1, plan.rounds + 1):
        selected = run.select(ids, round_)
        config = run.task_config(population)
        if settings.dp == "central":
            aggregate = run.aggregator(population, round_)(current)
            aggregate.std *= _noise_scale
        else:  # local: summed as they come; distributed: the secure sum, here in the clear
            aggregate = PrivateMean(current, clip=0.0, std=0.0, expected=run.expected(population),
                                    rng=np.random.default_rng(0))
        for client_id in selected:
            kind, index = client_id.split("-")
            canary = kind == "canary"
            if canary:
                change = canaries.arrays(run.clip * canaries.direction(int(index)) * included[int(index)])
            else:
                change = updates.change(int(index), current, round_)
            upload, _ = privatize({GROUP: _moved(current, change)}, {GROUP: current}, device,
                                  device.generator(client_id, round_, "upload"), config=config)
            if canary and settings.dp == "local":
                seen[int(index)] += float(canaries.flat(upload[GROUP], current) @ canaries.direction(int(index)))
            aggregate.add(upload[GROUP], 1.0)
        if settings.dp == "distributed":
            run.note_secure_sum(len(selected))
        if selected:
            result = aggregate.result()
            released += canaries.flat(result, current)
            current = result
        run.round_ended(population, selected, round_)
    if settings.dp == "local":
        scores = seen
    else:
        scores = np.array([released @ canaries.direction(i) for i in range(plan.canaries)])
    guesses, correct = score_guesses(scores, included, plan.guess_in, plan.guess_out)
    return AuditResult(
        mode=settings.dp, epsilon=settings.dp_epsilon, delta=run.delta, noise_multiplier=run.noise,
        accountant_epsilon=run.epsilon(),
        lower_bound=epsilon_lower_bound(plan.canaries, guesses, correct, run.delta),
        ceiling=epsilon_lower_bound(plan.canaries, guesses, guesses, run.delta), canaries=plan.canaries,
        included=int(included.sum()), guesses=guesses, correct=correct, noise_scale=_noise_scale)
