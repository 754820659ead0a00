"""Unit tests for coordinator.rounds.collector: seeded selection and the round collector (fake times)."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.rounds.collector import (
    LateUpdates,
    Outcome,
    RoundCollector,
    round_windows,
    select_clients,
    staleness_weight,
)
from edge_sdk.protocol import Reason

DEVICES = [f"dev{i:03d}" for i in range(10)]


# -- select_clients ------------------------------------------------------------------------


def test_selection_is_deterministic_per_seed_and_round_and_ignores_input_order():
    # Execute
    first = select_clients(DEVICES, 0.3, seed=11, round_=4)
    again = select_clients(list(reversed(DEVICES)), 0.3, seed=11, round_=4)

    # Assert
    assert first == again
    assert len(first) == 3 and len(set(first)) == 3
    assert set(first) <= set(DEVICES) and first == sorted(first)


@pytest.mark.parametrize(
    "fraction, minimum, expected",
    [(0.3, 1, 3), (1.0, 1, 10), (0.01, 1, 1), (0.01, 2, 2), (0.1, 4, 4), (0.5, 20, 10)],
)
def test_fraction_and_minimum_are_respected(fraction, minimum, expected):
    assert len(select_clients(DEVICES, fraction, seed=0, round_=1, minimum=minimum)) == expected


def test_selection_differs_across_rounds_and_seeds():
    # Execute
    by_round = {tuple(select_clients(DEVICES, 0.3, seed=0, round_=r)) for r in range(1, 7)}
    by_seed = {tuple(select_clients(DEVICES, 0.3, seed=s, round_=1)) for s in range(6)}

    # Assert
    assert len(by_round) > 1
    assert len(by_seed) > 1


def test_no_devices_selects_none():
    assert select_clients([], 0.5, seed=0, round_=1) == []


# -- RoundCollector ------------------------------------------------------------------------


def _collector(selected=("a", "b", "c"), min_replies=2, deadline=100.0, grace=10.0, rejoin=0.0) -> RoundCollector:
    return RoundCollector(1, frozenset(selected), min_replies=min_replies, deadline=deadline, grace=grace,
                          rejoin=rejoin)


def test_complete_when_all_selected_replied():
    # Prepare
    collector = _collector()

    # Execute / Assert
    collector.accept("a", "m-a", now=1.0)
    assert collector.outcome(1.0) is Outcome.OPEN and not collector.enough
    collector.accept("b", "m-b", now=2.0)
    assert collector.outcome(3.0) is Outcome.OPEN and collector.enough
    collector.accept("c", "m-c", now=4.0)
    assert collector.outcome(4.0) is Outcome.COMPLETE


def test_quorum_closes_after_the_grace_period():
    # Prepare: quorum (2 of 3) reached at t=2, grace 10
    collector = _collector()
    collector.accept("a", "m-a", now=1.0)
    collector.accept("b", "m-b", now=2.0)

    # Execute / Assert
    assert collector.quorum_at == 2.0
    assert collector.outcome(11.9) is Outcome.OPEN
    assert collector.outcome(12.0) is Outcome.QUORUM


def test_deadline_closes_a_round_without_quorum():
    # Prepare
    collector = _collector()
    collector.accept("a", "m-a", now=1.0)

    # Execute / Assert
    assert collector.outcome(99.9) is Outcome.OPEN
    assert collector.outcome(100.0) is Outcome.DEADLINE
    assert not collector.enough


def test_offline_device_is_not_waited_for_once_the_quorum_is_in():
    # Prepare
    collector = _collector(grace=50.0, rejoin=20.0)
    collector.accept("a", "m-a", now=1.0)
    collector.accept("b", "m-b", now=2.0)
    assert collector.outcome(3.0) is Outcome.OPEN

    # Execute
    collector.mark_offline("c", now=3.0)

    # Assert
    assert collector.outcome(3.0) is Outcome.COMPLETE


def test_a_device_whose_reply_was_rejected_is_not_waited_for_and_not_counted():
    # Prepare
    collector = _collector(min_replies=3, grace=50.0)
    collector.accept("a", "m-a", now=1.0)
    collector.accept("b", "m-b", now=2.0)

    # Execute
    collector.refuse("c", "m-c")

    # Assert
    assert collector.outcome(3.0) is Outcome.COMPLETE
    assert not collector.enough


def test_a_rejected_reply_redelivered_is_a_duplicate_and_a_new_one_may_count():
    # Prepare
    collector = _collector()
    collector.refuse("c", "m-c")

    # Execute / Assert
    assert collector.check("c", "m-c") is Reason.DUPLICATE
    assert collector.check("c", "m-c2") is None
    collector.accept("c", "m-c2", now=1.0)
    assert collector.replied == {"c": "m-c2"} and collector.refused == {}


def test_offline_marks_for_unselected_or_replied_devices_are_ignored():
    # Prepare
    collector = _collector()
    collector.accept("a", "m-a", now=1.0)

    # Execute
    collector.mark_offline("a", now=2.0)
    collector.mark_offline("zzz", now=2.0)

    # Assert
    assert collector.offline == set()


def test_a_device_that_comes_back_and_replies_counts():
    # Prepare
    collector = _collector()
    collector.mark_offline("c", now=0.5)

    # Execute
    for name in ("a", "b", "c"):
        collector.accept(name, f"m-{name}", now=1.0)

    # Assert
    assert collector.offline == set() and collector.outcome(1.0) is Outcome.COMPLETE


def test_everyone_offline_without_replies_does_not_wait_for_the_deadline():
    # Prepare
    collector = _collector()

    # Execute
    for name in ("a", "b", "c"):
        collector.mark_offline(name, now=0.5)

    # Assert
    assert collector.outcome(1.0) is Outcome.DEADLINE
    assert not collector.enough


def _c_dropped_off_at_5_while_the_quorum_of_3_needs_it() -> RoundCollector:
    """A quorum of all three, a 10 s wait for a device that drops off; c does at t=5, after a and b answered."""
    collector = _collector(min_replies=3, rejoin=10.0)
    collector.accept("a", "m-a", now=1.0)
    collector.accept("b", "m-b", now=2.0)
    collector.mark_offline("c", now=5.0)
    return collector


def test_a_device_offline_before_answering_is_waited_for_while_the_quorum_needs_it():
    # Prepare
    collector = _c_dropped_off_at_5_while_the_quorum_of_3_needs_it()

    # Execute / Assert: open until t=15, when the wait for it ends
    assert collector.outcome(6.0) is Outcome.OPEN
    assert collector.time_left(6.0) == pytest.approx(9.0)
    assert collector.waiting == frozenset()  # not late if the round closes now
    assert collector.rejoined("c")
    collector.accept("c", "m-c", now=8.0)
    assert collector.outcome(8.0) is Outcome.COMPLETE and collector.enough


def test_a_device_that_does_not_come_back_in_time_ends_the_round_below_its_quorum():
    # Prepare
    collector = _c_dropped_off_at_5_while_the_quorum_of_3_needs_it()

    # Execute / Assert
    assert collector.outcome(14.9) is Outcome.OPEN
    assert collector.outcome(15.0) is Outcome.COMPLETE and not collector.enough


def test_no_wait_for_devices_that_cannot_bring_the_quorum_in_or_were_lost():
    # Prepare: a quorum of 3 of 4; b refused, d lost with its shard, c offline
    collector = _collector(selected=("a", "b", "c", "d"), min_replies=3, rejoin=10.0)
    collector.accept("a", "m-a", now=1.0)
    collector.refuse("b", "m-b")
    collector.lose("d")
    collector.mark_offline("c", now=2.0)

    # Execute / Assert: a and c make 2 of 3 even if c comes back
    assert collector.outcome(2.0) is Outcome.COMPLETE and not collector.enough


def test_a_lost_device_is_not_waited_for():
    # Prepare
    collector = _collector(min_replies=3, rejoin=10.0)
    collector.accept("a", "m-a", now=1.0)
    collector.accept("b", "m-b", now=1.0)

    # Execute
    collector.lose("c")

    # Assert
    assert collector.outcome(2.0) is Outcome.COMPLETE and collector.time_left(2.0) == pytest.approx(98.0)


def test_duplicate_conflicting_and_unselected_replies():
    # Prepare
    collector = _collector()
    collector.accept("a", "m1", now=1.0)

    # Execute / Assert
    assert collector.check("a", "m1") is Reason.DUPLICATE
    assert collector.check("a", "m2") is Reason.CONFLICTING_REPLY
    assert collector.check("zzz", "m3") is Reason.NOT_SELECTED
    assert collector.check("b", "m4") is None


def test_time_left_counts_down_to_the_deadline_then_to_the_end_of_grace():
    # Prepare
    collector = _collector(deadline=100.0, grace=10.0)

    # Execute / Assert: before the quorum, the deadline
    assert collector.time_left(40.0) == pytest.approx(60.0)
    collector.accept("a", "m-a", now=41.0)
    collector.accept("b", "m-b", now=42.0)
    # after the quorum, the end of grace (t=52) comes first
    assert collector.time_left(45.0) == pytest.approx(7.0)
    # never negative
    assert collector.time_left(500.0) == 0.0


def test_time_left_is_bounded_by_the_deadline_when_grace_ends_later():
    # Prepare: quorum at t=95 with grace 10 -> the deadline (100) is earlier
    collector = _collector(deadline=100.0, grace=10.0)
    collector.accept("a", "m-a", now=94.0)
    collector.accept("b", "m-b", now=95.0)

    # Execute / Assert
    assert collector.time_left(96.0) == pytest.approx(4.0)


def test_waiting_lists_the_selected_devices_neither_answered_nor_gone():
    # Prepare
    collector = _collector(selected=("a", "b", "c", "d"))

    # Execute
    collector.accept("a", "m1", now=1.0)
    collector.refuse("b", "m2")
    collector.mark_offline("c", now=1.0)

    # Assert
    assert collector.waiting == frozenset({"d"})


# -- round_windows -------------------------------------------------------------------------


def test_before_any_reply_is_measured_the_quorum_does_not_end_a_round_early():
    # Execute
    grace, timeout = round_windows(quorum_grace=10.0, round_timeout=120.0, patience=3.0, slowest_reply=None)
    collector = _collector(min_replies=1, deadline=timeout, grace=grace)
    collector.accept("a", "m1", now=1.0)

    # Assert: 60 s after the quorum the round still waits for b and c
    assert (grace, timeout) == (120.0, 120.0)
    assert collector.outcome(now=61.0) is Outcome.OPEN


@pytest.mark.parametrize(
    "slowest, expected",
    [(2.0, (10.0, 120.0)), (20.0, (60.0, 120.0)), (50.0, (150.0, 150.0))],
    ids=["fast-rounds-keep-the-settings", "grace-grows", "both-grow"],
)
def test_grace_and_timeout_grow_to_patience_times_the_slowest_reply(slowest, expected):
    assert round_windows(quorum_grace=10.0, round_timeout=120.0, patience=3.0, slowest_reply=slowest) == expected


def test_patience_zero_keeps_the_configured_times():
    assert round_windows(10.0, 120.0, 0.0, None) == (10.0, 120.0)
    assert round_windows(10.0, 120.0, 0.0, 500.0) == (10.0, 120.0)


# -- late updates --------------------------------------------------------------------------


def test_an_update_one_round_late_counts_half():
    assert staleness_weight(30.0, 1) == 15.0 and staleness_weight(30.0, 2) == 10.0


def test_only_the_closed_rounds_request_from_a_device_it_stopped_waiting_for_is_late():
    # Prepare
    late = LateUpdates("discard")
    late.close(3, "req-3", {}, frozenset({"b", "c"}))

    # Execute / Assert
    assert late.expects("b", 3, "req-3")
    assert not late.expects("a", 3, "req-3")  # replied in time: a second reply is no late update
    assert not late.expects("b", 2, "req-3") and not late.expects("b", 3, "req-2")
    late.discard("b")
    assert not late.expects("b", 3, "req-3") and late.discarded == 1


def test_next_round_folds_kept_updates_at_half_weight_unless_the_device_replied_afresh():
    # Prepare
    sent = {"shared": {"w": np.zeros(2, np.float32)}}
    late = LateUpdates("next_round")
    late.close(1, "req-1", sent, frozenset({"b", "c"}))
    late.keep("b", {"shared": {"w": np.ones(2, np.float32)}}, {"num_examples": 40}, 40.0)
    late.keep("c", {"shared": {"w": np.ones(2, np.float32)}}, {"num_examples": 10}, 10.0)

    # Execute: round 2 closes; c sent round 2 a fresh update
    folded = late.take(frozenset({"a", "c"}), aggregating=True)

    # Assert
    assert late.sent is sent
    assert [(u.sender, u.weight) for u in folded] == [("b", 20.0)]
    assert late.discarded == 1 and late.pending == []


def test_late_updates_are_discarded_when_the_next_round_aggregates_nothing():
    # Prepare
    late = LateUpdates("next_round")
    late.close(1, "req-1", {}, frozenset({"b"}))
    late.keep("b", {}, {"num_examples": 40}, 40.0)

    # Execute
    folded = late.take(frozenset(), aggregating=False)

    # Assert
    assert folded == [] and late.discarded == 1


def test_discard_keeps_nothing_of_what_a_round_sent():
    late = LateUpdates("discard")
    late.close(1, "req-1", {"shared": {"w": np.zeros(2, np.float32)}}, frozenset({"b"}))
    assert late.sent == {} and not late.folds
