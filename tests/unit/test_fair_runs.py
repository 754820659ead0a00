"""benchmarks/fair.py's choice of runs: the lr search on the search seeds (default: the first of
--seeds), the test-split runs on every seed (tuned once, reported over several); a method may be
an algorithm with hyperparameters (`repper:variant=in`), checked before anything trains."""

from __future__ import annotations

from typing import cast

import pytest

from benchmarks import fair as fair_module


@pytest.fixture(scope="module")
def fair():
    return fair_module


def requested(fair, tmp_path, *flags: str) -> tuple[set[str], set[str]]:
    """(validation runs, test runs) that fair.py asks its cache for, on an empty cache that trains nothing."""
    args = fair.parse_args(["--methods", "fedavg", "--settings", "dir0.1@0.2", "--cached-only",
                            "--cache", str(tmp_path), "--ledger", "none", *flags])
    cache = fair.RunCache(args.cache, cached_only=True)
    fair.run_setting(args, cache, args.settings[0])
    names = set(cache.missing)
    validation = {cache.folder(fair.run_config(args, "fedavg", args.settings[0], seed, lr=lr, common=True,
                                               validation=True)).name
                  for seed in range(3) for lr in args.grid}
    return names & validation, names - validation


def name_of(fair, tmp_path, seed: int, **kind) -> str:
    args = fair.parse_args(["--cache", str(tmp_path), "--ledger", "none"])
    return fair.RunCache(tmp_path).folder(fair.run_config(args, "fedavg", fair.Setting.parse("dir0.1@0.2"), seed,
                                                          **kind)).name


def test_the_lr_is_searched_on_the_first_seed_and_the_paper_runs_cover_every_seed(fair, tmp_path):
    validation, test = requested(fair, tmp_path, "--seeds", "0,1,2")

    assert validation == {name_of(fair, tmp_path, 0, lr=lr, common=True, validation=True) for lr in (0.01, 0.03, 0.1)}
    assert test == {name_of(fair, tmp_path, seed, lr=0.05, common=False, validation=False) for seed in (0, 1, 2)}


def test_search_seeds_widen_the_search(fair, tmp_path):
    validation, _ = requested(fair, tmp_path, "--seeds", "0,1,2", "--search-seeds", "0,1")

    assert validation == {name_of(fair, tmp_path, seed, lr=lr, common=True, validation=True)
                          for seed in (0, 1) for lr in (0.01, 0.03, 0.1)}


@pytest.mark.parametrize("flags", [["--search-seeds", "x"], ["--seeds", ","]])
def test_bad_seeds_are_refused_naming_the_flag(fair, flags):
    with pytest.raises(SystemExit, match="--seeds"):
        fair.parse_args(flags)


def test_a_method_with_hyperparameters_is_run_and_named_as_that_variant(fair, tmp_path):
    args = fair.parse_args(["--methods", "repper,repper:variant=in", "--cache", str(tmp_path), "--ledger", "none"])
    setting = fair.Setting.parse("dir0.1@0.2")

    default, variant = (fair.run_config(args, method, setting, 0, lr=0.05, common=False, validation=False)
                        for method in args.methods)

    assert (variant.run.algorithm, variant.hyper) == ("repper", {"variant": "in"})
    assert (default.run.algorithm, default.hyper) == ("repper", {}) and default.fingerprint() != variant.fingerprint()
    assert fair.method_name("repper:variant=in") == "RepPer (variant=in)"


@pytest.mark.parametrize("method, reason", [
    ("repper:variant", "KEY=VALUE"),
    ("nope", "unknown algorithm 'nope'"),
    ("repper:variant=zz", "variant must be one of"),
    ("repper:bogus=1", "unknown key 'bogus'"),
])
def test_a_bad_method_is_refused_naming_it(fair, method, reason):
    with pytest.raises(SystemExit, match=reason) as refused:
        fair.parse_args(["--methods", f"fedavg,{method}"])
    assert f"--methods: {method}:" in str(refused.value)


def test_the_lr_is_chosen_only_from_a_whole_search_ties_to_the_smaller(fair):
    def search(*means):
        return [{"lr": lr, "accuracy": {"mean": mean}} for lr, mean in zip((0.01, 0.03, 0.1), means, strict=True)]

    assert fair.choose_lr(search(0.80, 0.85, 0.85)) == 0.03
    assert fair.choose_lr(search(0.90, 0.85, 0.70)) == 0.01
    assert fair.choose_lr(search(0.96, None, None)) is None
    assert fair.choose_lr([]) is None


def test_progress_counts_the_runs_each_kind_has_of_those_planned(fair, tmp_path):
    args = fair.parse_args(["--methods", "fedavg,fedrep", "--settings", "dir0.1@0.2", "--seeds", "0,1,2",
                            "--search-seeds", "0,1", "--cached-only", "--cache", str(tmp_path), "--ledger", "none"])
    config = {"grid": args.grid, "seeds": args.seeds, "search_seeds": args.search_seeds, "methods": args.methods}
    empty = fair.run_setting(args, fair.RunCache(args.cache, cached_only=True), args.settings[0])
    searched = [{"lr": lr, "seeds": {0: 0.5, 1: 0.6}} for lr in args.grid]
    partial = {**empty, "fedrep": {"search": searched, "chosen_lr": 0.01,
                                   "common": {"seeds": {0: 0.7}}, "paper": {"seeds": {0: 0.4, 2: 0.5}}}}

    assert fair.progress(config, {"dir0.1@0.2": empty}) == {
        "search": {"done": 0, "planned": 12}, "common": {"done": 0, "planned": 6}, "paper": {"done": 0, "planned": 6}}
    assert fair.progress(config, {"dir0.1@0.2": partial}) == {
        "search": {"done": 6, "planned": 12}, "common": {"done": 1, "planned": 6}, "paper": {"done": 2, "planned": 6}}
    assert fair.progress_line(fair.progress(config, {"dir0.1@0.2": partial})).startswith("**Runs done: 9 of 24**")


def test_a_claim_is_measured_per_setting_and_optimizer_on_the_seeds_both_methods_ran(fair):
    claims = [fair.Claim("DC-PFL > FedAvg", "dc_pfl", "fedavg", "Table 1")]
    ran = {"dc_pfl": {"common": {"seeds": {0: 0.85, 1: 0.80}}, "paper": {"seeds": {0: 0.82}}},
           "fedavg": {"common": {"seeds": {0: 0.83}}, "paper": {"seeds": {1: 0.81}}}}
    not_searched: dict[str, dict[str, dict | None]] = {"dc_pfl": {"common": None, "paper": {"seeds": {}}},
                                                       "fedavg": {"common": None, "paper": {"seeds": {}}}}

    rows = fair.claim_rows(["dc_pfl", "fedavg"], {"domains@0.2": ran, "dir0.1@0.2": not_searched}, claims)

    domains, dirichlet = rows
    assert domains["setting"] == "domains@0.2" and domains["claim"] == "DC-PFL > FedAvg"
    assert domains["common"]["measured"] == "85.00 vs 83.00: +2.00 (seed 0)"
    assert domains["common"]["reproduced"] == "yes (1 seed)"
    assert domains["paper"]["reproduced"] == "not measured"  # no seed in common
    assert dirichlet["common"] == dirichlet["paper"] == {"measured": "not measured", "reproduced": "not measured"}
    assert fair.claim_rows(["dc_pfl"], {"domains@0.2": ran}, claims) == []  # FedAvg not asked for


def test_every_claim_names_methods_the_protocol_runs_by_default(fair):
    for claim in fair.CLAIMS:
        assert {claim.better, claim.worse} <= set(fair.METHODS), claim
        assert claim.better != claim.worse


def test_fedios_runs_in_both_forms_of_l_re_each_named_for_what_it_computes(fair, tmp_path):
    from coordinator.algorithms import hyperparameters
    from edge_sdk.algorithms.hyper.fedios import Hyper as FediOSHyper

    args = fair.parse_args(["--cache", str(tmp_path), "--ledger", "none"])
    setting = fair.Setting.parse("domains@0.2")

    printed, extractors = (fair.run_config(args, method, setting, 0, lr=0.05, common=False, validation=False)
                           for method in ("fedios", "fedios:l_re=extractors"))

    assert {"fedios", "fedios:l_re=extractors"} <= set(args.methods)
    # the default: Eq. 11 as printed
    assert cast(FediOSHyper, hyperparameters("fedios", printed.hyper)).l_re == "projected"
    assert cast(FediOSHyper, hyperparameters("fedios", extractors.hyper)).l_re == "extractors"
    assert printed.fingerprint() != extractors.fingerprint()
    assert "default" in fair.method_name("fedios") and "extractors" not in fair.method_name("fedios")
    assert "extractors" in fair.method_name("fedios:l_re=extractors")
