"""The fair protocol: every method under one common optimizer, its lr chosen on held-out
training data, beside every method under its own paper's optimizer; two tables, never mixed.

For each setting and method:
1. lr search, common optimizer: one run per lr of `--grid` with `optimizer = "sgd"` (momentum
   `--sgd-momentum`, weight decay `--sgd-weight-decay`) and `validation_fraction`
   (`--validation-fraction` of each device's training data held out, trained on the rest, scored
   on it: the test split is never read), for each seed of `--search-seeds` (default: the first of
   `--seeds`: an lr is searched once, then every seed runs with it). The lr with the best
   validation accuracy (final-round mean over devices, mean over the search seeds) wins; ties go
   to the smaller lr. No lr is chosen (and no common-optimizer run made) until every lr has a result.
2. The common-optimizer table: the chosen lr, `optimizer = "sgd"`, the full training data, scored
   on the test split.
3. The paper table: `optimizer = "paper"` (each method's own local optimizer, as docs/ALGORITHMS.md's
   table states it) at the run lr `--lr`, full training data, test split.
4. The claim table: each ordering of two of the protocol's methods that a paper states (`CLAIMS`:
   "DualFed > FedRep"), and whether each seed method beats FedAvg+FT, in each setting and under
   each optimizer, on the seeds both methods ran (benchmarks/claims.py, as ablations.py's).

The protocol's defaults: Fashion-MNIST, 20 devices, C = 0.2, 50 rounds x 2 local epochs, settings
Dir(0.1) and `domains`, the five seed methods with FedAvg, FedAvg+FT and FedRep. A method may
carry hyperparameters (`repper:variant=in`, several joined by `+`), so that a variant, such as
RepPer's L_in against its default L_out, gets the same protocol. FediOS runs
in both forms of its L_re: `fedios`, the default (Eq. 11-12 as printed, identically 0), and
`fedios:l_re=extractors`, the reconstruction on the extractors' outputs at lam 0.1. Devices are
evaluated every `--eval-every` rounds (default 10) and after the last: the tables read the last
round, and an evaluation of all 20 devices costs several rounds' training (FedAvg+FT fine-tunes
each). Runs are cached by their settings' fingerprint (benchmarks/runs.py), in the cache
accuracy.py and ablations.py use; each records the machine that trained it, and the tables name
the machines. Every finished run is also recorded in the committed run ledger (`--ledger`,
benchmarks/ledger.py), from which the tables are rebuilt where the cache is absent: the protocol
adds up over sessions and machines. `--jobs N` trains N runs side by side (a machine with many
cores or a GPU); a method's common-optimizer test runs start as soon as its lr search has ended.

    python -m benchmarks.fair --seeds 0 --cache /work/runs/cache
    python -m benchmarks.fair --seeds 0 --jobs 12 --settings domains@0.2   # on a big machine
    python -m benchmarks.fair --cached-only --cache /work/runs/cache   # tables from what is cached

Quick smoke run (digits, 6 devices, 2 rounds x 1 epoch, FedAvg and FedRep, lrs 0.01 and 0.1, dir0.5@1):

    python -m benchmarks.fair --quick --out /tmp/fair

Writes fair-<dataset>-<rounds>rounds.{json,md} (or `--name`) to --out.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from .claims import NOT_MEASURED, VERDICTS, compare
from .flags import (
    PROTOCOL,
    RUN_SETTINGS,
    add_cache_flags,
    add_output_flags,
    add_run_flags,
    add_seeds_flag,
    finish_cache_flags,
    run_settings,
)
from ._machine import machine_info
from .runs import (
    NAMES,
    RunCache,
    RunPool,
    Setting,
    bench_config,
    listed,
    mean_std,
    pct,
    setup_logging,
    trailer,
    write_outputs,
)

log = logging.getLogger("benchmarks")

RUN_FLAGS = (*RUN_SETTINGS, "eval_every")
"""The run settings every run of the protocol takes from the flags (`edgepfl simulate`'s); the lr, the
optimizer and the validation split are each run's own."""
METHODS = ("repper", "dualfed", "dc_pfl", "cd2_pfed", "fedios:l_re=extractors", "fedios", "fedavg", "fedavg_ft",
           "fedrep", "repper:variant=in")
LABELS = {
    "fedios": "FediOS (printed L_re, identically 0; the default)",
    "fedios:l_re=extractors": "FediOS (L_re on extractors, lam 0.1)",
}
"""How the tables name a method whose settings need words: FediOS's two forms of L_re (docs/ALGORITHMS.md)."""
SETTINGS = ("dir0.1@0.2", "domains@0.2")
PAPER_OPTIMIZERS = {
    "repper": "Adam, lr 1e-3, weight decay 1e-4 (stage 1); head: SGD, run lr, momentum 0.9",
    "dualfed": "SGD, lr 0.01, momentum 0.5",
    "dc_pfl": "SGD, run lr, momentum 0.9",
    "cd2_pfed": "SGD, run lr, Nesterov momentum 0.9, weight decay 5e-4",
    "fedios": "SGD, run lr, momentum 0.9",
    "fedavg": "SGD, run lr, momentum 0.9",
    "fedavg_ft": "SGD, run lr, momentum 0.9",
    "fedrep": "SGD, run lr, momentum 0.5",
    "fedper": "SGD, run lr, momentum 0.9",
    "fedprox": "SGD, run lr, momentum 0.9",
    "lg_fedavg": "SGD, run lr, momentum 0.9",
    "local": "SGD, run lr, momentum 0.9",
}
"""Each method's own local optimizer at its defaults (`optimizer = "paper"`; tests/unit/test_common_optimizer.py)."""


@dataclass(frozen=True)
class Claim:
    """A stated ordering of two methods of the protocol: `better` beats `worse` (ids as `--methods` names them)."""

    text: str
    better: str
    worse: str
    source: str


UNCLAIMED = "not claimed; the strongest baseline here"
CLAIMS: list[Claim] = [
    Claim("RepPer > FedAvg", "repper", "fedavg", "RepPer, Table 2"),
    Claim("RepPer > FedAvg+FT", "repper", "fedavg_ft", "RepPer, Table 2"),
    Claim("RepPer > FedRep", "repper", "fedrep", "RepPer, Table 2"),
    Claim("RepPer: L_out > L_in", "repper", "repper:variant=in",
          "none (Eq. 5 is L_in); the default's reason"),
    Claim("DualFed > FedAvg", "dualfed", "fedavg", "DualFed, Tables 1-3"),
    Claim("DualFed > FedRep", "dualfed", "fedrep", "DualFed, Tables 1-3"),
    Claim("DualFed > FedAvg+FT", "dualfed", "fedavg_ft", UNCLAIMED),
    Claim("DC-PFL > FedAvg", "dc_pfl", "fedavg", "DC-PFL, Table 1"),
    Claim("DC-PFL > FedAvg+FT", "dc_pfl", "fedavg_ft", UNCLAIMED),
    Claim("CD2-pFed > FedAvg", "cd2_pfed", "fedavg", "CD2-pFed, Tables 1-3"),
    Claim("CD2-pFed > FedAvg+FT", "cd2_pfed", "fedavg_ft", UNCLAIMED),
    Claim("FediOS, L_re on extractors > FedAvg", "fedios:l_re=extractors", "fedavg", "FediOS, Tables 1, 3 and 4"),
    Claim("FediOS, L_re on extractors > FedAvg+FT", "fedios:l_re=extractors", "fedavg_ft", UNCLAIMED),
    Claim("FediOS (default) > FedAvg", "fedios", "fedavg", "FediOS, Tables 1, 3 and 4"),
    Claim("FediOS (default) > FedAvg+FT", "fedios", "fedavg_ft", UNCLAIMED),
    Claim("FediOS: L_re on extractors > printed L_re (0)", "fedios:l_re=extractors", "fedios",
          "FediOS, Table 7 (with L_re > without)"),
]
"""The papers' orderings that the protocol's methods can check (each paper's baselines that run here),
with the question a user asks of every seed method: does it beat FedAvg+FT?"""


# -- methods ---------------------------------------------------------------------------------
def method_parts(method: str) -> tuple[str, dict[str, str]]:
    """`repper:variant=in+tau=0.5` -> ("repper", {"variant": "in", "tau": "0.5"}); a plain id has none."""
    algorithm, _, tail = method.partition(":")
    overrides = {}
    for item in filter(None, tail.split("+")):
        key, equals, value = item.partition("=")
        if not equals or not key or not value:
            raise ValueError(f"{method!r}: a hyperparameter is KEY=VALUE, got {item!r}")
        overrides[key] = value
    return algorithm, overrides


def method_name(method: str) -> str:
    """How the tables name a method: its `LABELS` entry, else `RepPer (variant=in)`."""
    if method in LABELS:
        return LABELS[method]
    algorithm, overrides = method_parts(method)
    return NAMES[algorithm] + (f" ({', '.join(f'{k}={v}' for k, v in overrides.items())})" if overrides else "")


def checked_methods(methods: list[str]) -> list[str]:
    """`methods` when each names a known algorithm with hyperparameters it has (else SystemExit naming it)."""
    from coordinator.algorithms import hyperparameters

    for method in methods:
        try:
            algorithm, overrides = method_parts(method)
            if algorithm not in PAPER_OPTIMIZERS:
                raise ValueError(f"unknown algorithm {algorithm!r}; known: {', '.join(PAPER_OPTIMIZERS)}")
            hyperparameters(algorithm, overrides)
        except ValueError as exc:  # the registry's ConfigError is one too: each names the key
            raise SystemExit(f"--methods: {method}: {exc}") from None
    return methods


# -- arguments -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "digits, 6 devices, 2 rounds x 1 epoch, fedavg and fedrep, lrs 0.01 and 0.1, dir0.5@1, "
                             "one worker, seed 0", name="fair-<dataset>-<rounds>rounds")
    add_cache_flags(parser, "other cells '-'", jobs=True)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--settings", default=",".join(SETTINGS))
    add_seeds_flag(parser, "0")
    parser.add_argument("--search-seeds", help="seeds of the lr search (default: the first of --seeds)")
    parser.add_argument("--grid", default="0.01,0.03,0.1", help="the common optimizer's lrs, searched on validation")
    add_run_flags(parser, (*RUN_FLAGS, "sgd_momentum", "sgd_weight_decay", "validation_fraction"),
                  {**PROTOCOL, "rounds": 50, "local_epochs": 2, "eval_every": 10, "validation_fraction": 0.2})
    args = parser.parse_args(argv)
    if args.quick:
        args.dataset, args.clients, args.rounds, args.local_epochs = "digits", 6, 2, 1
        args.methods, args.settings, args.seeds, args.grid = "fedavg,fedrep", "dir0.5@1", "0", "0.01,0.1"
        args.workers, args.eval_every = 1, 1  # eight small runs: a second worker process costs more than it saves
    args.methods = checked_methods(listed(args.methods))
    try:
        args.settings = [Setting.parse(s) for s in listed(args.settings)]
        args.grid = sorted(float(lr) for lr in listed(args.grid))
    except ValueError as exc:
        raise SystemExit(f"--settings/--grid: {exc}") from None
    if not args.grid or any(lr <= 0 for lr in args.grid):
        raise SystemExit(f"--grid: one or more positive lrs, got {args.grid}")
    if args.jobs < 1 or args.eval_every < 1:
        raise SystemExit(f"--jobs and --eval-every must be at least 1, got {args.jobs} and {args.eval_every}")
    if not 0 < args.validation_fraction < 1:
        raise SystemExit(f"--validation-fraction must be in (0, 1), got {args.validation_fraction}")
    try:
        args.seeds = [int(s) for s in listed(args.seeds)]
        args.search_seeds = [int(s) for s in listed(args.search_seeds)] if args.search_seeds else args.seeds[:1]
    except ValueError as exc:
        raise SystemExit(f"--seeds/--search-seeds: {exc}") from None
    if not args.seeds or not args.search_seeds:
        raise SystemExit("--seeds and --search-seeds: one seed at least")
    finish_cache_flags(args)
    run_settings(args, RUN_FLAGS)  # a value the run configuration refuses exits here, naming its key
    args.name = args.name or f"fair-{args.dataset}-{args.rounds}rounds"
    return args


def run_config(args: argparse.Namespace, method: str, setting: Setting, seed: int, *, lr: float,
               common: bool, validation: bool):
    """One run: the common optimizer (`common`) or the paper's, on the validation split or the test split."""
    optimizer = {"optimizer": "sgd", "sgd_momentum": args.sgd_momentum, "sgd_weight_decay": args.sgd_weight_decay}
    algorithm, overrides = method_parts(method)
    fields = {**run_settings(args, RUN_FLAGS), "lr": lr,
              "validation_fraction": args.validation_fraction if validation else 0.0}
    return bench_config(algorithm=algorithm, hyper=overrides, seed=seed, **fields, **(optimizer if common else {}),
                        **setting.fields())


# -- runs -------------------------------------------------------------------------------------
def accuracies(args: argparse.Namespace, cache: RunCache, method: str, setting: Setting, *, lr: float, common: bool,
               validation: bool) -> dict[str, Any]:
    """Final-round mean personalized accuracy per seed (seeds whose run failed or is not cached are absent):
    the search seeds on the validation split, the seeds on the test split."""
    seeds: dict[int, float | None] = {}
    runs: dict[int, str] = {}
    machines: dict[int, str] = {}
    for seed in args.search_seeds if validation else args.seeds:
        view = cache.run(run_config(args, method, setting, seed, lr=lr, common=common, validation=validation))
        if view is None:
            continue
        expected = "validation" if validation else "test"
        if view.report.get("evaluated_on", "test") != expected:
            raise RuntimeError(f"{view.out.name} was scored on {view.report.get('evaluated_on')}, not {expected}")
        seeds[seed], runs[seed], machines[seed] = view.personalized()["mean"], view.out.name, view.machine()
        log.info("%s %s %s lr %g seed %d (%s): %.4f", setting.name, method, "sgd" if common else "paper", lr, seed,
                 expected, seeds[seed])
    return {"lr": lr, "seeds": seeds, "runs": runs, "machines": machines, "accuracy": mean_std(list(seeds.values()))}


def choose_lr(search: list[dict[str, Any]]) -> float | None:
    """The lr of the best mean validation accuracy; ties to the smaller lr (`search` sorted by lr). None
    until every lr of the grid has a result: the best of a partial search is no choice."""
    if not search or any(entry["accuracy"]["mean"] is None for entry in search):
        return None
    return -max((entry["accuracy"]["mean"], -entry["lr"]) for entry in search)[1]


def train_side_by_side(args: argparse.Namespace, cache: RunCache) -> None:
    """`--jobs`: every run of the protocol, `args.jobs` at a time. The lr searches and the paper runs
    are queued in the order of the settings and methods asked for; a method's common-optimizer test
    runs go first in the queue once its search has ended (so that, cut short, the tables hold
    whole methods). The tables are then read from the cache by the sequential pass."""
    pool = RunPool(cache, args.jobs)
    finished = RunCache(args.cache, cached_only=True, ledger=args.ledger)  # reads the searches' results only
    searches_left: dict[tuple[Setting, str], int] = {}
    for setting in args.settings:
        for method in args.methods:
            searches_left[(setting, method)] = len(args.grid) * len(args.search_seeds)
            for lr in args.grid:
                for seed in args.search_seeds:
                    pool.submit(run_config(args, method, setting, seed, lr=lr, common=True, validation=True),
                                (setting, method))
            for seed in args.seeds:
                pool.submit(run_config(args, method, setting, seed, lr=args.lr, common=False, validation=False))
    for tag in pool.completed():
        if not isinstance(tag, tuple):  # None: a run that closes no search
            continue
        searches_left[tag] -= 1
        if searches_left[tag]:
            continue
        setting, method = tag
        chosen = choose_lr([accuracies(args, finished, method, setting, lr=lr, common=True, validation=True)
                            for lr in args.grid])
        if chosen is None:
            continue
        for seed in args.seeds:
            pool.submit(run_config(args, method, setting, seed, lr=chosen, common=True, validation=False), priority=1)


def run_setting(args: argparse.Namespace, cache: RunCache, setting: Setting) -> dict[str, Any]:
    """The lr search, the common-optimizer test runs and the paper runs of every method in `setting`."""
    methods = {}
    for method in args.methods:
        search = [accuracies(args, cache, method, setting, lr=lr, common=True, validation=True) for lr in args.grid]
        chosen = choose_lr(search)
        common = (accuracies(args, cache, method, setting, lr=chosen, common=True, validation=False)
                  if chosen is not None else None)
        paper = accuracies(args, cache, method, setting, lr=args.lr, common=False, validation=False)
        methods[method] = {"search": search, "chosen_lr": chosen, "common": common, "paper": paper}
    return methods


def progress(config: dict[str, Any], settings: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """How many runs of the protocol each kind has (search, common, paper: {"done", "planned"}), counted
    from the tables: a protocol that sessions add up over time says how far it has come."""
    per_method = {"search": len(config["grid"]) * len(config["search_seeds"]), "common": len(config["seeds"]),
                  "paper": len(config["seeds"])}
    counts = {kind: {"done": 0, "planned": planned * len(config["methods"]) * len(settings)}
              for kind, planned in per_method.items()}
    for methods in settings.values():
        for entry in methods.values():
            counts["search"]["done"] += sum(len(search["seeds"]) for search in entry["search"])
            counts["common"]["done"] += len(entry["common"]["seeds"]) if entry["common"] else 0
            counts["paper"]["done"] += len(entry["paper"]["seeds"])
    return counts


def claim_rows(methods: list[str], settings: dict[str, dict[str, Any]],
               claims: list[Claim] = CLAIMS) -> list[dict[str, Any]]:
    """Each claim whose two methods were asked for, in each setting, under each optimizer ("common",
    "paper"): measured on the seeds both ran, or "not measured"."""
    table = []
    for claim in claims:
        if claim.better not in methods or claim.worse not in methods:
            continue
        for name, results in settings.items():
            entry: dict[str, Any] = {"claim": claim.text, "source": claim.source, "better": claim.better,
                                     "worse": claim.worse, "setting": name}
            for kind in ("common", "paper"):
                better, worse = (results[method][kind] or {"seeds": {}} for method in (claim.better, claim.worse))
                entry[kind] = compare(better["seeds"], worse["seeds"]) or dict(NOT_MEASURED)
            table.append(entry)
    return table


# -- outputs ------------------------------------------------------------------------------------
def progress_line(counts: dict[str, dict[str, int]]) -> str:
    """`progress` as the sentence that heads the tables."""
    done, planned = (sum(kind[key] for kind in counts.values()) for key in ("done", "planned"))
    return (f"**Runs done: {done} of {planned}** (lr search {counts['search']['done']} of "
            f"{counts['search']['planned']}, common-optimizer test runs {counts['common']['done']} of "
            f"{counts['common']['planned']}, paper-optimizer runs {counts['paper']['done']} of "
            f"{counts['paper']['planned']}); a cell without a run reads -.")


def markdown(document: dict[str, Any]) -> str:
    config, settings = document["config"], document["settings"]
    labels = {name: Setting.parse(name).label for name in settings}
    header = "| method | " + " | ".join(labels.values()) + " |"
    rule = "|---|" + "---|" * len(labels)
    lines = ["## Fair protocol", "",
             f"{config['dataset']}, {config['clients']} devices, **{config['rounds']} rounds x "
             f"{config['local_epochs']} local epoch(s)**, batch {config['batch_size']}; mean personalized accuracy "
             "over devices at the last round on the test split (%), mean ± std over seeds "
             f"{', '.join(map(str, config['seeds']))}. Over MQTT. "
             "The two tables are separate experiments: do not compare a cell of one with a cell of the other as a "
             "ranking of methods.", "", progress_line(document["progress"]), "",
             f"### Common optimizer: SGD, momentum {config['sgd_momentum']}, weight decay "
             f"{config['sgd_weight_decay']}, lr chosen per method on validation", "",
             "Every local phase of every method (head phases included) trains with this SGD; the lr is each method's "
             f"best of {', '.join(f'{lr:g}' for lr in config['grid'])} by validation accuracy "
             f"({config['validation_fraction']:g} of each device's training data held out; the test split unread; "
             f"seeds {', '.join(map(str, config['search_seeds']))}), "
             "then the run is repeated on the full training data and scored on the test split.", "",
             header, rule]
    for method in config["methods"]:
        cells = []
        for name in settings:
            entry = settings[name][method]
            cells.append("-" if entry["common"] is None else f"{pct(entry['common']['accuracy'])} "
                         f"(lr {entry['chosen_lr']:g})")
        lines.append(f"| {method_name(method)} | " + " | ".join(cells) + " |")
    lines += ["", "### Each paper's optimizer", "",
              f"Each method's own local optimizer (`optimizer = \"paper\"`) at the run lr {config['lr']:g} where it "
              "takes the run's.", "", "| method | optimizer | " + " | ".join(labels.values()) + " |",
              "|---|---|" + "---|" * len(labels)]
    for method in config["methods"]:
        cells = [pct(settings[name][method]["paper"]["accuracy"]) for name in settings]
        optimizer = PAPER_OPTIMIZERS[method_parts(method)[0]]
        lines.append(f"| {method_name(method)} | {optimizer} | " + " | ".join(cells) + " |")
    lines += ["", "### The lr search (validation accuracy, %)", "",
              "| setting | method | " + " | ".join(f"lr {lr:g}" for lr in config["grid"]) + " | chosen |",
              "|---|---|" + "---|" * (len(config["grid"]) + 1)]
    for name in settings:
        for method in config["methods"]:
            entry = settings[name][method]
            cells = [pct(search["accuracy"]) for search in entry["search"]]
            chosen = "-" if entry["chosen_lr"] is None else f"{entry['chosen_lr']:g}"
            lines.append(f"| {labels[name]} | {method_name(method)} | " + " | ".join(cells) + f" | {chosen} |")
    lines += ["", "### The papers' claims under this protocol", "",
              "Each ordering of two methods above, in each setting and under each optimizer, on the seeds both ran "
              f"(difference in points, ± its std over seeds). Verdicts: {VERDICTS}. The "
              "ablations' claim table (benchmarks/docs/papers.md) checks each paper's own ablations.", "",
              "| claim | source | setting | common SGD: measured | reproduced? | paper optimizer: measured | "
              "reproduced? |", "|---|---|---|---|---|---|---|"]
    for claim in document["claims"]:
        common, paper = claim["common"], claim["paper"]
        lines.append(f"| {claim['claim']} | {claim['source']} | {labels[claim['setting']]} | {common['measured']} | "
                     f"{common['reproduced']} | {paper['measured']} | {paper['reproduced']} |")
    machines = [where for methods in settings.values() for entry in methods.values()
                for cell in [*entry["search"], entry["common"], entry["paper"]]
                for where in (cell or {}).get("machines", {}).values()]
    lines += trailer(document, machines)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    cache = RunCache(args.cache, broker=args.broker, cached_only=args.cached_only, ledger=args.ledger)
    machine = machine_info()
    if args.jobs > 1 and not args.cached_only:
        train_side_by_side(args, cache)
    settings = {setting.name: run_setting(args, cache, setting) for setting in args.settings}
    config = {"dataset": args.dataset, "clients": args.clients, "rounds": args.rounds,
              "local_epochs": args.local_epochs, "batch_size": args.batch_size, "lr": args.lr, "grid": args.grid,
              "sgd_momentum": args.sgd_momentum, "sgd_weight_decay": args.sgd_weight_decay,
              "validation_fraction": args.validation_fraction, "seeds": args.seeds,
              "search_seeds": args.search_seeds, "methods": args.methods,
              "settings": [s.name for s in args.settings], "workers": args.workers, "eval_every": args.eval_every,
              "jobs": args.jobs,
              "broker": args.broker or "embedded amqtt", "cache": args.cache,
              "ledger": args.ledger, "quick": args.quick}
    document = {"benchmark": "fair", "machine": machine, "config": config, "settings": settings,
                "progress": progress(config, settings), "claims": claim_rows(args.methods, settings),
                "failures": cache.failures, "missing": cache.missing}
    write_outputs(Path(args.out), args.name, document, markdown(document))
    log.info("wrote %s", Path(args.out) / f"{args.name}.md")
    if cache.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
