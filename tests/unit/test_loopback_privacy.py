"""Private runs over the loopback broker (tests/loopback_runs.py): what leaves a device under
`--dp`, the epsilon a run reports, the refusals, the budget stop and a resume's accountant."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from coordinator.privacy.accountant import PrivacyAccountant, local_epsilon
from coordinator.privacy.budget import BudgetSpent
from coordinator.run import checkpoint
from edge_sdk.config import ConfigError
from edge_sdk.privacy.disclosure import FIGURES
from edge_sdk.privacy.upstream import change_norm
from edge_sdk.protocol import Kind
from loopback_runs import drain, listener
from saved_runs import checkpoint_at

PRIVATE_ALGORITHMS = ("local", "fedavg", "fedavg_ft", "fedprox", "fedper", "fedrep", "lg_fedavg", "repper", "dualfed",
                      "cd2_pfed", "fedios")
CLIP = 0.05


def run_delta(devices: int) -> float:
    """The documented default delta of a run of `devices` devices."""
    return min(1e-5, 0.01 / devices)


def private_config(federation, **changes):
    settings = dict(dp="central", dp_clip=CLIP, dp_noise=1.0, dp_reproducible_noise=True)
    return federation.config(**{**settings, **changes})


@pytest.mark.parametrize("algorithm", PRIVATE_ALGORITHMS)
def test_every_upload_of_a_private_run_moves_at_most_c_and_says_nothing_of_the_data(federation, algorithm):
    # Prepare: spies on what comes down and what goes up
    coordinator = federation.coordinator(private_config(federation, algorithm=algorithm))
    down = listener(federation.broker, "spy-train", f"{federation.topics.prefix}/down/all/train", federation.topics)
    up = federation.spy(Kind.TRAIN_RES)
    hellos = federation.spy(Kind.HELLO)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    report = coordinator.run()

    # Assert: each update's change from its round's broadcast is within C; no figure of the data
    sent = {envelope.round: envelope.groups for envelope in drain(down)}
    updates = drain(up)
    assert len(updates) == 6
    for update in updates:
        assert change_norm(update.groups, sent[update.round]) <= CLIP * (1 + 1e-5)
        assert update.metrics == {}
    for hello in drain(hellos):
        assert "num_examples" not in hello.metrics and "label_counts" not in hello.config
    assert report["privacy"]["epsilon"] > 0


def test_the_epsilon_a_run_reports_is_dp_accounting_s_for_its_rounds_and_evaluations(federation):
    # Prepare: 4 devices, 2 sampled per round, evaluations every round, released privately
    config = private_config(federation, clients=4, fraction=0.5, rounds=3)
    coordinator = federation.coordinator(config)
    for i in range(4):
        federation.start_device(i, 4)

    # Execute
    report = coordinator.run()

    # Assert: the same figure as composing the run's events directly, every round in metrics.jsonl
    delta = run_delta(4)
    expected = PrivacyAccountant("rdp", "fixed", delta)
    per_round = []
    for _ in range(3):
        expected.add_round(4, 2, 1.0)
        expected.add_evaluation(10.0)
        per_round.append(expected.epsilon())
    assert report["privacy"]["epsilon"] == pytest.approx(per_round[-1], rel=1e-9)
    assert [r["privacy"]["epsilon"] for r in report["rounds"]] == pytest.approx(per_round, rel=1e-9)
    lines = [json.loads(line) for line in federation.folder.metrics.read_text().splitlines()]
    assert [line["privacy"]["epsilon"] for line in lines if line["event"] == "round"] == pytest.approx(per_round)
    assert report["privacy"]["delta"] == pytest.approx(delta)
    final = report["final"]
    assert all(client["accuracy"] is None for client in final["per_client"].values())  # only the noised mean
    assert final["personalized_accuracy"]["mean"] == report["privacy"]["released_accuracy"]


def test_an_algorithm_that_uploads_class_statistics_refuses_dp_by_name(federation):
    with pytest.raises(ConfigError, match="dc_pfl uploads class statistics .*'stats'"):
        federation.coordinator(private_config(federation, algorithm="dc_pfl"))


@pytest.mark.parametrize(("changes", "named"), [
    (dict(dp="distributed"), "secure aggregation"),
    (dict(aggregation="median"), "aggregation median"),
    (dict(late_updates="next_round"), "late_updates"),
    (dict(dp="local", max_update_norm=5.0), "max_update_norm"),
    (dict(algorithm="fedavg", release=True), "BatchNorm statistics"),
])
def test_settings_that_would_leave_a_message_uncovered_are_refused_by_name(federation, changes, named):
    with pytest.raises(ConfigError, match=named):
        federation.coordinator(private_config(federation, **changes))


def test_a_run_stops_when_its_budget_is_spent_and_a_resume_continues_the_accountant(federation):
    # Prepare: z fixed, a budget that allows two of the three rounds (evaluations outside the guarantee)
    probe = PrivacyAccountant("rdp", "fixed", run_delta(3))
    probe.add_round(3, 3, 1.0)
    probe.add_round(3, 3, 1.0)
    budget = (probe.epsilon() + probe.epsilon_after(3, 3, 1.0)) / 2
    config = private_config(federation, rounds=3, dp_epsilon=budget, dp_evaluation="outside")
    coordinator = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    report = coordinator.run()

    # Assert: two rounds played, the third refused, the report says why; the accountant is saved
    assert report["rounds_completed"] == 2
    assert "privacy budget spent" in report["stopped"]
    assert report["privacy"]["epsilon"] == pytest.approx(probe.epsilon(), rel=1e-9)
    assert report["privacy"]["outside_the_guarantee"] == ["evaluation figures"]
    assert report["privacy"]["randomness"] == "the run's seed"  # dp_reproducible_noise
    resumed = federation.coordinator(config.replace(dp_epsilon=budget * 10))
    assert resumed.privacy is not None and resumed.privacy.epsilon() == pytest.approx(probe.epsilon(), rel=1e-9)
    with pytest.raises(BudgetSpent):
        federation.coordinator(config).privacy.check_budget(3)


def resume_for_the_final_evaluation(federation, config) -> dict:
    """Resume the finished run in `config`'s folder as if it had stopped after its last round's
    checkpoint and before its final evaluation; returns the resumed run's report."""
    saved = checkpoint_at(federation.folder.checkpoint)
    checkpoint.save(federation.folder.checkpoint, dataclasses.replace(saved, history={**saved.history, "final": None}))
    federation.folder.report.unlink()
    federation.devices_exit()
    federation.threads.clear()
    coordinator = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)
    return coordinator.run()


def test_a_resumed_run_s_final_evaluation_is_budget_checked_and_accounted(federation):
    # Prepare: one round and its evaluation played; a budget that takes one more evaluation, and one that does not
    probe = PrivacyAccountant("rdp", "fixed", run_delta(3))
    probe.add_round(3, 3, 1.0)
    probe.add_evaluation(10.0)
    played = probe.epsilon()
    probe.add_evaluation(10.0)
    config = private_config(federation, rounds=1)
    coordinator = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)
    assert coordinator.run()["privacy"]["evaluations_accounted"] == 1
    evaluations = listener(federation.broker, "spy-evaluate", f"{federation.topics.prefix}/down/all/evaluate",
                           federation.topics)
    replies = federation.spy(Kind.EVAL_RES)

    # Execute: resumed below the budget the evaluation needs, then above it
    short = resume_for_the_final_evaluation(federation, config.replace(dp_epsilon=(played + probe.epsilon()) / 2))
    withheld = [json.loads(line) for line in federation.folder.metrics.read_text().splitlines()
                if json.loads(line)["event"] == "evaluation_withheld"]
    asked, answered = drain(evaluations), drain(replies)
    enough = resume_for_the_final_evaluation(federation, config.replace(dp_epsilon=probe.epsilon() * 2))

    # Assert: below the budget the devices were asked for no figures, sent none, nothing was
    # released or accounted, and the log names the evaluation; above it the evaluation is accounted
    assert [w["evaluation"] for w in withheld] == ["the final evaluation"]
    assert "privacy budget spent" in withheld[0]["reason"]
    assert [e.config.get(FIGURES) for e in asked] == [False]
    assert len(answered) == 3 and all(e.metrics == {} for e in answered)
    assert short["privacy"]["evaluations_accounted"] == 1 and short["privacy"]["released_accuracy"] is None
    assert short["privacy"]["epsilon"] == pytest.approx(played, rel=1e-9)
    assert enough["privacy"]["evaluations_accounted"] == 2
    assert enough["privacy"]["epsilon"] == pytest.approx(probe.epsilon(), rel=1e-9)
    saved = PrivacyAccountant.from_state(checkpoint_at(federation.folder.checkpoint).history["privacy"]["accountant"])
    assert saved.evaluations == 2, "a further resume continues from the evaluation released"


def test_an_evaluation_outside_a_round_is_refused_by_name_when_it_would_exceed_the_budget():
    from coordinator.privacy.run import RunPrivacy
    from edge_sdk.privacy import PrivacySettings

    def privacy(budget: float, evaluation: str = "private") -> RunPrivacy:
        settings = PrivacySettings(dp="central", dp_noise=1.0, dp_epsilon=budget, dp_evaluation=evaluation,
                                   dp_delta=1e-5)
        return RunPrivacy(settings, devices=4, population=4, fraction=1.0, rounds=1, evaluations=1, seed=0)

    once = PrivacyAccountant("rdp", "fixed", 1e-5)
    once.add_evaluation(10.0)
    with pytest.raises(BudgetSpent, match="the release's evaluation would reach"):
        privacy(once.epsilon() * 0.99).check_evaluation("the release's evaluation")
    privacy(once.epsilon() * 1.01).check_evaluation("the release's evaluation")
    privacy(once.epsilon() * 0.5, "outside").check_evaluation("the release's evaluation")  # outside: nothing released


def test_a_private_round_s_aggregate_is_noised_around_the_fixed_denominator_mean(federation):
    # Prepare: one round, noise drawn from the seed, so the same run is made twice
    config = private_config(federation, rounds=1, dp_noise=4.0, dp_evaluation="outside")
    coordinator = federation.coordinator(config)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    coordinator.run()

    # Assert: the global state moved by more than the clipped changes could (noise of std zC/m)
    state = coordinator.algorithm.state["shared"]
    initial = type(coordinator.algorithm)(coordinator.hyper, coordinator.algorithm.context).state["shared"]
    moved = np.sqrt(sum(float(np.sum((state[k].astype(np.float64) - initial[k]) ** 2)) for k in state
                        if state[k].dtype.kind == "f"))
    assert moved > CLIP  # three changes of norm <= C over m = 3 move it by <= C; the noise does the rest


def test_adaptive_clipping_moves_c_by_the_devices_noised_count_and_every_upload_keeps_to_its_round(federation):
    # Prepare: C starts tiny, so every change is outside it and C grows toward the median norm
    config = private_config(federation, rounds=3, dp_adaptive_clip=True, dp_clip_count_noise=1.0,
                            dp_evaluation="outside")
    coordinator = federation.coordinator(config)
    down = listener(federation.broker, "spy-train", f"{federation.topics.prefix}/down/all/train", federation.topics)
    up = federation.spy(Kind.TRAIN_RES)
    for i in range(3):
        federation.start_device(i, 3)

    # Execute
    report = coordinator.run()

    # Assert: each TRAIN names its round's C, each upload keeps to it and says whether it was within
    trains = {envelope.round: envelope for envelope in drain(down)}
    clips = [trains[r].config["dp_clip"] for r in (1, 2, 3)]
    assert clips[0] == CLIP and len(set(clips)) == 3
    for update in drain(up):
        clip = trains[update.round].config["dp_clip"]
        assert change_norm(update.groups, trains[update.round].groups) <= clip * (1 + 1e-5)
        assert update.metrics in ({"dp_within_clip": 0.0}, {"dp_within_clip": 1.0})
    assert [r["privacy"]["clip"] for r in report["rounds"]] == clips


def test_the_adaptive_clip_rule_and_the_split_of_the_noise():
    from coordinator.privacy.run import RunPrivacy
    from edge_sdk.privacy import PrivacySettings
    from edge_sdk.protocol import ValidationError

    settings = PrivacySettings(dp="central", dp_clip=1.0, dp_noise=1.0, dp_adaptive_clip=True,
                               dp_clip_count_noise=1.0, dp_clip_lr=0.5, dp_clip_quantile=0.25,
                               dp_reproducible_noise=True)
    privacy = RunPrivacy(settings, devices=8, population=8, fraction=0.5, rounds=2, evaluations=0, seed=0)
    assert privacy.update_noise == pytest.approx((1.0 - 0.25) ** -0.5)  # (z^-2 - (2 sigma_b)^-2)^-1/2

    for within in (1.0, 1.0, 0.0, 1):
        privacy.note_update({"dp_within_clip": within})
    noise = np.random.default_rng([0, 1, sum(b"clip count")]).normal(0.0, 1.0)
    privacy.round_ended(8, ["a", "b", "c", "d"], 1)

    share = (3 + noise) / 4
    assert privacy.clip == pytest.approx(np.exp(-0.5 * (share - 0.25)))
    with pytest.raises(ValidationError, match="dp_within_clip"):
        privacy.note_update({"dp_within_clip": 0.5})
    with pytest.raises(ConfigError, match="dp_clip_count_noise"):
        RunPrivacy(PrivacySettings(dp="central", dp_noise=3.0, dp_adaptive_clip=True, dp_clip_count_noise=1.0),
                   devices=8, population=8, fraction=0.5, rounds=2, evaluations=0, seed=0)


def test_poisson_sampling_selects_each_device_on_its_own_and_pld_accounts_it(federation):
    # Prepare: each of 4 devices sampled with probability 0.5 a round; the PLD accountant
    config = private_config(federation, clients=4, fraction=0.5, rounds=3, dp_sampling="poisson",
                            dp_accountant="pld", dp_evaluation="outside")
    coordinator = federation.coordinator(config)
    for i in range(4):
        federation.start_device(i, 4)

    # Execute
    report = coordinator.run()

    # Assert: each round as large as its draw, accounted as three Poisson-sampled Gaussians
    expected = PrivacyAccountant("pld", "poisson", run_delta(4))
    for _ in range(3):
        expected.add_round(4, 0.5, 1.0)
    assert report["privacy"]["epsilon"] == pytest.approx(expected.epsilon(), rel=1e-9)
    sizes = [r["selected"] for r in report["rounds"]]
    draws = [coordinator.privacy.select([f"dev{i:03d}" for i in range(4)], r) for r in (1, 2, 3)]
    assert sizes == [len(d) for d in draws]


def test_a_device_that_uploads_twice_in_a_round_is_accounted_twice():
    from coordinator.privacy.run import RunPrivacy
    from edge_sdk.privacy import PrivacySettings

    privacy = RunPrivacy(PrivacySettings(dp="local", dp_noise=2.0, dp_evaluation="outside"), devices=4, population=4,
                         fraction=0.5, rounds=3, evaluations=0, seed=0)
    privacy.note_upload("dev000", "a")
    privacy.note_upload("dev000", "a")  # the same message again (QoS 1): one release
    privacy.note_upload("dev001", "b")
    privacy.note_upload("dev001", "c")  # trained again after a restart: a second release
    privacy.round_ended(4, ["dev000", "dev001"], 1)

    assert dict(privacy.participations) == {"dev000": 1, "dev001": 2}
    assert privacy.epsilon() == pytest.approx(local_epsilon("fixed", 2.0, 2, run_delta(4)))


def weak_device_run(federation, **changes):
    """RepPer under DP, three trainers and a weak device (dev003), one round, then the release;
    returns (report, the weak device, its EVAL_RES)."""
    config = private_config(federation, algorithm="repper", clients=4, lite_fraction=0.25, rounds=1, **changes)
    coordinator = federation.coordinator(config)
    replies = federation.spy(Kind.EVAL_RES)
    for i in range(3):
        federation.start_device(i, 4)
    lite = federation.start_lite(3, 4)
    report = coordinator.run()
    assert federation.devices_exit()
    return report, lite, [e for e in drain(replies) if e.sender == "dev003"]


def test_a_weak_device_s_evaluation_under_dp_says_neither_what_it_runs_nor_why(federation):
    # Execute
    report, lite, (reply,) = weak_device_run(federation)

    # Assert: the release it evaluated (the coordinator's own) and its accuracy, nothing else
    assert lite.evaluation is not None and lite.deployed is not None
    assert set(reply.config) - {"in_reply_to"} == {"release"} and set(reply.metrics) == {"accuracy"}
    assert report["privacy"]["evaluations_accounted"] == 2


def test_a_release_evaluation_beyond_the_budget_releases_no_figures_and_the_weak_device_still_deploys(federation):
    # Prepare: a budget that takes the round and its evaluation, not the release's evaluation
    probe = PrivacyAccountant("rdp", "fixed", run_delta(4))
    probe.add_round(3, 3, 1.0)
    probe.add_evaluation(10.0)
    played = probe.epsilon()
    probe.add_evaluation(10.0)

    # Execute
    report, lite, (reply,) = weak_device_run(federation, dp_epsilon=(played + probe.epsilon()) / 2)

    # Assert: the weak device fitted and deployed its model, and said nothing; nothing was released
    assert lite.evaluation is not None and lite.model_path.exists()
    assert reply.metrics == {} and set(reply.config) - {"in_reply_to"} == {"release"}
    assert report["privacy"]["evaluations_accounted"] == 1 and report["privacy"]["released_accuracy"] is None
    lines = [json.loads(line) for line in federation.folder.metrics.read_text().splitlines()]
    assert [line["evaluation"] for line in lines if line["event"] == "evaluation_withheld"] == [
        "the release's evaluation"]


@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_adaptive_clipping_is_accounted_as_the_update_and_the_count_at_their_true_sensitivities(sampling):
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from coordinator.privacy.mechanism import centred_count
    from coordinator.privacy.run import RunPrivacy
    from edge_sdk.privacy import PrivacySettings
    from edge_sdk.privacy.rdp import rdp_orders

    # Prepare: m = 40 of N = 400 a round (q = 0.1), z = 1, the default count noise m / 20, 100 rounds
    settings = PrivacySettings(dp="central", dp_clip=1.0, dp_noise=1.0, dp_adaptive_clip=True, dp_sampling=sampling)
    privacy = RunPrivacy(settings, devices=400, population=400, fraction=0.1, rounds=100, evaluations=0, seed=0)

    # Execute
    for round_ in range(1, 101):
        privacy.round_ended(400, [], round_)

    # Assert: the count's sensitivity measured on the statistic the coordinator noises: 1/2 when a
    # device is added or removed, 1 when one is replaced (a bit flips)
    bits = [1.0, 0.0, 1.0, 1.0, 0.0]
    added = {abs(centred_count([*bits, b]) - centred_count(bits)) for b in (0.0, 1.0)}
    replaced = {abs(centred_count([1 - bits[0], *bits[1:]]) - centred_count(bits))}
    count_sensitivity = max(added) if sampling == "poisson" else max(replaced)
    update_sensitivity = 1.0 if sampling == "poisson" else 2.0  # x C
    # two Gaussian mechanisms composed: the sum (noise z_delta C) and the count (noise sigma_b),
    # one Gaussian of noise 1 / mu on a sensitivity-1 query, sampled as the round is
    mu = math.hypot(update_sensitivity / privacy.update_noise, count_sensitivity / privacy.count_noise)
    joint = dp_accounting.GaussianDpEvent(1 / mu)
    event = (dp_accounting.PoissonSampledDpEvent(0.1, joint) if sampling == "poisson"
             else dp_accounting.SampledWithoutReplacementDpEvent(400, 40, joint))
    relation = (dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE if sampling == "poisson"
                else dp_accounting.NeighboringRelation.REPLACE_ONE)
    expected = RdpAccountant(list(rdp_orders()), relation).compose(event, 100).get_epsilon(privacy.delta)
    assert privacy.count_noise == 2.0
    assert privacy.epsilon() == pytest.approx(expected, rel=1e-6)
