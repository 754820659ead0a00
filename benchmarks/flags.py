"""The benchmarks' command-line flags, each declared once.

A setting of the runs (`--lr`, `--clients`, `--eval-every`, `--broker`, ...) is the flag
`edgepfl simulate` takes for it: built by `coordinator.config.flags.add_setting_flags` from the settings
declarations (its name, type and help), so a benchmark cannot drift from the library. Only its
default may differ: the benchmark protocol's (`PROTOCOL`, and a script's own rounds), stated in
`--help`. The flags no setting declares (`--quick`, `--out`, `--cache`, `--ledger`, `--cached-only`,
`--jobs`, `--seeds`) are declared here, once for every script that takes them.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator.config.flags import add_setting_flags, given
from coordinator.config.run_config import SECTIONS
from edge_sdk.settings import settings_of

from .runs import DEFAULT_CACHE, DEFAULT_LEDGER, bench_config, ledger_folder

DEFAULT_OUT = "benchmarks/results"
"""Where a benchmark writes its tables unless `--out` says otherwise."""

PROTOCOL: dict[str, Any] = {"dataset": "fmnist", "clients": 20, "local_epochs": 1, "workers": 2,
                            "aggregation_dtype": "float64"}
"""The accuracy protocol where it differs from the settings' defaults (batch 32, lr 0.05 and an
evaluation every round are theirs): Fashion-MNIST, 20 devices, 1 local epoch, two device worker
processes, updates summed in float64 (a rerun repeats bit for bit)."""

RUN_SETTINGS = ("dataset", "data_dir", "clients", "rounds", "local_epochs", "batch_size", "lr", "workers",
                "aggregation_dtype")
"""The settings every learning benchmark takes as flags, besides `broker`."""

BROKER = "broker"
"""Where the runs connect (default: an embedded amqtt broker per run): the run cache's, not a run's
setting (it is left out of a run's identity)."""


def _declared_defaults() -> dict[str, Any]:
    return {item.key: item.field.default for cls in SECTIONS.values() for item in settings_of(cls)}


def add_run_flags(parser: argparse.ArgumentParser, keys: Sequence[str], defaults: Mapping[str, Any], *,
                  broker: bool = True) -> None:
    """A flag for each setting in `keys` (and `--broker` unless `broker` is False: a script that
    starts brokers of its own declares its own), as `edgepfl simulate` declares it,
    defaulting to `defaults[key]` where given (None: the script decides, e.g. by `--quick`), else to
    the setting's own default. The defaults that differ from the settings' are listed at the end
    of `--help`."""
    declared = _declared_defaults()
    wanted = {*keys, BROKER} if broker else set(keys)
    unknown = sorted(wanted - set(declared))
    if unknown:
        raise ValueError(f"no declared setting {', '.join(unknown)}")
    add_setting_flags(parser, "simulate", leave_out=[key for key in declared if key not in wanted])
    parser.set_defaults(**{key: defaults.get(key, declared[key]) for key in wanted})
    changed = {key: value for key, value in defaults.items()
               if key in wanted and value is not None and value != declared[key]}
    if changed:
        parser.epilog = ("This benchmark's defaults, in place of the settings' own: "
                         + ", ".join(f"--{key.replace('_', '-')} {value}" for key, value in changed.items()) + ".")


def run_settings(args: argparse.Namespace, keys: Sequence[str]) -> dict[str, Any]:
    """The settings of `keys` as parsed (None left out: the setting's default), for `bench_config`;
    exits naming the key of a value the run configuration refuses, before anything trains."""
    settings = given(args, keys)
    try:
        bench_config(**settings)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return settings


def add_output_flags(parser: argparse.ArgumentParser, quick: str, *, name: str | None = None) -> None:
    """`--quick` (what the smoke run is: `quick`), `--out` and, with `name` (the default file stem
    as the help says it), `--name`."""
    parser.add_argument("--quick", action="store_true", help=f"{quick} (a smoke test)")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"folder of the tables (default {DEFAULT_OUT})")
    if name is not None:
        parser.add_argument("--name", help=f"output file stem (default {name})")


def add_cache_flags(parser: argparse.ArgumentParser, missing: str, *, fresh: bool = False, jobs: bool = False) -> None:
    """`--cache`, `--ledger`, `--cached-only` (`missing`: what the tables show for a run not there),
    and `--fresh` and `--jobs` where a script takes them."""
    parser.add_argument("--cache", help=f"folder of cached runs (default {DEFAULT_CACHE}; with --quick: OUT/runs)")
    parser.add_argument("--ledger", help=f"folder of the finished runs' records, committed (default {DEFAULT_LEDGER}; "
                        "none with --quick; 'none': none)")
    if fresh:
        parser.add_argument("--fresh", action="store_true", help="recompute the runs this invocation needs")
    parser.add_argument("--cached-only", action="store_true",
                        help=f"train nothing: tables from the runs finished in the cache or the ledger, {missing}")
    if jobs:
        parser.add_argument("--jobs", type=int, default=1, help="runs trained side by side, a process each")


def add_seeds_flag(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--seeds", default=default, help=f"comma-separated run seeds (default {default})")


def finish_cache_flags(args: argparse.Namespace) -> None:
    """The cache and ledger folders an invocation uses: `--cache`, else OUT/runs for a quick run (a
    smoke run must not write into the repository) or the shared cache; the ledger likewise."""
    args.cache = args.cache or (str(Path(args.out) / "runs") if args.quick else DEFAULT_CACHE)
    args.ledger = ledger_folder(args.ledger, args.quick)
