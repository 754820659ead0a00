"""One private run's DP, as the round loop uses it: the noise multiplier (given, or calibrated
to the budget before anything trains), who is sampled, the DP aggregate, the accountant composed
over every round and every evaluation it releases, the budget stop, and what a checkpoint keeps
so that a resumed run continues the accountant instead of restarting it.

Two figures are reported. `epsilon` is the guarantee against whoever sees what the coordinator
releases (every round's global model, the release, the reports) but not who was selected: the
accountant with amplification by sampling, which needs the sample secret: it is drawn from the
operating system's entropy. `epsilon_fleet` holds against the other devices, which see each
TRAIN's list of selected devices: no amplification, the noise composed over the rounds the most
exposed device took part in, each at the noise it carried. Under local DP only the second exists
(every upload is seen), and it is the run's `epsilon`.

Under distributed DP (with secure aggregation) each device adds N(0, z^2 C^2 / m) for the round's
m expected participants before masking, so the sum the coordinator unmasks carries N(0, z^2 C^2)
when all m are in it. Fewer devices in the sum (dropouts) carry less noise: a round summed over s
devices is accounted with the multiplier z sqrt(min(s, m) / m), the noise it really holds, in
`epsilon` and in `epsilon_fleet` alike. This mode does not trust the coordinator, which selects
the devices: `epsilon_fleet` is the figure that holds against it. Under private evaluation each
device adds N(0, eval_noise^2) to the accuracy it reports itself (as under local DP) and the
coordinator adds nothing: the same Gaussian mechanism as central DP's noised sum, on each device's
own report, composed into both figures.
"""

from __future__ import annotations

import copy
import logging
import math
from collections import Counter
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from edge_sdk.config import ConfigError
from edge_sdk.privacy import PrivacySettings
from edge_sdk.privacy.upstream import NOISE_SHARES, ROUND_CLIP, WITHIN_CLIP
from edge_sdk.protocol import ArrayGroup, Reason, ValidationError

from ..rounds.collector import select_clients
from .accountant import PrivacyAccountant, calibrate_noise, local_epsilon
from .budget import BudgetSpent
from .mechanism import PrivateMean, noised_mean, within_share

log = logging.getLogger(__name__)

SHARE_TAILS = 7.0
"""Standard deviations of a device's noise share its coordinates may reach in the secure sum."""


class RunPrivacy:
    """The DP of one run under `settings` (enabled): `population` devices are eligible for
    training (trainers, holdouts excepted), `fraction` of them sampled each round, `rounds`
    planned with `evaluations` evaluation releases; `seed` is the run's."""

    private = True
    """A run under DP (`NoPrivacy` says False)."""

    def __init__(self, settings: PrivacySettings, *, devices: int, population: int, fraction: float, rounds: int,
                 evaluations: int, seed: int):
        self.settings, self.fraction, self.seed = settings, fraction, seed
        self.delta = settings.delta_for(devices)
        self.releases_evaluations = settings.dp_evaluation == "private"
        self.accountant = PrivacyAccountant(settings.dp_accountant, settings.dp_sampling, self.delta)
        self.participations: Counter[str] = Counter()
        self.exposure: dict[str, float] = {}
        """Per device, the sum of z_i^-2 over the rounds it took part in, z_i the noise multiplier
        round i's release carried: its Gaussian mechanisms compose to one of multiplier
        exposure^-1/2 (`epsilon_fleet`)."""
        self.noise = settings.dp_noise or self._calibrated(population, rounds, evaluations)
        self.released_accuracy: float | None = None
        """The last evaluation's noised mean accuracy (private evaluation)."""
        self.clip = self.round_clip = settings.dp_clip
        """C of the next round, and of the last one played (adaptive clipping moves it)."""
        self.within: list[float] = []  # this round's devices: 1 when their change was within C
        self.uploads: dict[str, set[str]] = {}  # this round's distinct uploads (message ids) by device
        self.count_noise = settings.dp_clip_count_noise or self.expected(population) / 20
        self.summed: int | None = None
        """Under distributed DP, the devices in this round's unmasked sum (None: not summed yet)."""
        self._check_std(population)
        spread = settings.dp_eval_noise / max(1, population)
        if settings.dp_evaluation == "private" and spread > 0.05:
            log.warning("DP: the released mean accuracy carries noise of std %.3g over %d devices (--dp-eval-noise "
                        "%g); with few devices use --dp-evaluation outside", spread, population, settings.dp_eval_noise)

    def _check_std(self, population: int) -> None:
        """Adaptive clipping splits z between the update and the count (`update_noise`): the
        count's noise must leave the update some."""
        if self.settings.dp_adaptive_clip and 2 * self.count_noise <= self.noise:
            raise ConfigError(f"dp_clip_count_noise {self.count_noise:g} must exceed half the noise multiplier "
                              f"{self.noise:g}: adaptive clipping's count noise sigma_b and the update's z_delta "
                              f"make z = (z_delta^-2 + (2 sigma_b)^-2)^-1/2 (Andrew et al. 2021, Theorem 1: the "
                              f"count is centred, of sensitivity 1/2)")

    @property
    def update_noise(self) -> float:
        """The update's own noise multiplier: z, or under adaptive clipping z_delta with
        (z_delta^-2 + (2 sigma_b)^-2)^-1/2 = z, so that the update and the noised count together
        are one Gaussian mechanism of multiplier z, which the accountant composes. It rests on the
        count's sensitivity: 1/2 when a device is added or removed (the count is centred,
        `centred_count`), 1 when one is replaced, where the update's is 2C."""
        if not self.settings.dp_adaptive_clip:
            return self.noise
        return (self.noise ** -2 - (2 * self.count_noise) ** -2) ** -0.5

    @property
    def local(self) -> bool:
        return self.settings.dp == "local"

    @property
    def distributed(self) -> bool:
        """The devices add the noise in shares, under secure aggregation."""
        return self.settings.dp == "distributed"

    def _calibrated(self, population: int, rounds: int, evaluations: int) -> float:
        """z that spends `dp_epsilon` over the planned rounds and evaluation releases."""
        noise = calibrate_noise(
            self.settings.dp_accountant, self.settings.dp_sampling, population, self._sample(population), rounds,
            self.delta, self.settings.dp_epsilon, local=self.local,
            evaluations=evaluations if self.releases_evaluations else 0, eval_noise=self.settings.dp_eval_noise)
        log.info("DP: noise multiplier %.4f spends epsilon %.3g at delta %.3g over %d rounds", noise,
                 self.settings.dp_epsilon, self.delta, rounds)
        return noise

    def _sample(self, population: int) -> float:
        """m, the expected number of participants of a round of `population` eligible devices
        (fixed: exactly the number `select_clients` draws), or q (poisson)."""
        if self.settings.dp_sampling == "poisson":
            return self.fraction
        return min(population, max(1, int(round(self.fraction * population))))

    def expected(self, population: int) -> float:
        """The fixed denominator of the round's mean."""
        sample = self._sample(population)
        return sample * population if self.settings.dp_sampling == "poisson" else sample

    # -- a round -----------------------------------------------------------------------------
    def select(self, candidates: list[str], round_: int) -> list[str]:
        """The round's sample: uniform without replacement (fixed), or each candidate with
        probability `fraction` (poisson). Amplification by sampling holds only while the sample is
        secret, so it is drawn from the operating system's entropy (from the run's seed, which the
        report states, only with reproducible noise)."""
        secret = None if self.settings.dp_reproducible_noise else np.random.default_rng()
        if self.settings.dp_sampling == "fixed":
            return select_clients(candidates, self.fraction, self.seed, round_, rng=secret)
        rng = secret or np.random.default_rng([self.seed, round_, 1])
        return [c for c, u in zip(sorted(candidates), rng.random(len(candidates)), strict=True) if u < self.fraction]

    def check_budget(self, population: int) -> None:
        """Raise BudgetSpent when one more round of `population` eligible devices would take
        epsilon over `dp_epsilon` (no budget: never)."""
        budget = self.settings.dp_epsilon
        if budget <= 0:
            return
        after = self._epsilon_after_round(population)
        if after > budget:
            raise BudgetSpent(f"privacy budget spent: epsilon {self.epsilon():.4g} of {budget:.4g} at delta "
                              f"{self.delta:.3g}, one more round would reach {after:.4g}")

    def check_evaluation(self, what: str) -> None:
        """Raise BudgetSpent, naming `what`, when releasing one more evaluation outside a round
        (the release's, a resumed run's final one) would take epsilon over `dp_epsilon`; a round's
        own evaluation is in its round's check. Never without a budget or a private evaluation."""
        budget = self.settings.dp_epsilon
        if budget <= 0 or not self.releases_evaluations:
            return
        after = self._epsilon_after_evaluation()
        if after > budget:
            raise BudgetSpent(f"privacy budget spent: epsilon {self.epsilon():.4g} of {budget:.4g} at delta "
                              f"{self.delta:.3g}, {what} would reach {after:.4g}")

    def _epsilon_after_evaluation(self) -> float:
        if self.local:
            return local_epsilon(self.settings.dp_sampling, self.noise, max(self.participations.values(), default=0),
                                 self.delta, evaluations=self.accountant.evaluations + 1,
                                 eval_noise=self.settings.dp_eval_noise)
        ahead = copy.deepcopy(self.accountant)
        ahead.add_evaluation(self.settings.dp_eval_noise)
        return ahead.epsilon()

    def _epsilon_after_round(self, population: int) -> float:
        if self.local:
            return self._fleet_epsilon(max(self.exposure.values(), default=0.0) + self.noise ** -2)
        eval_noise = self.settings.dp_eval_noise if self.releases_evaluations else None
        return self.accountant.epsilon_after(population, self._sample(population), self.noise, eval_noise=eval_noise)

    def aggregator(self, population: int, round_: int):
        """The round's aggregate (`PrivateMean`): clipped again and noised here under central
        DP, summed as they come under local DP; over the fixed denominator."""
        def make(reference: ArrayGroup) -> PrivateMean:
            central = not self.local
            return PrivateMean(reference, clip=self.clip if central else 0.0,
                               std=self.update_noise * self.clip if central else 0.0,
                               expected=self.expected(population), rng=self._generator(round_, "aggregate"))
        return make

    def task_config(self, population: int) -> dict[str, Any]:
        """What TRAIN carries of the round's DP for `population` eligible devices: the clip bound,
        under adaptive clipping; m, the expected participants the noise is shared over, under
        distributed DP."""
        config: dict[str, Any] = {ROUND_CLIP: self.clip} if self.settings.dp_adaptive_clip else {}
        if self.distributed:
            config[NOISE_SHARES] = self.expected(population)
        return config

    def share_bound(self, population: int) -> float:
        """Under distributed DP, the largest magnitude a coordinate of a device's noised upload is
        given in the secure sum: C plus SHARE_TAILS standard deviations of its noise share (a
        coordinate beyond it is clamped, with probability below 3e-12)."""
        return self.clip * (1.0 + SHARE_TAILS * self.noise / math.sqrt(self.expected(population)))

    def note_secure_sum(self, count: int) -> None:
        """Under distributed DP: the round's unmasked sum holds the noise shares of `count` devices."""
        self.summed = count

    def note_upload(self, client_id: str, msg_id: str) -> None:
        """Count an upload of the open round, accepted or not: a device that trained twice for
        one round (it restarted and lost its reply) released its data twice."""
        self.uploads.setdefault(client_id, set()).add(msg_id)

    def note_update(self, metrics: dict[str, Any]) -> None:
        """Keep what an accepted update says for adaptive clipping: whether its change was within
        C (ValidationError for anything but 0 or 1)."""
        if not self.settings.dp_adaptive_clip:
            return
        within = metrics.get(WITHIN_CLIP)
        if within not in (0, 1) or isinstance(within, bool):
            raise ValidationError(Reason.MALFORMED, f"{WITHIN_CLIP} must be 0 or 1, got {within!r}")
        self.within.append(float(within))

    def round_ended(self, population: int, participants: list[str], round_: int) -> None:
        """Compose the round (whether or not it aggregated: its sample was drawn), count who took
        part (a device that uploaded twice, twice) and, under adaptive clipping, move C by the
        noised share of changes within it."""
        noise = self._round_noise(population)
        if population:  # no eligible device, no sample: nothing was released
            self.accountant.add_round(population, self._sample(population), noise)
        self.summed = None
        taken = Counter(dict.fromkeys(participants, 1))
        for client_id, uploads in self.uploads.items():
            taken[client_id] = max(taken[client_id], len(uploads))
        self.participations.update(taken)
        for client_id, count in taken.items():
            self.exposure[client_id] = self.exposure.get(client_id, 0.0) + count * noise ** -2
        self.uploads = {}
        self.round_clip = self.clip
        if self.settings.dp_adaptive_clip and population:
            count_noise = self._generator(round_, "clip count").normal(0.0, self.count_noise)
            share = within_share(self.within, count_noise, self.expected(population))
            self.clip *= math.exp(-self.settings.dp_clip_lr * (share - self.settings.dp_clip_quantile))
        self.within = []

    def _round_noise(self, population: int) -> float:
        """The noise multiplier the round's release carries: z, or under distributed DP with s
        devices summed (fewer than the m expected: dropouts) z sqrt(s / m)."""
        if not self.distributed or self.summed is None:
            return self.noise
        expected = self.expected(population)
        return self.noise * math.sqrt(min(self.summed, expected) / expected)

    @property
    def devices_noise_evaluations(self) -> bool:
        """Each device adds N(0, eval_noise^2) to the accuracy it reports (local and distributed
        DP, which do not trust the coordinator), so the coordinator adds none."""
        return self.local or self.distributed

    def release_accuracy(self, accuracies: list[float], round_: int) -> float | None:
        """The devices' accuracies released as one noised mean (private evaluation), composed:
        noised here (central DP), or by each device (`devices_noise_evaluations`), the same
        Gaussian mechanism of multiplier eval_noise on one device's accuracy either way."""
        std = 0.0 if self.devices_noise_evaluations else self.settings.dp_eval_noise
        self.released_accuracy = noised_mean(accuracies, std, self._generator(round_, "evaluation"))
        if accuracies:
            self.accountant.add_evaluation(self.settings.dp_eval_noise)
        return self.released_accuracy

    def _generator(self, round_: int, purpose: str) -> np.random.Generator:
        if not self.settings.dp_reproducible_noise:
            return np.random.default_rng()
        return np.random.default_rng([self.seed, round_, sum(purpose.encode())])

    # -- figures and state -----------------------------------------------------------------
    def _fleet_epsilon(self, exposure: float) -> float:
        """Epsilon without amplification of a device of `exposure` (sum of z_i^-2 over its
        rounds), with every evaluation release."""
        participations, noise = (1, exposure ** -0.5) if exposure > 0 else (0, self.noise)
        return local_epsilon(self.settings.dp_sampling, noise, participations, self.delta,
                             evaluations=self.accountant.evaluations, eval_noise=self.settings.dp_eval_noise)

    def epsilon(self) -> float:
        """The run's guarantee so far (see the module docstring)."""
        if self.local:
            return self.epsilon_fleet()
        return self.accountant.epsilon()

    def epsilon_fleet(self) -> float:
        """The guarantee against the devices and the broker's readers: no amplification, the most
        exposed device's rounds at the noise each carried (under distributed DP, z sqrt(s / m)
        for a round summed over s of the m expected)."""
        return self._fleet_epsilon(max(self.exposure.values(), default=0.0))

    def record(self) -> dict[str, Any]:
        """What every round's record and the report say of the run's privacy."""
        epsilon = self.epsilon()
        return {"mode": self.settings.dp, "epsilon": _finite(epsilon), "epsilon_fleet": _finite(self.epsilon_fleet()),
                "delta": self.delta, "noise_multiplier": self.noise, "clip": self.round_clip,
                "accountant": self.settings.dp_accountant, "sampling": self.settings.dp_sampling,
                "evaluation": self.settings.dp_evaluation, "budget": self.settings.dp_epsilon or None}

    def report(self) -> dict[str, Any]:
        """The report's `privacy`: the record, the last released accuracy, what the guarantee
        leaves out, and where the noise and the selections came from (`randomness`): the operating
        system's entropy, or the run's seed, which WELCOME and the report carry, so that the
        guarantee holds only against whoever does not know it."""
        outside = ["evaluation figures"] if self.settings.dp_evaluation == "outside" else []
        randomness = "the run's seed" if self.settings.dp_reproducible_noise else "operating system entropy"
        return {**self.record(), "released_accuracy": self.released_accuracy,
                "rounds_accounted": self.accountant.rounds, "evaluations_accounted": self.accountant.evaluations,
                "outside_the_guarantee": outside, "randomness": randomness}

    def announcement(self) -> dict[str, Any]:
        """The settings STATUS and WELCOME carry, the noise multiplier resolved."""
        return asdict(replace(self.settings, dp_noise=self.noise))

    def to_state(self) -> dict[str, Any]:
        return {"noise": self.noise, "accountant": self.accountant.to_state(), "clip": self.clip,
                "participations": dict(self.participations), "exposure": dict(self.exposure)}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state: the same noise multiplier (a calibration is not
        redone), the accountant's composed events, the participations and each device's exposure
        (a checkpoint without it: every round it took part in at the run's z)."""
        self.noise = float(state["noise"])
        self.clip = self.round_clip = float(state["clip"])
        self.accountant = PrivacyAccountant.from_state(state["accountant"])
        self.participations = Counter({str(k): int(v) for k, v in state["participations"].items()})
        exposure = state.get("exposure", {k: v * self.noise ** -2 for k, v in self.participations.items()})
        self.exposure = {str(k): float(v) for k, v in exposure.items()}


def _finite(value: float) -> float | None:
    """JSON has no infinity: None stands for it."""
    return value if math.isfinite(value) else None
