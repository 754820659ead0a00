"""User-level differential privacy: what it costs in accuracy and in time, and how much of the
accuracy personalization recovers.

Three tables, each from cached runs (benchmarks/runs.py: one folder per settings fingerprint, the
run ledger, `--jobs`):

1. Accuracy against epsilon: each method of `--algorithms` without DP (epsilon inf) and under
   central DP at each epsilon of `--epsilons` (at `--dp-delta`, 1e-5 by default): the mean over
   devices of the personalized accuracy, the trainers' and the weak devices' apart
   (`--lite-fraction` of the devices are weak ones: they train nothing and fit a head on the
   released body), and the global model's accuracy where the algorithm has one; then what each
   personalized method recovers of what DP costs FedAvg's global model.
2. Central against local DP at `--local-epsilon` (8) for `--local-algorithms`.
3. The cost in time: the device's clip (and, under local DP, noise) of one upload
   (`edge_sdk.privacy.upstream.privatize`) and the coordinator's DP mean of a round's m uploads
   (`coordinator.privacy.mechanism.PrivateMean` add and result), timed on arrays of the run's model,
   against the no-DP run's mean round seconds; and the accountant's time per round
   (`PrivacyAccountant.add_round` + `epsilon`) at the run's N, m and rounds.

Every private run calibrates its noise multiplier z to its target epsilon over the planned rounds
(`dp_epsilon`, with the library's own calibration, `RunPrivacy`), reports its evaluation figures as
measured (`dp_evaluation = "outside"`: the experimenter's figures on data they own; the epsilon
covers training, not evaluation) and draws its noise from the run's seed (`dp_reproducible_noise`,
so the same command repeats its figures). The calibrated z is passed to the run as `dp_noise` as
well, because it enters the run's fingerprint where `dp_epsilon` does not: runs at two epsilons
would otherwise share a cache folder. Devices are evaluated once, after the last round (an
evaluation of 500 devices costs several rounds).

The protocol's defaults: Fashion-MNIST, 500 devices (the last 20 % weak), Dirichlet(0.2) labels (the
smallest alpha of 0.1, 0.12, 0.15, 0.18, 0.2 whose partition gives all 500 devices the library's
minimum of 10 examples), C = 0.1 of the 400 trainers per round (m = 40), clip 0.1, the `mlp` model
(118,282 parameters, no BatchNorm: a private run cannot release a body with BatchNorm statistics),
20 rounds of 1 local epoch, four device worker processes per run (the devices of a worker register
one after another, mostly waiting: 500 devices register in 155 s with two workers, 47 s with eight);
FedAvg, FedAvg+FT, FedRep, RepPer and DualFed. DualFed is the seed method of the three that run
under DP (FediOS, CD2-pFed, DualFed) with the least CPU per round (measured on Fashion-MNIST, 50
devices, mlp, central DP: FedAvg 1.4 s, DualFed 2.2 s, CD2-pFed 3.2 s, FediOS 5.3 s); CD2-pFed
cannot release an mlp body for the weak devices (its narrower global body does not load).

    python -m benchmarks.privacy --jobs 2
    python -m benchmarks.privacy --cached-only   # the tables from the runs already made

Quick smoke run (digits, 20 devices, C = 0.5, 2 rounds, FedAvg and FedRep at epsilon 8 and inf,
FedAvg under local DP, one device worker process per run: 20 devices need no more, and each worker
is a process that imports torch; about a minute):

    python -m benchmarks.privacy --quick --out /tmp/privacy

Writes privacy.{json,md} (or `--name`) to --out.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.algorithms import load
from coordinator.config.run_config import RunConfig
from coordinator.privacy.accountant import PrivacyAccountant, calibrate_noise
from coordinator.privacy.mechanism import PrivateMean
from coordinator.privacy.run import RunPrivacy
from edge_sdk.models import build_model, count_parameters
from edge_sdk.privacy import PrivacySettings
from edge_sdk.privacy.upstream import UploadPrivacy, privatize

from coordinator.config.flags import given

from .flags import PROTOCOL, RUN_SETTINGS, add_cache_flags, add_output_flags, add_run_flags, add_seeds_flag, \
    finish_cache_flags
from ._machine import machine_info
from .runs import NAMES, RunCache, RunPool, RunView, bench_config, listed, setup_logging, trailer, write_outputs

log = logging.getLogger("benchmarks")

RUN_FLAGS = (*RUN_SETTINGS, "model", "partition", "alpha", "fraction", "lite_fraction", "dp_clip", "dp_delta",
             "dp_accountant")
"""The run settings every run of the protocol takes from the flags; the algorithm, the DP mode and the
target epsilon are each run's own."""
DEFAULTS: dict[str, Any] = {**PROTOCOL, "clients": 500, "rounds": 20, "local_epochs": 1, "workers": 4, "model": "mlp",
                            "partition": "dirichlet", "alpha": 0.2, "fraction": 0.1, "lite_fraction": 0.2,
                            "dp_clip": 0.1, "dp_delta": 1e-5}
ALGORITHMS = ("fedavg", "fedavg_ft", "fedrep", "repper", "dualfed")
LOCAL_ALGORITHMS = ("fedavg", "fedrep")
EPSILONS = "1,2,4,8,inf"
OFF, CENTRAL, LOCAL = "off", "central", "local"


@dataclass(frozen=True)
class Row:
    """One run of the protocol: an algorithm, a DP mode and its target epsilon (None: no DP)."""

    algorithm: str
    mode: str
    epsilon: float | None

    @property
    def key(self) -> str:
        return f"{self.algorithm}/{self.mode}/{epsilon_label(self.epsilon)}"


def epsilon_label(epsilon: float | None) -> str:
    """`8`, `0.5` or `inf` (no DP)."""
    return "inf" if epsilon is None else f"{epsilon:g}"


# -- arguments -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "digits, 20 devices, C=0.5, 2 rounds, fedavg and fedrep at epsilon 8 and inf, fedavg "
                             "under local DP, 1 device worker per run", name="privacy")
    add_cache_flags(parser, "other cells '-'", jobs=True)
    parser.add_argument("--algorithms", help=f"methods of the accuracy table (default {','.join(ALGORITHMS)}; "
                        "with --quick: fedavg,fedrep)")
    parser.add_argument("--epsilons", help=f"target epsilons, inf: no DP (default {EPSILONS}; with --quick: 8,inf)")
    parser.add_argument("--local-algorithms", help=f"methods run under local DP too, at --local-epsilon (default "
                        f"{','.join(LOCAL_ALGORITHMS)}; with --quick: fedavg)")
    parser.add_argument("--local-epsilon", type=float, default=8.0, help="epsilon of central against local DP")
    parser.add_argument("--timing-repeats", type=int, help="repetitions of each timed DP operation (default 20; "
                        "with --quick: 3)")
    add_seeds_flag(parser, "0")
    add_run_flags(parser, RUN_FLAGS, DEFAULTS)
    args = parser.parse_args(argv)
    lists = ("fedavg,fedrep", "8,inf", "fedavg") if args.quick else (",".join(ALGORITHMS), EPSILONS,
                                                                      ",".join(LOCAL_ALGORITHMS))
    for name, default in zip(("algorithms", "epsilons", "local_algorithms"), lists, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.quick:
        args.dataset, args.clients, args.fraction, args.rounds = "digits", 20, 0.5, 2
        args.workers = 1
    if args.timing_repeats is None:  # an explicit --timing-repeats holds under --quick too
        args.timing_repeats = 3 if args.quick else 20
    args.algorithms, args.local_algorithms = listed(args.algorithms), listed(args.local_algorithms)
    unknown = sorted(set(args.algorithms + args.local_algorithms) - set(NAMES))
    if unknown:
        raise SystemExit(f"--algorithms/--local-algorithms: unknown {', '.join(unknown)}; known: {', '.join(NAMES)}")
    try:
        args.epsilons = [None if e == "inf" else float(e) for e in listed(args.epsilons)]
        args.seeds = [int(s) for s in listed(args.seeds)]
    except ValueError as exc:
        raise SystemExit(f"--epsilons/--seeds: {exc}") from None
    if any(e is not None and not (math.isfinite(e) and e > 0) for e in args.epsilons) or args.local_epsilon <= 0:
        raise SystemExit("--epsilons and --local-epsilon: positive numbers (inf: no DP)")
    if not args.seeds or args.jobs < 1 or args.timing_repeats < 1:
        raise SystemExit("--seeds: one seed at least; --jobs and --timing-repeats: at least 1")
    finish_cache_flags(args)
    try:  # a value the run configuration refuses exits here, naming its key
        bench_config(**run_fields(args))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    args.name = args.name or "privacy"
    return args


def planned_rows(args: argparse.Namespace) -> list[Row]:
    """Every run of the protocol, once: the accuracy table's, then local DP's (with the central and
    no-DP runs it is compared with)."""
    rows = [Row(a, OFF if e is None else CENTRAL, e) for a in args.algorithms for e in args.epsilons]
    for algorithm in args.local_algorithms:
        rows += [Row(algorithm, OFF, None), Row(algorithm, CENTRAL, args.local_epsilon),
                 Row(algorithm, LOCAL, args.local_epsilon)]
    return list(dict.fromkeys(rows))


# -- runs -------------------------------------------------------------------------------------
def trainers(config: RunConfig) -> int:
    """N: the devices eligible for training (the weak ones and the holdouts are not)."""
    return config.run.clients - config.lite_devices - config.round.holdout_clients


def calibrated_noise(config: RunConfig) -> float:
    """The noise multiplier the coordinator calibrates for `config` (its `RunPrivacy`, with the
    population, sample and evaluation releases the coordinator gives it)."""
    rounds, every = config.training.rounds, config.round.eval_every
    evaluations = sum(1 for r in range(1, rounds + 1) if r % every == 0 or r == rounds)
    releases = config.run.release or load(config.run.algorithm).releases_representation
    return _noise(config.privacy, config.run.clients, trainers(config), config.round.fraction, rounds,
                  evaluations + int(releases), config.training.seed)


@functools.cache
def _noise(settings: PrivacySettings, devices: int, population: int, fraction: float, rounds: int, evaluations: int,
           seed: int) -> float:
    """`RunPrivacy`'s calibrated z, once per settings in a process (a calibration takes seconds, and
    every run's settings are built twice: to train it and to read it)."""
    return RunPrivacy(settings, devices=devices, population=population, fraction=fraction, rounds=rounds,
                      evaluations=evaluations, seed=seed).noise


def run_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The settings every run shares: the flags', evaluated once, after the last round, and the body
    released when some devices are weak (they personalize on it)."""
    return {**given(args, RUN_FLAGS), "eval_every": args.rounds, "release": args.lite_fraction > 0}


def run_config(args: argparse.Namespace, row: Row, seed: int) -> RunConfig:
    """One run of `row`: under DP, z calibrated to the row's epsilon and passed as dp_noise too."""
    fields: dict[str, Any] = {**run_fields(args), "algorithm": row.algorithm, "seed": seed}
    if row.mode != OFF:
        fields.update(dp=row.mode, dp_epsilon=row.epsilon, dp_evaluation="outside", dp_reproducible_noise=True)
        fields["dp_noise"] = calibrated_noise(bench_config(**fields))
    return bench_config(**fields)


def train_side_by_side(args: argparse.Namespace, cache: RunCache, rows: list[Row]) -> None:
    """`--jobs`: every run, `args.jobs` at a time, the no-DP runs first (the cost table needs their
    round times), then the most private. The tables are then read from the cache."""
    pool = RunPool(cache, args.jobs)
    for row in rows:
        for seed in args.seeds:
            priority = 1e3 if row.mode == OFF else -(row.epsilon or 0.0)
            pool.submit(run_config(args, row, seed), row.key, priority=priority)
    pool.run_all()


def cell(view: RunView | None) -> dict[str, Any] | None:
    """What the tables read of one run (None: no run)."""
    if view is None:
        return None
    final = view.report["final"]
    by_kind = final.get("by_kind") or {}
    privacy = view.report.get("privacy")
    records = view.records
    return {
        "run": view.out.name, "machine": view.machine(),
        "personalized": view.personalized()["mean"],
        "trainers": (by_kind.get("trainer") or {}).get("mean"),
        "weak": (by_kind.get("lite") or {}).get("mean"),
        "global": view.global_accuracy(),
        "privacy": None if privacy is None else {key: privacy.get(key) for key in (
            "mode", "epsilon", "epsilon_fleet", "delta", "noise_multiplier", "clip", "budget", "rounds_accounted",
            "outside_the_guarantee")},
        "round_seconds": statistics.fmean(r["seconds"] for r in records) if records else None,
        "participants": statistics.fmean(r["participants"] for r in records) if records else None,
        "wall_seconds": view.report.get("wall_seconds"),
    }


def collect(args: argparse.Namespace, cache: RunCache, rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Each row's runs by seed (a failed or missing run is absent), and its settings."""
    results = {}
    for row in rows:
        seeds = {}
        for seed in args.seeds:
            config = run_config(args, row, seed)
            found = cell(cache.run(config))
            if found is not None:
                seeds[str(seed)] = found
        results[row.key] = {"algorithm": row.algorithm, "mode": row.mode, "epsilon": row.epsilon,
                            "noise_multiplier": config.privacy.dp_noise if row.mode != OFF else None,
                            "seeds": seeds}
    return results


# -- the cost in time -------------------------------------------------------------------------
def timed(action: Callable[[], object], repeats: int) -> float:
    """Median seconds of `action` over `repeats` calls (after one call to warm up)."""
    action()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def privatize_once(trained: dict[str, np.ndarray], received: dict[str, np.ndarray], upload: UploadPrivacy,
                   rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One device's upload of `trained` under `upload`, as `privatize` makes it (one group)."""
    return privatize({"model": trained}, {"model": received}, upload, rng)[0]["model"]


def private_mean(received: dict[str, np.ndarray], uploaded: dict[str, np.ndarray], *, clip: float, std: float,
                 sample: int, rng: np.random.Generator) -> None:
    """The coordinator's DP mean of one round: `sample` uploads added, then the result."""
    mean = PrivateMean(received, clip=clip, std=std, expected=sample, rng=rng)
    for _ in range(sample):
        mean.add(uploaded, 1.0)
    mean.result()


def dp_costs(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Milliseconds of the DP operations of one round of the protocol's runs, on the arrays of the run's
    model (its initial state, a device's change of std 0.01 per coordinate): one device's privatize
    (central: clip; local: clip + noise), the coordinator's PrivateMean over m uploads (central: clip
    again + noise; local: the sum), and the accountant's round."""
    config = run_config(args, Row(args.algorithms[0], CENTRAL, args.local_epsilon), seed)
    model = build_model(config.model_name, config.task(), seed=seed)
    received = {key: value.detach().cpu().numpy().copy() for key, value in model.state_dict().items()}
    rng = np.random.default_rng(seed)
    trained = {key: value + rng.normal(0.0, 0.01, value.shape).astype(value.dtype) if value.dtype.kind == "f"
               else value for key, value in received.items()}
    population = trainers(config)
    sample = min(population, max(1, int(round(config.round.fraction * population))))
    z, clip = config.privacy.dp_noise, config.privacy.dp_clip
    costs: dict[str, Any] = {"parameters": count_parameters(model), "population": population, "sample": sample,
                             "noise_multiplier": z, "clip": clip}
    for mode in (CENTRAL, LOCAL):
        upload = UploadPrivacy(mode=mode, clip=clip, noise=z, evaluation="outside", eval_noise=10.0,
                               reproducible=True, seed=seed)
        uploaded = privatize_once(trained, received, upload, rng)
        central = mode == CENTRAL
        device = functools.partial(privatize_once, trained, received, upload, rng)
        coordinator = functools.partial(private_mean, received, uploaded, clip=clip if central else 0.0,
                                        std=z * clip if central else 0.0, sample=sample, rng=rng)
        costs[mode] = {"device_ms": 1e3 * timed(device, args.timing_repeats),
                       "coordinator_ms": 1e3 * timed(coordinator, max(1, args.timing_repeats // 4))}
    costs["accountant"] = accountant_costs(args, config, population, sample)
    return costs


def accountant_costs(args: argparse.Namespace, config: RunConfig, population: int,
                     sample: int) -> list[dict[str, Any]]:
    """Per target epsilon of the accuracy table: z, the seconds of its calibration (`calibrate_noise`, as a
    central run with its evaluations outside the guarantee calibrates) and the accountant's milliseconds
    per round, over the run's rounds: add_round + epsilon (what each round's record states), and
    epsilon_after (the budget check before each round of a run with a budget)."""
    privacy = config.privacy
    delta = privacy.delta_for(config.run.clients)
    out = []
    for epsilon in [e for e in args.epsilons if e is not None]:
        started = time.perf_counter()
        z = calibrate_noise(privacy.dp_accountant, privacy.dp_sampling, population, sample, args.rounds, delta,
                            epsilon)
        calibration = time.perf_counter() - started
        accountant = PrivacyAccountant(privacy.dp_accountant, privacy.dp_sampling, delta)
        round_s = budget_s = 0.0
        for _ in range(args.rounds):
            started = time.perf_counter()
            accountant.epsilon_after(population, sample, z)
            budget_s += time.perf_counter() - started
            started = time.perf_counter()
            accountant.add_round(population, sample, z)
            spent = accountant.epsilon()
            round_s += time.perf_counter() - started
        out.append({"epsilon": epsilon, "noise_multiplier": z, "calibration_s": calibration,
                    "per_round_ms": 1e3 * round_s / args.rounds, "budget_check_ms": 1e3 * budget_s / args.rounds,
                    "epsilon_after_rounds": spent})
    return out


def cost_rows(results: dict[str, dict[str, Any]], costs: dict[str, Any], algorithms: list[str]) -> list[dict]:
    """Per algorithm with a no-DP run: DP's share of its mean round, central and local: the mechanism
    (every device's privatize and the coordinator's mean, as if done one after the other on one core:
    an upper bound, the devices' part runs on the devices) and the accountant (its round and its budget
    check, at the epsilon that costs most)."""
    accountant = max((a["per_round_ms"] + a["budget_check_ms"] for a in costs["accountant"]), default=0.0)
    table = []
    for algorithm in algorithms:
        entry = results.get(Row(algorithm, OFF, None).key)
        seconds = [c["round_seconds"] for c in (entry or {}).get("seeds", {}).values() if c["round_seconds"]]
        if not seconds:
            continue
        round_ms = 1e3 * statistics.fmean(seconds)
        row: dict[str, Any] = {"algorithm": algorithm, "round_ms": round_ms, "accountant_ms": accountant,
                               "accountant_share": accountant / round_ms}
        for mode in (CENTRAL, LOCAL):
            mechanism = costs["sample"] * costs[mode]["device_ms"] + costs[mode]["coordinator_ms"]
            row[mode] = {"mechanism_ms": mechanism, "mechanism_share": mechanism / round_ms,
                         "share": (mechanism + accountant) / round_ms}
        table.append(row)
    return table


# -- tables -----------------------------------------------------------------------------------
def seed_mean(entry: dict[str, Any] | None, field: str) -> float | None:
    values = [c[field] for c in (entry or {}).get("seeds", {}).values() if c.get(field) is not None]
    return statistics.fmean(values) if values else None


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def recovery(results: dict[str, dict[str, Any]], config: dict[str, Any]) -> list[dict[str, Any]]:
    """Per private epsilon: what DP costs FedAvg's global model (points against no DP, on the trainers,
    where the global model is evaluated) and, per personalized method, its trainers' mean personalized
    accuracy minus FedAvg's global accuracy at that epsilon: the points it recovers, and their share of
    DP's cost (1 or more: all of it)."""
    if "fedavg" not in config["algorithms"]:
        return []
    baseline = seed_mean(results.get(Row("fedavg", OFF, None).key), "global")
    rows = []
    for epsilon in [e for e in config["epsilons"] if e is not None]:
        private = seed_mean(results.get(Row("fedavg", CENTRAL, epsilon).key), "global")
        cost = None if baseline is None or private is None else baseline - private
        for algorithm in config["algorithms"]:
            if algorithm == "fedavg":
                continue
            accuracy = seed_mean(results.get(Row(algorithm, CENTRAL, epsilon).key), "trainers")
            gain = None if accuracy is None or private is None else accuracy - private
            rows.append({"epsilon": epsilon, "algorithm": algorithm, "fedavg_global": private, "dp_cost": cost,
                         "personalized": accuracy, "recovered": gain,
                         "share": gain / cost if gain is not None and cost and cost > 0 else None})
    return rows


def markdown(document: dict[str, Any]) -> str:
    config, results = document["config"], document["results"]
    epsilons = config["epsilons"]
    sample = document["costs"]["sample"] if document["costs"] else None
    lines = ["## Differential privacy: accuracy against epsilon, central against local, cost", "",
             f"{config['dataset']}, {config['clients']} devices ({config['lite_fraction']:g} of them weak: they "
             f"train nothing and fit a head on the released body), Dirichlet({config['alpha']:g}) labels, C = "
             f"{config['fraction']:g} of the trainers per round (m = {sample}), {config['rounds']} rounds x "
             f"{config['local_epochs']} local epoch(s), model {config['model']} ({document['costs'].get('parameters')}"
             f" parameters), clip {config['dp_clip']:g}, delta {config['dp_delta']:g}, {config['dp_accountant']} "
             f"accountant, seeds {', '.join(map(str, config['seeds']))}. Accuracy (%) after the last round on the "
             "test split, mean over devices. **The figures are the experimenter's, measured on data they own "
             "(`dp_evaluation = \"outside\"`): each epsilon covers training, not the evaluation.** z is calibrated "
             "to each target epsilon over the planned rounds; the noise on the round's mean has std z x C / m "
             "per coordinate. Noise drawn from the run's seed (`dp_reproducible_noise`).", "",
             "### Accuracy against epsilon (central DP)", "",
             "| method | devices | " + " | ".join(f"eps {epsilon_label(e)}" for e in epsilons) + " |",
             "|---|---|" + "---|" * len(epsilons)]
    z_cells = []
    for epsilon in epsilons:
        entry = results.get(Row(config["algorithms"][0], OFF if epsilon is None else CENTRAL, epsilon).key)
        z = (entry or {}).get("noise_multiplier")
        z_cells.append("no DP" if epsilon is None else "-" if z is None else
                       f"{z:.3f} (std {z * config['dp_clip'] / sample:.2g})")
    lines.append("| z (noise std on the mean) | | " + " | ".join(z_cells) + " |")
    for algorithm in config["algorithms"]:
        for field, label in (("personalized", "all, personalized"), ("trainers", "trainers"), ("weak", "weak"),
                             ("global", "global model")):
            values = [seed_mean(results.get(Row(algorithm, OFF if e is None else CENTRAL, e).key), field)
                      for e in epsilons]
            if field == "global" and all(v is None for v in values):
                continue
            lines.append(f"| {NAMES[algorithm]} | {label} | " + " | ".join(percent(v) for v in values) + " |")
    recovered = document["recovery"]
    if recovered:
        lines += ["", "### Does personalization recover what DP costs?", "",
                  "On the trainers (where the global model is evaluated). DP's cost: FedAvg's global accuracy "
                  "without DP minus with it. Recovered: a method's mean personalized accuracy minus FedAvg's global "
                  "accuracy at the same epsilon (points; share of DP's cost in brackets, 100 % or more: all of it).",
                  "", "| eps | FedAvg global | DP's cost (points) | method | personalized, trainers | recovered "
                  "(points) |",
                  "|---|---|---|---|---|---|"]
        for entry in recovered:
            cost = "-" if entry["dp_cost"] is None else f"{100 * entry['dp_cost']:.2f}"
            gain = "-" if entry["recovered"] is None else f"{100 * entry['recovered']:+.2f}"
            share = "" if entry["share"] is None else f" ({100 * entry['share']:.0f} %)"
            lines.append(f"| {epsilon_label(entry['epsilon'])} | {percent(entry['fedavg_global'])} | {cost} | "
                         f"{NAMES[entry['algorithm']]} | {percent(entry['personalized'])} | {gain}{share} |")
    lines += ["", f"### Central against local DP at epsilon {config['local_epsilon']:g}", "",
              "| method | DP | z | epsilon (fleet) | all, personalized | trainers | weak | global model |",
              "|---|---|---|---|---|---|---|---|"]
    for algorithm in config["local_algorithms"]:
        for mode, epsilon in ((OFF, None), (CENTRAL, config["local_epsilon"]), (LOCAL, config["local_epsilon"])):
            entry = results.get(Row(algorithm, mode, epsilon).key)
            z = (entry or {}).get("noise_multiplier")
            spent = [c["privacy"] for c in (entry or {}).get("seeds", {}).values() if c["privacy"]]
            epsilon_cell = "-" if not spent else (f"{max(p['epsilon'] or math.inf for p in spent):.3g} "
                                                  f"({max(p['epsilon_fleet'] or math.inf for p in spent):.3g})")
            lines.append(f"| {NAMES[algorithm]} | {mode} | {'-' if z is None else f'{z:.3f}'} | {epsilon_cell} | "
                         + " | ".join(percent(seed_mean(entry, f)) for f in ("personalized", "trainers", "weak",
                                                                              "global")) + " |")
    costs = document["costs"]
    lines += ["", "### The cost in time", "",
              f"On arrays of the run's model ({costs['parameters']} parameters), median of "
              f"{config['timing_repeats']}: one device's privatize (central: clip; local: clip + noise), the "
              f"coordinator's PrivateMean over m = {costs['sample']} uploads (central: clip again + noise; local: "
              "the sum), and the accountant's round (add_round + epsilon, and the budget check epsilon_after; the "
              "largest of the epsilons'), against the no-DP run's mean round. The mechanism per round: m x device + "
              "coordinator, as if one core did it all (an upper bound: on a fleet the devices' part runs on the "
              "devices, in parallel).", "",
              f"Device: {costs[CENTRAL]['device_ms']:.3f} ms central, {costs[LOCAL]['device_ms']:.3f} ms local per "
              f"upload; coordinator: {costs[CENTRAL]['coordinator_ms']:.2f} ms central, "
              f"{costs[LOCAL]['coordinator_ms']:.2f} ms local per round.", "",
              "| method | no-DP round (s) | mechanism, central: ms (share) | mechanism, local: ms (share) | "
              "accountant: ms (share) | DP in all, central | DP in all, local |", "|---|---|---|---|---|---|---|"]
    for row in document["cost_rows"]:
        central, local = row[CENTRAL], row[LOCAL]
        lines.append(f"| {NAMES[row['algorithm']]} | {row['round_ms'] / 1e3:.2f} | {central['mechanism_ms']:.1f} "
                     f"({100 * central['mechanism_share']:.2f} %) | {local['mechanism_ms']:.1f} "
                     f"({100 * local['mechanism_share']:.2f} %) | {row['accountant_ms']:.0f} "
                     f"({100 * row['accountant_share']:.2f} %) | {100 * central['share']:.2f} % | "
                     f"{100 * local['share']:.2f} % |")
    lines += ["", f"The accountant at N = {costs['population']}, m = {costs['sample']}, {config['rounds']} rounds:", "",
              "| target eps | z | calibration (s) | add_round + epsilon (ms per round) | budget check, epsilon_after "
              "(ms per round) | eps after the rounds |", "|---|---|---|---|---|---|"]
    for entry in costs["accountant"]:
        lines.append(f"| {entry['epsilon']:g} | {entry['noise_multiplier']:.3f} | {entry['calibration_s']:.2f} | "
                     f"{entry['per_round_ms']:.2f} | {entry['budget_check_ms']:.2f} | "
                     f"{entry['epsilon_after_rounds']:.3f} |")
    lines += ["", "### The runs", "", "| method | DP | target eps | z | eps | eps fleet | mean round (s) | wall (s) |",
              "|---|---|---|---|---|---|---|---|"]
    for entry in results.values():
        for found in entry["seeds"].values():
            privacy = found["privacy"] or {}
            lines.append(f"| {NAMES[entry['algorithm']]} | {entry['mode']} | {epsilon_label(entry['epsilon'])} | "
                         f"{_number(privacy.get('noise_multiplier'), '.3f')} | {_number(privacy.get('epsilon'), '.3f')}"
                         f" | {_number(privacy.get('epsilon_fleet'), '.3f')} | {_number(found['round_seconds'], '.2f')}"
                         f" | {_number(found['wall_seconds'], '.0f')} |")
    lines += trailer(document, [found["machine"] for entry in results.values() for found in entry["seeds"].values()])
    return "\n".join(lines)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    cache = RunCache(args.cache, broker=args.broker, cached_only=args.cached_only, ledger=args.ledger)
    machine = machine_info()
    rows = planned_rows(args)
    if args.jobs > 1 and not args.cached_only:
        train_side_by_side(args, cache, rows)
    results = collect(args, cache, rows)
    costs = dp_costs(args, args.seeds[0])
    config = {"dataset": args.dataset, "clients": args.clients, "rounds": args.rounds,
              "local_epochs": args.local_epochs, "batch_size": args.batch_size, "lr": args.lr, "model": args.model,
              "partition": args.partition, "alpha": args.alpha, "fraction": args.fraction,
              "lite_fraction": args.lite_fraction, "dp_clip": args.dp_clip, "dp_delta": args.dp_delta,
              "dp_accountant": args.dp_accountant, "epsilons": args.epsilons, "algorithms": args.algorithms,
              "local_algorithms": args.local_algorithms, "local_epsilon": args.local_epsilon, "seeds": args.seeds,
              "workers": args.workers, "jobs": args.jobs, "timing_repeats": args.timing_repeats,
              "broker": args.broker or "embedded amqtt", "cache": args.cache, "ledger": args.ledger,
              "quick": args.quick}
    document = {"benchmark": "privacy", "machine": machine, "config": config, "results": results,
                "recovery": recovery(results, config), "costs": costs,
                "cost_rows": cost_rows(results, costs, args.algorithms), "failures": cache.failures,
                "missing": cache.missing}
    text = markdown(document)
    write_outputs(Path(args.out), args.name, document, text)
    print(text)
    if cache.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
