"""The conformance kit's pure checks of replies, and its report's verdict and lines."""

from __future__ import annotations

import numpy as np

from coordinator.conformance.checks import (accuracy_problem, cached_reply_problem, int8_problems, reply_problems,
                                            reply_to)
from coordinator.conformance.outcome import SECTIONS, Report, Verdict
from edge_sdk.codecs import encode
from edge_sdk.protocol import ArrayGroup, Envelope, Kind

RUN = "9f1c2b3a4d5e6f70"


def _train() -> Envelope:
    return Envelope(Kind.TRAIN, "coordinator", run_id=RUN, round=3, msg_id="t1", config={"selected": ["dev0"]})


def _reply(**changes) -> Envelope:
    fields = {"run_id": RUN, "round": 3, "msg_id": "r1", "config": {"in_reply_to": "t1"},
              "groups": {"shared": {"w": np.array([1.0, 2.0], np.float32)}}, "metrics": {"num_examples": 5}}
    return Envelope(Kind.TRAIN_RES, "dev0", **{**fields, **changes})


def test_a_reply_that_names_its_request_of_the_run_and_round_has_no_problem():
    assert reply_problems(_reply(), _train(), RUN) == []


def test_each_missing_or_wrong_reply_field_is_named():
    # Execute
    missing = reply_problems(_reply(config={}), _train(), RUN)
    wrong = reply_problems(_reply(config={"in_reply_to": "t0"}, run_id="other", round=4), _train(), RUN)

    # Assert
    assert len(missing) == 1 and "in_reply_to is missing" in missing[0]
    assert len(wrong) == 3
    assert "'t0', not the TRAIN's msg_id t1" in wrong[0]
    assert "wrong_run" in wrong[1] and "round is 4, not the request's 3" in wrong[2]


def test_reply_to_matches_the_reply_naming_the_request_or_naming_none():
    match = reply_to(_train(), Kind.TRAIN_RES)
    assert match(_reply()) and match(_reply(config={}))
    assert not match(_reply(config={"in_reply_to": "t0"}))
    assert not match(Envelope(Kind.EVAL_RES, "dev0", config={"in_reply_to": "t1"}))


def test_accuracy_must_be_a_number_in_the_unit_interval():
    assert accuracy_problem(_reply(metrics={"accuracy": 0.5})) is None
    assert accuracy_problem(_reply(metrics={"accuracy": 1})) is None
    assert "1.5" in (accuracy_problem(_reply(metrics={"accuracy": 1.5})) or "")
    assert "None" in (accuracy_problem(_reply(metrics={})) or "")
    assert "nan" in (accuracy_problem(_reply(metrics={"accuracy": float("nan")})) or "")


def test_a_repeat_must_be_the_cached_reply():
    # Prepare
    first = _reply()

    # Execute / Assert
    assert cached_reply_problem(_reply(), first) is None
    assert "new reply" in (cached_reply_problem(_reply(msg_id="r2"), first) or "")
    assert "other arrays" in (cached_reply_problem(_reply(groups={"shared": {"w": np.array([1.0, 3.0], np.float32)}}),
                                                   first) or "")
    assert "other metrics" in (cached_reply_problem(_reply(metrics={"num_examples": 6}), first) or "")


def test_int8_arrays_need_a_scale_and_a_largest_code_of_127():
    # Prepare: what the project's encoder makes is right
    sent = {"shared": {"w": np.array([0.0, 0.0, 0.0], np.float32)}}
    good = encode("int8", {"shared": {"w": np.array([0.5, -1.0, 0.25], np.float32)}}, sent)
    no_scale = {"shared": {"w": good["shared"]["w"]}}
    small: dict[str, ArrayGroup] = {"shared": {"w": np.array([10, -20, 5], np.int8),
                                               "w#scale": np.array(0.01, np.float32)}}

    # Execute / Assert
    assert int8_problems(good) == []
    assert good["shared"]["w"].tolist() == [64, -127, 32]  # 0.5 / (1 / 127) = 63.5 rounds to even: 64
    assert "no float32 scalar w#scale" in int8_problems(no_scale)[0]
    assert "largest |q| is 20" in int8_problems(small)[0]


def test_the_report_passes_only_with_registration_and_no_failure():
    # Prepare
    report = Report()
    report.record("registration", Verdict.PASS, "ok")
    report.record("release", Verdict.SKIP, "trainers fetch no release")

    # Execute
    passed = report.passed
    report.record("training", Verdict.FAIL, "in_reply_to is missing")

    # Assert
    assert passed and not report.passed
    lines = report.lines()
    assert len(lines) == len(SECTIONS)
    assert lines[3].split()[:3] == ["FAIL", "training", "§7"] and lines[3].endswith("in_reply_to is missing")
    assert lines[-1].startswith("SKIP") and lines[-1].endswith("not reached")
    assert not Report().passed
