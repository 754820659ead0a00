"""The committed run ledger (benchmarks/results/ledger): each record is found under the name its
recorded settings have today, and what its run resolved agrees with what those settings resolve to
now, so that a table reads a record as the run it was."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.ledger import DEFAULT_LEDGER
from benchmarks.runs import bench_config, run_folder_name
from coordinator.algorithms import hyperparameters

RECORDS = sorted(Path(__file__).resolve().parents[2].joinpath(DEFAULT_LEDGER).glob("*.json"))


@pytest.fixture(scope="module", params=RECORDS, ids=[path.stem for path in RECORDS])
def record(request) -> dict:
    return json.loads(request.param.read_text())


def test_the_ledger_is_not_empty() -> None:
    assert RECORDS


def test_a_record_is_named_by_todays_fingerprint_of_its_settings(record) -> None:
    assert run_folder_name(bench_config(**record["config"])) == record["run"]


def test_a_record_resolves_to_the_hyperparameters_its_run_used(record) -> None:
    # Prepare: what the run resolved (its report) and what its recorded settings resolve to today
    used = record["report"]["hyperparameters"]
    today = dataclasses.asdict(hyperparameters(record["config"]["algorithm"], record["config"]["hyper"]))

    # Assert: every value the run reports is today's reading of its settings; a FediOS run whose L_re
    # acted (lam > 0, a personal extractor) names its form, which the default no longer is for it
    assert {key: today.get(key) for key in used} == used
    if record["config"]["algorithm"] == "fedios" and used["lam"] > 0 and used["personal_extractor"]:
        assert used.get("l_re") == today["l_re"]
