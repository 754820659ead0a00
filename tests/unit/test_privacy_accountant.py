"""Unit tests for coordinator.privacy.accountant: epsilon as dp_accounting composes the documented
events, a published reference figure, noise calibration, the resumable state, evaluation releases,
local DP without amplification, and the look-ahead of `epsilon_after`. Nothing here is random."""

from __future__ import annotations

import copy
import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from coordinator.privacy.accountant import RDP_ORDERS, PrivacyAccountant, calibrate_noise, local_epsilon

DELTA = 1e-5
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


def _run(accountant: str, sampling: str, population: int, sample: float, noise: float, rounds: int,
         evaluations: int = 0, eval_noise: float = 10.0) -> PrivacyAccountant:
    """An accountant with `rounds` rounds, then `evaluations` evaluation releases, composed."""
    run = PrivacyAccountant(accountant, sampling, DELTA)
    for _ in range(rounds):
        run.add_round(population, sample, noise)
    for _ in range(evaluations):
        run.add_evaluation(eval_noise)
    return run


# -- 1. the documented events, composed by dp_accounting directly ------------------------------

@pytest.mark.parametrize("accountant, sampling, population, sample, expected_event, direct", [
    ("rdp", "fixed", 100, 10,
     dp_accounting.SampledWithoutReplacementDpEvent(100, 10, dp_accounting.GaussianDpEvent(1.3 / 2)),
     lambda: RdpAccountant(list(RDP_ORDERS), REPLACE_ONE)),
    ("rdp", "fixed", 20, 20, dp_accounting.GaussianDpEvent(1.3 / 2),
     lambda: RdpAccountant(list(RDP_ORDERS), REPLACE_ONE)),
    ("rdp", "poisson", 100, 0.1, dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.3)),
     lambda: RdpAccountant(list(RDP_ORDERS))),
    ("pld", "poisson", 100, 0.1, dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.3)),
     PLDAccountant),
])
def test_epsilon_of_a_run_equals_dp_accounting_on_the_documented_events(accountant, sampling, population, sample,
                                                                       expected_event, direct):
    # Prepare
    rounds = 30
    expected = direct().compose(expected_event, rounds).get_epsilon(DELTA)

    # Execute
    epsilon = _run(accountant, sampling, population, sample, 1.3, rounds).epsilon()

    # Assert
    assert epsilon == pytest.approx(expected, rel=1e-9)
    assert 0 < epsilon < math.inf


def test_nothing_composed_is_epsilon_zero():
    # Prepare
    run = PrivacyAccountant("rdp", "fixed", DELTA)

    # Execute / Assert
    assert run.epsilon() == 0.0
    assert run.rounds == 0


def test_identical_rounds_are_kept_as_one_counted_entry():
    # Prepare / Execute
    run = _run("rdp", "poisson", 500, 0.05, 1.0, 1000)

    # Assert
    assert run.to_state()["releases"] == [{"release": "round", "noise": 1.0, "probability": 0.05, "count": 1000}]
    assert run.rounds == 1000


# -- 2. a published figure ---------------------------------------------------------------------

def test_the_tensorflow_privacy_tutorial_figure_reproduces():
    """TensorFlow Privacy's tutorial "Implement Differential Privacy with TensorFlow Privacy"
    (tensorflow.org/responsible_ai/privacy/tutorials/classification_privacy) trains MNIST (60000
    examples) with batch size 250, noise_multiplier 1.3 and microbatches, for 3 epochs, and states:
    "the trained model has an epsilon value of 3.426" at delta 1e-5 (RDP, Poisson sampling). Its
    accounting doubles the sensitivity under microbatching (noise multiplier 1.3 / 2 = 0.65 on
    sensitivity C, our Poisson convention) and counts ceil(3 / q) = 720 steps of q = 250 / 60000."""
    # Prepare
    q = 250 / 60000
    steps = math.ceil(3 / q)

    # Execute
    epsilon = _run("rdp", "poisson", 60000, q, 1.3 / 2, steps).epsilon()

    # Assert: within the rounding of the published 3.426
    assert steps == 720
    assert abs(epsilon - 3.426) <= 0.0005


# -- 3. calibration ----------------------------------------------------------------------------

@pytest.mark.parametrize("accountant, sampling, population, sample, rounds, evaluations", [
    ("rdp", "fixed", 50, 10, 40, 40),
    ("rdp", "poisson", 50, 0.2, 40, 0),
    ("pld", "poisson", 50, 0.2, 20, 5),
])
def test_calibrated_noise_spends_the_target_and_no_more(accountant, sampling, population, sample, rounds, evaluations):
    # Prepare
    target = 4.0

    # Execute
    noise = calibrate_noise(accountant, sampling, population, sample, rounds, DELTA, target,
                            evaluations=evaluations, eval_noise=20.0)
    spent = _run(accountant, sampling, population, sample, noise, rounds, evaluations, 20.0).epsilon()

    # Assert
    assert 0.98 * target <= spent <= target


def test_calibrated_local_noise_spends_the_target_of_a_device_in_every_round():
    # Prepare
    target, rounds = 6.0, 30

    # Execute
    noise = calibrate_noise("rdp", "poisson", 40, 0.25, rounds, DELTA, target, evaluations=10, eval_noise=20.0,
                            local=True)
    spent = local_epsilon("poisson", noise, rounds, DELTA, evaluations=10, eval_noise=20.0)

    # Assert
    assert 0.98 * target <= spent <= target


def test_a_larger_target_calibrates_a_smaller_noise():
    # Execute
    strict = calibrate_noise("rdp", "poisson", 100, 0.1, 50, DELTA, 2.0)
    loose = calibrate_noise("rdp", "poisson", 100, 0.1, 50, DELTA, 8.0)

    # Assert
    assert loose < strict


def test_a_target_the_evaluation_releases_alone_exceed_is_refused():
    # Execute / Assert
    with pytest.raises(ValueError, match="evaluation releases alone spend"):
        calibrate_noise("rdp", "poisson", 100, 0.1, 50, DELTA, 1.0, evaluations=100, eval_noise=1.0)


def test_a_target_met_by_any_noise_in_range_is_refused():
    # Execute / Assert
    with pytest.raises(ValueError, match="met even with noise multiplier"):
        calibrate_noise("rdp", "poisson", 100, 0.1, 5, DELTA, 1e9)


# -- 4. resuming -------------------------------------------------------------------------------

@pytest.mark.parametrize("accountant, sampling, population, sample", [
    ("rdp", "fixed", 30, 6),
    ("pld", "poisson", 30, 0.2),
])
def test_a_resumed_accountant_equals_one_that_composed_every_round(accountant, sampling, population, sample):
    # Prepare
    first = PrivacyAccountant(accountant, sampling, DELTA)
    uninterrupted = PrivacyAccountant(accountant, sampling, DELTA)
    for round_ in range(20):
        for run in (first, uninterrupted) if round_ < 12 else (uninterrupted,):
            run.add_round(population, sample, 1.1)
            run.add_evaluation(15.0)
    first.epsilon()

    # Execute
    resumed = PrivacyAccountant.from_state(json.loads(json.dumps(first.to_state())))
    for _ in range(8):
        resumed.add_round(population, sample, 1.1)
        resumed.add_evaluation(15.0)

    # Assert
    assert resumed.to_state() == uninterrupted.to_state()
    assert resumed.epsilon() == pytest.approx(uninterrupted.epsilon(), rel=1e-12)
    assert resumed.epsilon() > first.epsilon()


def _fixed_state() -> dict:
    """A well-formed state of a fixed-sampling RDP run."""
    run = _run("rdp", "fixed", 30, 6, 1.1, 3, evaluations=2)
    return run.to_state()


def _poisson_state() -> dict:
    """A well-formed state of a Poisson-sampling RDP run."""
    return _run("rdp", "poisson", 30, 0.2, 1.1, 3).to_state()


def _with(state: dict, path: tuple, value) -> dict:
    """`state` with the item at `path` set to `value` (deleted when value is the `...` marker)."""
    state = copy.deepcopy(state)
    target = state
    for key in path[:-1]:
        target = target[key]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return state


@pytest.mark.parametrize("state, message", [
    ([], "must be a mapping"),
    (_with(_fixed_state(), ("delta",), ...), r"lacks \['delta'\]"),
    (_with(_fixed_state(), ("extra",), 1), r"has unknown \['extra'\]"),
    (_with(_fixed_state(), ("version",), 2), "version 2"),
    (_with(_fixed_state(), ("accountant",), "pld"), "no sampling without replacement"),
    (_with(_fixed_state(), ("sampling",), "stratified"), "sampling must be one of"),
    (_with(_fixed_state(), ("delta",), 0.0), r"delta must be in \(0, 1\)"),
    (_with(_fixed_state(), ("releases",), {}), "releases must be a list"),
    (_with(_fixed_state(), ("releases", 0), 7), "release 0: must be a mapping"),
    (_with(_fixed_state(), ("releases", 0, "release"), "model"), "release must be 'round' or 'evaluation'"),
    (_with(_fixed_state(), ("releases", 0, "count"), 0), "count must be an integer of at least 1"),
    (_with(_fixed_state(), ("releases", 0, "count"), True), "count must be an integer"),
    (_with(_fixed_state(), ("releases", 0, "count"), 2.5), "count must be an integer"),
    (_with(_fixed_state(), ("releases", 0, "sample"), 31), "exceeds the population"),
    (_with(_fixed_state(), ("releases", 0, "population"), ...), r"lacks \['population'\]"),
    (_with(_fixed_state(), ("releases", 0, "noise"), -1.0), "noise multiplier must be a positive finite"),
    (_with(_fixed_state(), ("releases", 1, "noise"), float("nan")), "evaluation noise multiplier must be"),
    (_with(_fixed_state(), ("releases", 1), _fixed_state()["releases"][0]), "release 1 repeats an earlier one"),
    (_with(_poisson_state(), ("releases", 0, "probability"), 1.5), "at most 1"),
    (_with(_poisson_state(), ("releases", 0, "population"), 30), r"has unknown \['population'\]"),
])
def test_a_malformed_state_is_refused_naming_what_is_wrong(state, message):
    # Execute / Assert
    with pytest.raises(ValueError, match=message):
        PrivacyAccountant.from_state(state)


def test_the_well_formed_states_of_the_malformed_test_load():
    # Execute / Assert
    assert PrivacyAccountant.from_state(_fixed_state()).rounds == 3
    assert PrivacyAccountant.from_state(_poisson_state()).rounds == 3


# -- 5. evaluation releases and local DP -------------------------------------------------------

def test_evaluation_releases_add_to_epsilon():
    # Prepare
    rounds_only = _run("rdp", "poisson", 100, 0.1, 1.0, 20)
    evaluation_only = _run("rdp", "poisson", 100, 0.1, 1.0, 0, evaluations=5, eval_noise=10.0)

    # Execute
    both = _run("rdp", "poisson", 100, 0.1, 1.0, 20, evaluations=5, eval_noise=10.0)

    # Assert
    direct = RdpAccountant(list(RDP_ORDERS)).compose(dp_accounting.GaussianDpEvent(10.0), 5).get_epsilon(DELTA)
    assert evaluation_only.epsilon() == pytest.approx(direct, rel=1e-9)
    assert both.epsilon() > rounds_only.epsilon() > 0


@pytest.mark.parametrize("sampling, population, sample, base_noise, relation", [
    ("fixed", 100, 10, 2.0 / 2, REPLACE_ONE),
    ("poisson", 100, 0.1, 2.0, dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE),
])
def test_local_epsilon_has_no_amplification_by_sampling(sampling, population, sample, base_noise, relation):
    # Prepare
    rounds = 25
    central = _run("rdp", sampling, population, sample, 2.0, rounds).epsilon()
    unamplified = (RdpAccountant(list(RDP_ORDERS), relation).compose(dp_accounting.GaussianDpEvent(base_noise), rounds)
                   .get_epsilon(DELTA))

    # Execute
    local = local_epsilon(sampling, 2.0, rounds, DELTA)

    # Assert
    assert local == pytest.approx(unamplified, rel=1e-9)
    assert local > central


def test_local_epsilon_counts_evaluations_and_is_zero_without_releases():
    # Execute
    nothing = local_epsilon("poisson", 1.0, 0, DELTA)
    uploads = local_epsilon("poisson", 1.0, 10, DELTA)
    with_evaluations = local_epsilon("poisson", 1.0, 10, DELTA, evaluations=3, eval_noise=10.0)

    # Assert
    assert nothing == 0.0
    assert with_evaluations > uploads > 0


# -- 6. looking one round ahead ----------------------------------------------------------------

@pytest.mark.parametrize("accountant, sampling, population, sample", [
    ("rdp", "fixed", 30, 6),
    ("pld", "poisson", 30, 0.2),
])
def test_epsilon_after_looks_ahead_without_changing_the_state(accountant, sampling, population, sample):
    # Prepare
    run = _run(accountant, sampling, population, sample, 1.1, 10, evaluations=1, eval_noise=15.0)
    before, state = run.epsilon(), run.to_state()
    next_round = _run(accountant, sampling, population, sample, 1.1, 11, evaluations=1, eval_noise=15.0)
    next_with_evaluation = _run(accountant, sampling, population, sample, 1.1, 11, evaluations=2, eval_noise=15.0)

    # Execute
    after = run.epsilon_after(population, sample, 1.1)
    after_with_evaluation = run.epsilon_after(population, sample, 1.1, eval_noise=15.0)

    # Assert
    assert run.to_state() == state
    assert run.epsilon() == before
    assert after == pytest.approx(next_round.epsilon(), rel=1e-12)
    assert after_with_evaluation == pytest.approx(next_with_evaluation.epsilon(), rel=1e-12)
    assert after_with_evaluation > after > before


# -- arguments ---------------------------------------------------------------------------------

@pytest.mark.parametrize("call, message", [
    (lambda: PrivacyAccountant("pld", "fixed", DELTA), "no sampling without replacement"),
    (lambda: PrivacyAccountant("moments", "poisson", DELTA), "accountant must be one of"),
    (lambda: PrivacyAccountant("rdp", "fixed", 1.0), "delta must be in"),
    (lambda: PrivacyAccountant("rdp", "fixed", DELTA).add_round(10, 11, 1.0), "exceeds the population"),
    (lambda: PrivacyAccountant("rdp", "fixed", DELTA).add_round(10, 0.5, 1.0), "sample size m must be an integer"),
    (lambda: PrivacyAccountant("rdp", "poisson", DELTA).add_round(10, 1.5, 1.0), "at most 1"),
    (lambda: PrivacyAccountant("rdp", "poisson", DELTA).add_round(10, 0.5, 0.0), "noise multiplier must be"),
    (lambda: PrivacyAccountant("rdp", "poisson", DELTA).add_evaluation(math.inf), "evaluation noise multiplier"),
])
def test_bad_arguments_are_refused(call, message):
    # Execute / Assert
    with pytest.raises(ValueError, match=message):
        call()


def test_a_round_looked_ahead_and_then_added_gives_the_same_epsilon_as_one_added_directly():
    # Prepare: two accountants of the same run; one checks its budget before each round
    checked, direct = (PrivacyAccountant("rdp", "fixed", 1e-5) for _ in range(2))

    # Execute: the looked-ahead round is added as predicted, then one that was not predicted
    for accountant in (checked, direct):
        accountant.add_round(100, 10, 1.3)
    ahead = checked.epsilon_after(100, 10, 1.3, eval_noise=10.0)
    for accountant in (checked, direct):
        accountant.add_round(100, 10, 1.3)
        accountant.add_evaluation(10.0)
    after_prediction, direct_at_that_point = checked.epsilon(), direct.epsilon()
    checked.epsilon_after(100, 10, 1.3)
    for accountant in (checked, direct):
        accountant.add_round(90, 9, 1.3)  # not what was looked ahead at

    # Assert
    assert ahead == after_prediction == pytest.approx(direct_at_that_point, rel=1e-12)
    assert checked.epsilon() == pytest.approx(direct.epsilon(), rel=1e-12)
    assert checked.to_state() == direct.to_state()


# -- delta: far below 1 / N by default, refused by name at 1 / N or more -----------------------

@pytest.mark.parametrize("individuals", [1, 10, 100, 1000, 10_000, 1_000_000])
def test_the_default_delta_is_at_most_1e_5_and_a_hundredth_of_one_over_n(individuals):
    from edge_sdk.privacy import PrivacySettings

    settings = PrivacySettings(dp="central", dp_noise=1.0, dp_sgd=True)

    for delta in (settings.delta_for(individuals), settings.dp_sgd_delta_for(individuals)):
        assert delta <= 1e-5 and delta * individuals <= 0.01
        assert delta == min(1e-5, 0.01 / individuals)  # as PRIVACY.md states it


def test_a_run_delta_of_one_over_the_devices_or_more_is_refused_at_start_by_name():
    from coordinator.config.run_config import RunConfig
    from edge_sdk.config import ConfigError

    with pytest.raises(ConfigError, match=r"dp_delta \(--dp-delta\) 0.1 must be below 1 over the 10 devices"):
        RunConfig.of(clients=10, dp="central", dp_noise=1.0, dp_delta=0.1)
    assert RunConfig.of(clients=10, dp="central", dp_noise=1.0, dp_delta=0.099).privacy.delta_for(10) == 0.099
    assert RunConfig.of(clients=10, dp_delta=0.5).privacy.dp_delta == 0.5  # no --dp: no guarantee to refuse


def test_a_dp_sgd_delta_of_one_over_the_devices_examples_or_more_is_refused_by_name():
    from edge_sdk.config import ConfigError
    from edge_sdk.privacy import PrivacySettings

    settings = PrivacySettings(dp_sgd=True, dp_sgd_delta=1e-3)

    with pytest.raises(ConfigError, match=r"dp_sgd_delta \(--dp-sgd-delta\) 0.001 must be below 1 over the 1000 "
                                          "training examples"):
        settings.dp_sgd_delta_for(1000)
    assert settings.dp_sgd_delta_for(999) == 1e-3
