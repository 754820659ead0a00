"""The privacy audit in one run (`coordinator.privacy.audit`, `audit_run`): the lower bound's
statistics against hand-checkable numbers, and the audit of the project's real mechanisms:
below the accountant's epsilon as they are, above it (a violation) with their noise cut tenfold
or switched off.

The audited fleets are small (a 4,000-coordinate model, 400 canary devices, full participation,
2 rounds: under a second each); their seeds are fixed, so every figure repeats.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from coordinator.privacy.audit import epsilon_lower_bound, p_value, score_guesses
from coordinator.privacy.audit_run import AuditPlan, run_audit
from coordinator.privacy.audit_updates import RandomUpdates, TrainedUpdates
from edge_sdk.privacy import PrivacySettings
from edge_sdk.protocol import ArrayGroup

DELTA = 1e-5
REFERENCE: ArrayGroup = {"w": np.zeros((40, 100), np.float32), "count": np.zeros((), np.int64)}


def _all_correct_bound(guesses: int, level: float = 0.05) -> float:
    """Without delta, all `guesses` correct: q^r = level, epsilon = log(q / (1 - q))."""
    q = level ** (1 / guesses)
    return math.log(q / (1 - q))


def test_all_correct_guesses_give_the_closed_form_bound():
    # r = 100 all correct: q = 0.05^(1/100) = 0.97049, epsilon = log(32.89) = 3.49 (the paper's figure 1)
    assert epsilon_lower_bound(100, 100, 100, 0.0) == pytest.approx(3.4930, abs=1e-3)
    for guesses in (10, 1000):
        assert epsilon_lower_bound(guesses, guesses, guesses, 0.0) == pytest.approx(_all_correct_bound(guesses),
                                                                                    abs=1e-6)


def test_half_the_guesses_correct_bound_nothing():
    assert epsilon_lower_bound(1000, 100, 50, DELTA) == 0.0
    assert epsilon_lower_bound(1000, 100, 57, DELTA) == 0.0  # P[Binomial(100, 1/2) >= 57] = 0.097: not rejected
    assert epsilon_lower_bound(1000, 100, 60, DELTA) > 0.0  # P[... >= 60] = 0.028: rejected at epsilon 0


def test_the_bound_grows_with_the_correct_guesses_and_shrinks_with_delta():
    bounds = [epsilon_lower_bound(1000, 200, correct, 0.0) for correct in (120, 150, 180, 200)]
    assert bounds == sorted(bounds) and bounds[0] > 0
    assert epsilon_lower_bound(1000, 200, 180, 1e-4) < epsilon_lower_bound(1000, 200, 180, 0.0)


def test_the_p_value_is_the_binomial_tail_plus_the_delta_term():
    q = 1 / (1 + math.exp(-1.0))
    tail = stats.binom.sf(69, 100, q)
    assert p_value(500, 100, 70, 1.0, 0.0) == pytest.approx(tail)
    # alpha = max over i of P[70 > W >= 70 - i] / i, each term by hand
    alpha = max(sum(stats.binom.pmf(70 - j, 100, q) for j in range(1, i + 1)) / i for i in range(1, 71))
    assert p_value(500, 100, 70, 1.0, 1e-4) == pytest.approx(tail + 2 * 500 * 1e-4 * alpha)
    # at the bound the p-value crosses 0.05
    bound = epsilon_lower_bound(500, 100, 90, 1e-4)
    assert p_value(500, 100, 90, bound, 1e-4) < 0.05 <= p_value(500, 100, 90, bound + 1e-6, 1e-4)


def test_bad_counts_are_refused_by_name():
    with pytest.raises(ValueError, match="correct <= guesses <= canaries"):
        p_value(10, 20, 5, 1.0, 0.0)
    with pytest.raises(ValueError, match="guess_in"):
        score_guesses(np.zeros(4), np.zeros(4, bool), 3, 2)


def test_guesses_take_the_highest_as_in_and_the_lowest_as_out():
    scores = np.array([5.0, -1.0, 3.0, 0.0, 9.0])
    included = np.array([True, False, False, True, True])
    assert score_guesses(scores, included, 2, 2) == (4, 3)  # in: 9 (yes), 5 (yes); out: -1 (yes), 0 (no)


def _plan(mode: str, epsilon: float = 2.0) -> AuditPlan:
    settings = PrivacySettings(dp=mode, dp_epsilon=epsilon, dp_clip=1.0, dp_delta=DELTA, dp_evaluation="outside",
                               dp_reproducible_noise=True)
    return AuditPlan(settings, clients=400, rounds=2, fraction=1.0, canaries=400, guess_in=100, guess_out=100)


@pytest.mark.parametrize("mode", ["central", "local", "distributed"])
def test_the_real_mechanism_stays_below_its_epsilon(mode):
    result = run_audit(_plan(mode), REFERENCE, RandomUpdates(2.0, seed=0))
    assert result.accountant_epsilon == pytest.approx(2.0, abs=0.01)
    assert result.lower_bound < result.accountant_epsilon and not result.violated
    assert result.guesses == 200 and result.ceiling > 4  # the guesses could have shown up to 4.18


@pytest.mark.parametrize("mode", ["central", "local", "distributed"])
@pytest.mark.parametrize("scale", [0.1, 0.0])
def test_a_mechanism_with_too_little_noise_is_caught(mode, scale):
    result = run_audit(_plan(mode), REFERENCE, RandomUpdates(2.0, seed=0), _noise_scale=scale)
    assert result.lower_bound > result.accountant_epsilon + 0.3 and result.violated


def test_an_audit_repeats_and_a_new_seed_draws_new_canaries():
    plan = _plan("central")
    first, again = (run_audit(plan, REFERENCE, RandomUpdates(2.0, seed=0)) for _ in range(2))
    assert first == again
    other = run_audit(AuditPlan(**{**plan.__dict__, "seed": 1}), REFERENCE, RandomUpdates(2.0, seed=1))
    assert (other.included, other.correct) != (first.included, first.correct)


def test_a_plan_outside_the_audit_is_refused_by_name():
    settings = PrivacySettings(dp="central", dp_epsilon=1.0)
    with pytest.raises(ValueError, match="canaries must be between 1 and clients"):
        AuditPlan(settings, clients=10, rounds=1, fraction=1.0, canaries=20, guess_in=1, guess_out=1)
    with pytest.raises(ValueError, match="guess_in"):
        AuditPlan(settings, clients=10, rounds=1, fraction=1.0, canaries=10, guess_in=8, guess_out=8)
    with pytest.raises(ValueError, match="dp must be central, local or distributed"):
        AuditPlan(PrivacySettings(), clients=10, rounds=1, fraction=1.0, canaries=10, guess_in=1, guess_out=1)


def test_trained_updates_are_real_local_training_that_repeats():
    updates = TrainedUpdates("user_models:tiny_mlp", "digits", devices=20, seed=0)
    reference = updates.initial()

    first, again = updates.change(3, reference, 1), updates.change(3, reference, 1)
    other_device = updates.change(4, reference, 1)

    assert set(first) == set(reference) and all(np.isfinite(v).all() for v in first.values())
    assert all(np.array_equal(first[key], again[key]) for key in first)
    assert 0 < sum(float(np.vdot(v, v)) for v in first.values())
    assert any(not np.array_equal(first[key], other_device[key]) for key in first)


def test_an_audit_among_trained_devices_catches_a_mechanism_without_noise():
    updates = TrainedUpdates("user_models:tiny_mlp", "digits", devices=40, seed=0)
    settings = PrivacySettings(dp="central", dp_epsilon=1.0, dp_clip=1.0, dp_delta=DELTA)
    plan = AuditPlan(settings, clients=100, rounds=1, fraction=1.0, canaries=60, guess_in=15, guess_out=15)

    broken = run_audit(plan, updates.initial(), updates, _noise_scale=0.0)
    honest = run_audit(plan, updates.initial(), updates)

    assert broken.violated and broken.correct == broken.guesses
    assert not honest.violated
