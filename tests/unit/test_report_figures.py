"""Unit tests of the report's figures: participation lines, the MB curve's total, the summary."""

from __future__ import annotations

from coordinator.run.report_files import cumulative_megabytes, participation_line
from coordinator.run.report_files import summary


def _round(round_: int, selected: int, participants: int, outcome: str = "quorum", **counts) -> dict:
    return {"round": round_, "selected": selected, "participants": participants, "outcome": outcome,
            "replied": participants, "refused": 0, "late": 0, "missing": 0, "late_folded": 0,
            "personalized_accuracy": None, "bytes_up": 1_000_000, "bytes_down": 500_000, **counts}


def _report(rounds: list[dict], **final) -> dict:
    return {
        "algorithm": "fedper", "dataset": "fmnist", "partition": "dirichlet", "clients": 20, "model": "cnn28",
        "rounds_completed": len(rounds), "rounds_aggregated": sum(r["outcome"] != "aborted" for r in rounds),
        "rounds": rounds, "late_updates": {"policy": "discard", "folded": 0, "discarded": 3},
        "final": {"personalized_accuracy": {"mean": 0.967, "std": 0.01, "min": 0.9, "best_round_mean": 0.938},
                  "per_client": {}, "global_accuracy": None, **final},
        "communication": {"bytes_up": 4_000_000, "bytes_down": 3_000_000, "bytes_down_delivered": 12_000_000},
        "wall_seconds": 12.0, "rejections": {},
    }


def test_a_round_that_aggregated_everyone_has_no_participation_line():
    assert participation_line(_round(1, 4, 4, "complete")) is None


def test_a_round_short_of_its_selection_says_who_was_late():
    line = participation_line(_round(3, 4, 1, late=3))
    assert line == "round 3: 1 of 4 selected devices aggregated, 3 late"


def test_a_round_below_its_quorum_says_it_aggregated_nothing():
    line = participation_line(_round(2, 4, 0, "aborted", replied=1, late=1, refused=2))
    assert line == "round 2: nothing aggregated (1 replied, below the quorum), 1 late, 2 refused"


def test_the_mb_curve_ends_with_the_runs_total_release_included():
    # Prepare: two rounds of 1.5 MB; the run's total also holds 1 MB of registration and release
    report = _report([_round(1, 4, 4, "complete"), _round(2, 4, 4, "complete")])
    report["communication"] = {"bytes_up": 2_500_000, "bytes_down": 1_500_000}

    # Execute / Assert
    assert cumulative_megabytes(report) == [1.5, 3.0, 4.0]


def test_the_summary_reports_participation_evaluation_and_both_download_figures():
    # Prepare
    report = _report([_round(1, 4, 4, "complete"), _round(2, 4, 0, "aborted", replied=0, late=4),
                      _round(3, 4, 1, late=3)], devices_evaluated=16, devices_registered=20)

    # Execute
    text = summary(report, "runs/x")

    # Assert
    assert "3 played, 2 aggregated, 1 aggregated nothing" in text
    assert "round 3: 1 of 4 selected devices aggregated, 3 late" in text
    assert "round 2: nothing aggregated" in text and "round 1:" not in text
    assert "final evaluation       over 16 of 20 devices" in text
    assert "3.00 MB down published (12.00 MB delivered)" in text
    assert "best round mean        0.9380 (trainers" in text
    assert "discard: 0 folded into the next round, 3 discarded" in text


def test_the_summary_says_when_the_run_was_scored_on_the_validation_split():
    # Prepare
    report = _report([_round(1, 4, 4, "complete")], devices_evaluated=20, devices_registered=20)

    # Execute
    on_test, on_validation = summary(report, "runs/x"), summary({**report, "evaluated_on": "validation"}, "runs/x")

    # Assert
    assert "validation" not in on_test
    assert "over 20 of 20 devices, on their validation split (test split unread)" in on_validation


def test_the_summary_of_a_secure_run_gives_what_its_weakest_round_withstands():
    # Prepare: two secure rounds of 50 devices, one of 4
    from coordinator.run.report_files import secagg_report
    from edge_sdk.privacy.secagg_settings import SecAggSettings

    secure = {"selected": 50, "unmasked": 50, "dropped": [], "failed": None}
    rounds = [_round(1, 50, 50, "complete", secagg=secure),
              _round(2, 4, 4, "complete", secagg={**secure, "selected": 4}),
              _round(3, 50, 50, "complete", secagg=secure)]
    report = {**_report(rounds), "secagg": secagg_report(SecAggSettings(), rounds, sharded=False)}

    # Execute
    text = summary(report, "runs/x")

    # Assert: the 4-device round (the complete graph, k 3, t 2) is the weakest
    assert "secure aggregation     3 of 3 rounds unmasked" in text
    assert ("secure aggregation     n 4, k 3, t 2: each update hidden from a malicious coordinator with up to 0 "
            "colluding devices (1 if it follows the protocol); the sum unmasks with up to 1 lost or silent "
            "(1 lost at random)") in text
