"""Privacy accounting of user-level DP federated rounds (DP-FedAvg, McMahan et al. 2018), on Google's
dp_accounting (its RDP and PLD accountants compose; nothing here computes a divergence).

The conventions below define the guarantee that `epsilon` states. C is the clip norm of one device's
upload, z the noise multiplier (the noise added to the sum of clipped uploads has std z*C), N the
eligible devices of a round.

- Sampling "fixed": a round selects exactly m of N devices uniformly without replacement.
  Neighbouring runs differ in one device's whole data, replaced (REPLACE_ONE): the sum of clipped
  uploads moves by at most 2C, so the base mechanism is GaussianDpEvent(z / 2) and a round is
  SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2)), or GaussianDpEvent(z / 2) alone
  when m == N. Only the RDP accountant supports it (dp_accounting's PLD has no sampling without
  replacement).
- Sampling "poisson": each device takes part independently with probability q. Neighbouring runs
  differ by one device added or removed (ADD_OR_REMOVE_ONE): sensitivity C, a round is
  PoissonSampledDpEvent(q, GaussianDpEvent(z)) (q == 1: GaussianDpEvent(z)). RDP or PLD.
- An evaluation release: N(0, s^2) is added to the sum of the devices' accuracies (each in [0, 1]),
  sensitivity 1 under both relations: GaussianDpEvent(s), no amplification (every device reports).
- Local DP: each device noises its own clipped upload and nobody is trusted, so there is no
  amplification by sampling (the coordinator knows who was selected). A device's guarantee is
  GaussianDpEvent(z / 2) (fixed, replace-one) or GaussianDpEvent(z) (poisson, add-or-remove)
  composed over the rounds it took part in, plus the evaluation releases; a run states the worst
  device's: `local_epsilon` (rounds of one multiplier; a device's rounds of different multipliers
  compose exactly to one Gaussian of multiplier (sum of z_i^-2)^-1/2, which `RunPrivacy` passes).
- Adaptive clipping (Andrew et al. 2021): the update's noise and the noised centred count are one
  Gaussian mechanism of multiplier z (`RunPrivacy.update_noise`): a round is composed at z.

Composition is order-independent, so identical releases are kept as one entry with a count and
composed with `compose(event, count)`: a 1000-round run keeps a handful of entries. RDP uses the
orders `RDP_ORDERS` (`edge_sdk.privacy.rdp`, shared with DP-SGD's accountant on devices).
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import dp_accounting
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from edge_sdk.privacy.rdp import rdp_orders
from edge_sdk.privacy.settings import ACCOUNTANTS, SAMPLINGS

RDP_ORDERS = rdp_orders()
"""The Renyi orders of every RDP accountant here (see the module docstring)."""
STATE_VERSION = 1
"""The version of `PrivacyAccountant.to_state`'s format."""

_NOISE_RANGE = (0.01, 1e4)
"""The noise multipliers `calibrate_noise` searches."""
_PLD_NOISE_FLOOR = 0.2
"""The smallest z PLD calibration evaluates: PLD's cost and memory grow fast as z shrinks."""
_RELATIVE_TOLERANCE = 1e-3
"""How close to the smallest sufficient z a calibrated z is, relatively."""
_MARGIN = 1e-9
"""Calibration aims this much (relatively) below the target, so that rounding between composition
orders cannot take the composed epsilon above it."""


@dataclass(frozen=True)
class _Release:
    """One kind of release: a round (fixed: `population` N and `size` m; poisson: `probability` q)
    or an evaluation, with its noise multiplier."""

    kind: str
    noise: float
    population: int = 0
    size: int = 0
    probability: float = 0.0


def _positive(value: Any, what: str) -> float:
    """`value` as a float when it is a positive finite number (not a bool), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def _whole(value: Any, what: str, least: int) -> int:
    """`value` when it is an int (not a bool) of at least `least`, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} must be an integer of at least {least}, got {value!r}")
    return value


def _check_kind(accountant: str, sampling: str) -> None:
    """Refuse an unknown accountant or sampling, and PLD with fixed sampling."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    if accountant == "pld" and sampling == "fixed":
        raise ValueError("the pld accountant has no sampling without replacement: use rdp, or poisson sampling")


def _check_delta(delta: Any) -> float:
    """`delta` as a float in (0, 1), else ValueError."""
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def _round(sampling: str, population: Any, sample: Any, noise: Any) -> _Release:
    """The round release of `population` N eligible devices, `sample` (m for fixed, q for poisson)
    and noise multiplier `noise`, checked."""
    z = _positive(noise, "noise multiplier")
    n = _whole(population, "population", 1)
    if sampling == "fixed":
        m = _whole(sample, "sample size m", 1)
        if m > n:
            raise ValueError(f"sample size m ({m}) exceeds the population ({n})")
        return _Release("round", z, population=n, size=m)
    q = _positive(sample, "sampling probability q")
    if q > 1:
        raise ValueError(f"sampling probability q must be at most 1, got {q}")
    return _Release("round", z, probability=q)


def _evaluation(eval_noise: Any) -> _Release:
    """The evaluation release of noise multiplier `eval_noise`, checked."""
    return _Release("evaluation", _positive(eval_noise, "evaluation noise multiplier"))


def _event(release: _Release, sampling: str) -> dp_accounting.DpEvent:
    """The DpEvent of `release` under the central conventions (module docstring)."""
    if release.kind == "evaluation":
        return dp_accounting.GaussianDpEvent(release.noise)
    if sampling == "fixed":
        base = dp_accounting.GaussianDpEvent(release.noise / 2)
        if release.size == release.population:
            return base
        return dp_accounting.SampledWithoutReplacementDpEvent(release.population, release.size, base)
    base = dp_accounting.GaussianDpEvent(release.noise)
    return base if release.probability == 1 else dp_accounting.PoissonSampledDpEvent(release.probability, base)


def _local_event(sampling: str, noise: float) -> dp_accounting.DpEvent:
    """One participation under local DP: the Gaussian mechanism, no amplification."""
    return dp_accounting.GaussianDpEvent(noise / 2 if sampling == "fixed" else noise)


def _fresh(accountant: str, sampling: str) -> dp_accounting.PrivacyAccountant:
    """An empty dp_accounting accountant of `accountant` kind under `sampling`'s relation."""
    relation = (dp_accounting.NeighboringRelation.REPLACE_ONE if sampling == "fixed"
                else dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    if accountant == "rdp":
        return RdpAccountant(list(RDP_ORDERS), relation)
    return PLDAccountant(relation)


class PrivacyAccountant:
    """The central guarantee of one run: every round and evaluation release it composed, and its
    epsilon at `delta`. `accountant` is "rdp" or "pld", `sampling` "fixed" or "poisson".

    RDP keeps a live dp_accounting accountant and composes what was added since the last query;
    PLD rebuilds from the entries when they changed (its self-composition is fast, composing one
    round at a time is not)."""

    def __init__(self, accountant: str, sampling: str, delta: float) -> None:
        _check_kind(accountant, sampling)
        self.accountant, self.sampling, self.delta = accountant, sampling, _check_delta(delta)
        self._counts: dict[_Release, int] = {}
        self._composed: dict[_Release, int] = {}
        self._live = _fresh(accountant, sampling)
        self._epsilon: float | None = 0.0
        self._ahead: tuple[Counter[_Release], dp_accounting.PrivacyAccountant] | None = None
        """RDP: the accountant `epsilon_after` composed one round ahead, adopted when exactly that
        round is added next (the budget check and the round then compose its event once)."""

    @property
    def rounds(self) -> int:
        """How many rounds were composed."""
        return sum(count for release, count in self._counts.items() if release.kind == "round")

    @property
    def evaluations(self) -> int:
        """How many evaluation releases were composed."""
        return sum(count for release, count in self._counts.items() if release.kind == "evaluation")

    def add_round(self, population: int, sample: int | float, noise: float) -> None:
        """Compose one round: `population` N eligible devices, `sample` m (fixed) or q (poisson;
        N is then not part of the event), noise multiplier `noise`."""
        self._add(_round(self.sampling, population, sample, noise), 1)

    def add_evaluation(self, eval_noise: float) -> None:
        """Compose one evaluation release: the sum of accuracies noised with std `eval_noise`."""
        self._add(_evaluation(eval_noise), 1)

    def epsilon(self) -> float:
        """Epsilon at this accountant's delta of everything composed (0.0 with nothing)."""
        if self._epsilon is None:
            self._epsilon = float(self._synced().get_epsilon(self.delta))
        return self._epsilon

    def epsilon_after(self, population: int, sample: int | float, noise: float,
                      eval_noise: float | None = None) -> float:
        """What `epsilon` would be once one more round (as `add_round`) and, with `eval_noise`,
        one more evaluation release were composed; the accountant is left as it was."""
        extra = [_round(self.sampling, population, sample, noise)]
        if eval_noise is not None:
            extra.append(_evaluation(eval_noise))
        if self.accountant == "rdp":
            accountant = copy.deepcopy(self._synced())
            for release in extra:
                accountant.compose(_event(release, self.sampling))
            self._ahead = (Counter(extra), accountant)
            return float(accountant.get_epsilon(self.delta))
        counts = dict(self._counts)
        for release in extra:
            counts[release] = counts.get(release, 0) + 1
        return float(self._built(counts).get_epsilon(self.delta))

    def to_state(self) -> dict[str, Any]:
        """The composed releases with their counts and the settings, as plain JSON values:
        `from_state` rebuilds this accountant from it."""
        return {"version": STATE_VERSION, "accountant": self.accountant, "sampling": self.sampling,
                "delta": self.delta, "releases": [_release_state(release, count, self.sampling)
                                                  for release, count in self._counts.items()]}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PrivacyAccountant:
        """The accountant `to_state` described, its releases composed (a resumed run continues
        it); ValueError naming what is wrong with a malformed state."""
        if not isinstance(state, Mapping):
            raise ValueError(f"privacy accountant state must be a mapping, got {type(state).__name__}")
        _exact_keys(state, {"version", "accountant", "sampling", "delta", "releases"}, "privacy accountant state")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"privacy accountant state: version {state['version']!r} is not {STATE_VERSION}")
        try:
            restored = cls(state["accountant"], state["sampling"], state["delta"])
        except ValueError as error:
            raise ValueError(f"privacy accountant state: {error}") from None
        releases = state["releases"]
        if not isinstance(releases, list):
            raise ValueError("privacy accountant state: releases must be a list")
        for index, entry in enumerate(releases):
            try:
                release, count = _release_from_state(entry, restored.sampling)
            except ValueError as error:
                raise ValueError(f"privacy accountant state: release {index}: {error}") from None
            if release in restored._counts:
                raise ValueError(f"privacy accountant state: release {index} repeats an earlier one")
            restored._add(release, count)
        return restored

    def _add(self, release: _Release, count: int) -> None:
        self._counts[release] = self._counts.get(release, 0) + count
        self._epsilon = None

    def _synced(self) -> dp_accounting.PrivacyAccountant:
        """The accountant holding every entry: RDP composes what it lacks, PLD is rebuilt."""
        if self.accountant == "pld":
            return self._built(self._counts)
        missing = Counter({release: count - self._composed.get(release, 0) for release, count in self._counts.items()})
        missing = +missing  # only what is missing
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == missing:
            self._live = ahead[1]
        else:
            for release, count in missing.items():
                self._live.compose(_event(release, self.sampling), count)
        self._composed = dict(self._counts)
        return self._live

    def _built(self, counts: Mapping[_Release, int]) -> dp_accounting.PrivacyAccountant:
        """A fresh accountant with `counts` composed, entry by entry."""
        accountant = _fresh(self.accountant, self.sampling)
        for release, count in counts.items():
            accountant.compose(_event(release, self.sampling), count)
        return accountant


def _release_state(release: _Release, count: int, sampling: str) -> dict[str, Any]:
    """One entry of `to_state`."""
    entry: dict[str, Any] = {"release": release.kind, "noise": release.noise}
    if release.kind == "round" and sampling == "fixed":
        entry.update(population=release.population, sample=release.size)
    elif release.kind == "round":
        entry["probability"] = release.probability
    entry["count"] = count
    return entry


def _release_from_state(entry: Any, sampling: str) -> tuple[_Release, int]:
    """The release and count of one `to_state` entry, checked."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"must be a mapping, got {type(entry).__name__}")
    kind = entry.get("release")
    if kind == "evaluation":
        _exact_keys(entry, {"release", "noise", "count"}, "an evaluation")
        release = _evaluation(entry["noise"])
    elif kind == "round" and sampling == "fixed":
        _exact_keys(entry, {"release", "noise", "population", "sample", "count"}, "a fixed-sampling round")
        release = _round(sampling, entry["population"], entry["sample"], entry["noise"])
    elif kind == "round":
        _exact_keys(entry, {"release", "noise", "probability", "count"}, "a poisson round")
        release = _round(sampling, 1, entry["probability"], entry["noise"])
    else:
        raise ValueError(f"release must be 'round' or 'evaluation', got {kind!r}")
    return release, _whole(entry["count"], "count", 1)


def _exact_keys(mapping: Mapping[str, Any], keys: set[str], what: str) -> None:
    """Refuse `mapping` unless its keys are exactly `keys`, naming the missing and unknown ones."""
    missing, unknown = keys - set(mapping), set(mapping) - keys
    if missing or unknown:
        raise ValueError(f"{what} lacks {sorted(missing)} and has unknown {sorted(unknown)}" if missing and unknown
                         else f"{what} lacks {sorted(missing)}" if missing else f"{what} has unknown {sorted(unknown)}")


def local_epsilon(sampling: str, noise: float, participations: int, delta: float, *, evaluations: int = 0,
                  eval_noise: float = 0.0, accountant: str = "rdp") -> float:
    """Epsilon at `delta` of one device under local DP (or against whoever sees who was
    selected): `participations` uploads noised with multiplier `noise`, no amplification by
    sampling, plus `evaluations` evaluation releases of noise `eval_noise`. Pass the largest
    participation count of the run for the run's guarantee."""
    _check_kind(accountant, sampling)
    delta = _check_delta(delta)
    z = _positive(noise, "noise multiplier")
    _whole(participations, "participations", 0)
    _whole(evaluations, "evaluations", 0)
    events = [(_local_event(sampling, z), participations)]
    if evaluations:
        events.append((_event(_evaluation(eval_noise), sampling), evaluations))
    if not any(count for _, count in events):
        return 0.0
    composed = _fresh(accountant, sampling)
    for event, count in events:
        if count:
            composed.compose(event, count)
    return float(composed.get_epsilon(delta))


def calibrate_noise(accountant: str, sampling: str, population: int, sample: int | float, rounds: int, delta: float,
                    target_epsilon: float, *, evaluations: int = 0, eval_noise: float = 0.0,
                    local: bool = False) -> float:
    """The smallest noise multiplier z (within 0.1 %, rounded up) whose `rounds` rounds of
    `population` devices and `sample` (m for fixed, q for poisson), with `evaluations` evaluation
    releases of noise `eval_noise`, compose to at most `target_epsilon` at `delta`; `local`: the
    local-DP guarantee of a device taking part in every round. Found by
    dp_accounting.calibrate_dp_mechanism over log z. ValueError when no z in the searched range
    reaches the target, e.g. when the evaluation releases alone spend it."""
    _check_kind(accountant, sampling)
    delta = _check_delta(delta)
    target = _positive(target_epsilon, "target epsilon")
    template = _round(sampling, population, sample, 1.0)
    _whole(rounds, "rounds", 1)
    _whole(evaluations, "evaluations", 0)
    goal = target * (1 - _MARGIN)
    tail: list[dp_accounting.DpEvent] = []
    if evaluations:
        releases = dp_accounting.SelfComposedDpEvent(_event(_evaluation(eval_noise), sampling), evaluations)
        spent = float(_fresh(accountant, sampling).compose(releases).get_epsilon(delta))
        if spent >= goal:
            raise ValueError(f"the {evaluations} evaluation releases alone spend epsilon {spent:.4g}, not below the "
                             f"target {target:.4g}: raise the evaluation noise or the target, or release none")
        tail.append(releases)

    def plan(z: float) -> dp_accounting.DpEvent:
        one = _local_event(sampling, z) if local else _event(replace(template, noise=z), sampling)
        return dp_accounting.ComposedDpEvent([dp_accounting.SelfComposedDpEvent(one, rounds), *tail])

    def epsilon_at(kind: str) -> Callable[[float], float]:
        return lambda z: float(_fresh(kind, sampling).compose(plan(z)).get_epsilon(delta))

    low, high = _NOISE_RANGE
    rdp_at = epsilon_at("rdp")
    least = rdp_at(high)
    if least > goal:
        raise ValueError(f"target epsilon {target:.4g} is out of reach: noise multiplier {high:g} still spends "
                         f"{least:.4g} over {rounds} rounds")
    if rdp_at(low) <= goal:
        raise ValueError(f"target epsilon {target:.4g} is met even with noise multiplier {low:g}: give the noise "
                         f"multiplier instead")
    noise = _calibrate("rdp", sampling, plan, goal, delta, low, high)
    if accountant == "pld":
        low, high = _pld_bracket(epsilon_at("pld"), goal, noise, target)
        noise = _calibrate("pld", sampling, plan, goal, delta, low, high)
    return noise


def _calibrate(accountant: str, sampling: str, plan: Callable[[float], dp_accounting.DpEvent], goal: float,
               delta: float, low: float, high: float) -> float:
    """The smallest z in [low, high] (which bracket it) whose `plan` spends at most `goal`."""
    log_noise = dp_accounting.calibrate_dp_mechanism(
        lambda: _fresh(accountant, sampling), lambda log_z: plan(math.exp(log_z)), goal, delta,
        dp_accounting.ExplicitBracketInterval(math.log(low), math.log(high)), tol=math.log1p(_RELATIVE_TOLERANCE))
    return math.exp(log_noise)


def _pld_bracket(epsilon_at: Callable[[float], float], goal: float, rdp_noise: float,
                 target: float) -> tuple[float, float]:
    """A bracket of PLD's z from RDP's (PLD is the tighter bound, so its z is usually between half
    RDP's and RDP's), never evaluating PLD below `_PLD_NOISE_FLOOR`."""
    floor = ValueError(f"target epsilon {target:.4g} is met with a noise multiplier near or below "
                       f"{_PLD_NOISE_FLOOR:g}, where pld accounting is not computed: give the noise multiplier "
                       f"instead, or use rdp")
    if rdp_noise <= _PLD_NOISE_FLOOR:
        raise floor
    high = rdp_noise
    while epsilon_at(high) > goal:
        high *= 2
        if high > _NOISE_RANGE[1]:
            raise ValueError(f"target epsilon {target:.4g} is out of reach with the pld accountant")
    low = max(high / 2, _PLD_NOISE_FLOOR)
    while epsilon_at(low) <= goal:
        if low == _PLD_NOISE_FLOOR:
            raise floor
        low = max(low / 2, _PLD_NOISE_FLOOR)
    return low, high
