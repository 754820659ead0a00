"""The benchmarks' run flags come from the settings declarations (`edgepfl simulate`'s flags), with
the protocol's defaults, and build the same runs as before: a committed ledger record is found by
the run its default flags make."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import ablations, fair
from benchmarks.flags import PROTOCOL, add_run_flags
from benchmarks.runs import DEFAULT_LEDGER, run_folder_name

LEDGER = Path(__file__).resolve().parents[2] / DEFAULT_LEDGER


def test_a_run_flag_is_the_declared_setting_with_the_protocol_default() -> None:
    # Prepare
    parser = argparse.ArgumentParser()
    add_run_flags(parser, ("lr", "clients", "local_epochs"), {"clients": 20})

    # Execute
    defaults = parser.parse_args([])
    given = parser.parse_args(["--lr", "0.1", "--clients", "7"])

    # Assert: the declared default where the protocol has none, the protocol's otherwise; typed as declared
    assert (defaults.lr, defaults.clients, defaults.local_epochs, defaults.broker) == (0.05, 20, 2, None)
    assert (given.lr, given.clients) == (0.1, 7)
    assert parser.epilog is not None and "--clients 20" in parser.epilog
    with pytest.raises(ValueError, match="no declared setting"):
        add_run_flags(argparse.ArgumentParser(), ("not_a_setting",), {})


def test_the_ablation_protocol_defaults_build_the_runs_the_ledger_recorded() -> None:
    # Prepare
    args = ablations.parse_args(["--papers", "cd2_pfed", "--seeds", "0", "--ledger", "none"])
    full = next(r for r in ablations.ROWS if r.paper == "cd2_pfed" and r.id == ablations.FULL)

    # Execute
    config = ablations.run_config(args, full, 0)

    # Assert: the protocol, and the run identity (settings and fingerprint) of the committed record
    assert (config.run.dataset, config.run.clients, config.training.rounds, config.training.local_epochs,
            config.training.lr, config.aggregation.dtype) == ("fmnist", 20, 15, 1, 0.05, "float64")
    assert (LEDGER / f"{run_folder_name(config)}.json").is_file()


def test_fair_takes_the_common_optimizer_flags_and_refuses_a_bad_value_by_its_key() -> None:
    # Execute
    args = fair.parse_args(["--sgd-momentum", "0.5", "--ledger", "none"])

    # Assert
    assert (args.sgd_momentum, args.rounds, args.local_epochs, args.eval_every) == (0.5, 50, 2, 10)
    assert args.clients == PROTOCOL["clients"]
    with pytest.raises(SystemExit, match="aggregation_dtype"):  # before any run is made
        fair.parse_args(["--aggregation-dtype", "float16", "--ledger", "none"])
