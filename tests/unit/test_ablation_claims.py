"""benchmarks/ablations.py's claim table: an ordering is measured on the seeds both rows ran, and says so;
every row is a valid switch of its algorithm."""

from __future__ import annotations

from typing import cast

import pytest

from benchmarks.claims import TIE, compare
from benchmarks.ablations import CLAIMS, PAPERS, ROWS, Claim, claim_rows
from coordinator.algorithms import hyperparameters
from edge_sdk.algorithms.hyper.cd2_pfed import Hyper as CD2PFedHyper
from edge_sdk.algorithms.hyper.fedios import Hyper as FediOSHyper

CLAIM = Claim("dc_pfl", "DC-PFL > w/o AL", "full", "no_al", "Table 1")


def row(id_: str, seeds: dict[int, float], missing: str = "") -> dict:
    return {"paper": "dc_pfl", "id": id_, "seeds": seeds, "missing": missing}


@pytest.mark.parametrize("full, ablated, measured, reproduced", [
    ({0: 0.90}, {0: 0.85}, "90.00 vs 85.00: +5.00 (seed 0)", "yes (1 seed)"),
    ({0: 0.80}, {0: 0.85}, "80.00 vs 85.00: -5.00 (seed 0)", "no (1 seed)"),
    ({0: 0.90, 1: 0.80, 2: 0.70}, {0: 0.85, 1: 0.82}, "85.00 vs 83.50: +1.50 ± 3.50 (seeds 0, 1)", "tie"),
    ({0: 0.90, 1: 0.91}, {0: 0.80, 1: 0.82}, "90.50 vs 81.00: +9.50 ± 0.50 (seeds 0, 1)", "yes"),
])
def test_a_claim_compares_the_rows_on_their_common_seeds(full, ablated, measured, reproduced) -> None:
    # Execute
    [entry] = claim_rows([row("full", full), row("no_al", ablated)], [CLAIM])

    # Assert
    assert entry["measured"] == measured
    assert entry["reproduced"] == reproduced


@pytest.mark.parametrize("better, worse, verdict", [
    ({0: 0.7662, 1: 0.7630}, {0: 0.7502, 1: 0.7658}, TIE),  # +0.66 ± 0.94 points: ahead on the mean only
    ({0: 0.7450, 1: 0.7486}, {0: 0.7570, 1: 0.7366}, TIE),  # -0.00 ± 1.20: behind by a hair
    ({0: 0.80, 1: 0.84}, {0: 0.78, 1: 0.81}, "yes"),  # +2.50 ± 0.50: the order holds on every seed
    ({0: 0.78, 1: 0.81}, {0: 0.80, 1: 0.84}, "no"),  # -2.50 ± 0.50: the reverse holds
])
def test_a_difference_no_larger_than_its_seed_spread_is_a_tie_whatever_its_sign(better, worse, verdict) -> None:
    # Execute
    result = compare(better, worse)

    # Assert: a mean difference within its std over seeds orders nothing, a larger one keeps its sign
    assert result is not None
    assert result["reproduced"] == verdict


def test_a_claim_without_runs_is_not_measured_and_names_a_missing_switch() -> None:
    # Execute
    [no_seed] = claim_rows([row("full", {0: 0.9}), row("no_al", {1: 0.8})], [CLAIM])
    [no_switch] = claim_rows([row("full", {0: 0.9}), row("no_al", {}, missing="no switch")], [CLAIM])
    none = claim_rows([row("other", {0: 0.9})], [CLAIM])

    # Assert
    assert (no_seed["measured"], no_seed["reproduced"]) == ("not measured", "not measured")
    assert no_switch["measured"] == "not measured (no switch)"
    assert none == []  # a paper not asked for has no lines


def test_every_claim_names_rows_of_its_paper_and_every_paper_has_its_full_method_and_references() -> None:
    # Prepare
    ids = {(r.paper, r.id) for r in ROWS}

    # Assert
    for claim in CLAIMS:
        assert (claim.paper, claim.better) in ids and (claim.paper, claim.worse) in ids, claim.text
    for paper in PAPERS:
        assert {(paper, "full"), (paper, "fedavg"), (paper, "fedavg_ft")} <= ids


def test_every_row_is_runnable_and_each_ablation_differs_from_its_full_method() -> None:
    # Prepare
    full = {r.paper: r for r in ROWS if r.id == "full"}

    # Execute / Assert: no row waits for a switch, every override is a valid value of its algorithm,
    # and a row of the full method's algorithm changes its hyperparameters or its local epochs
    for row in ROWS:
        assert not row.missing, (row.paper, row.id)
        hyper = hyperparameters(row.algorithm, row.overrides)
        if row.algorithm == full[row.paper].algorithm and row.id != "full":
            assert hyper != hyperparameters(row.algorithm, {}) or row.local_epochs, (row.paper, row.id)
    no_li = cast(CD2PFedHyper, hyperparameters("cd2_pfed", next(r for r in ROWS if r.id == "no_li").overrides))
    assert no_li.ramp is False


def test_fedios_rows_say_which_l_re_they_compute() -> None:
    # Prepare
    rows = {r.id: r for r in ROWS if r.paper == "fedios"}
    resolved = {row_id: cast(FediOSHyper, hyperparameters("fedios", row.overrides)) for row_id, row in rows.items()
                if row.algorithm == "fedios"}

    # Assert: "with L_re" and the alpha sweep take L_re on the extractors at the paper's lam; "w/o L_re"
    # computes the default's objective (L_re identically 0 as printed, or lam 0), and its label says so
    for row_id in ("full", "alpha0.1", "alpha0.3", "alpha0.7", "alpha0.9"):
        assert (resolved[row_id].l_re, resolved[row_id].lam) == ("extractors", 0.1), row_id
        assert "extractors" in rows[row_id].label, row_id
    assert resolved["no_lre"].lam == 0 and "default" in rows["no_lre"].label
