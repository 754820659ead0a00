"""Personalized accuracy of every algorithm on Fashion-MNIST, over MQTT (RepPer's Tables 2 and 3, Fig. 6).

Measures, with `coordinator.hosting.simulate.run_simulation` (embedded amqtt broker unless --broker):
1. Table 2 layout: the mean personalized accuracy over devices at the last round, mean ± std over
   seeds, for every algorithm (rows) under every partition (columns: Dirichlet alpha 0.1 and 0.5,
   2 classes per device (shards), feature skew (domains)), each beside its points over FedAvg on the
   seeds both ran; one table per participation fraction (0.2 and 1.0).
2. Table 3 layout: MLP, SVM and LR heads (the weak devices' numpy heads, through
   `edge_sdk.algorithms.repper.fit_lite_head`) fitted on each device's train features of the
   final body of FedAvg, LG-FedAvg, FedRep and RepPer, scored on its test split. Global bodies
   (FedAvg, FedRep, RepPer) come from the run's checkpoint with BatchNorm statistics recomputed
   on the device's train split; LG-FedAvg's body is personal and comes from
   `<run>/state/<device>/personal-<device>.msgpack`.
3. Fig. 6, new clients: `--holdout` devices never train; their accuracy as the run reports it
   (`final.holdout_accuracy`: RepPer fits its head, FedAvg+FT fine-tunes its head, FedPer and
   FedRep fit their personal head on the frozen global body), and the accuracy of an LR head the
   benchmark fits on the final body.
4. The target: on Dirichlet 0.1 with 20 devices, FedPer, FedRep, RepPer and DualFed
   beat FedAvg by >= 5 points at the same round budget.

--merge adds the runs of an earlier accuracy.json with the same training settings (seeds or algorithms
run before or on another machine) to the tables; the rows say which file each came from.

Runs are cached in --cache by their settings' fingerprint: re-running resumes or reuses them,
and asking for more rounds extends finished runs. The full run (on a quiet 2-core machine about
a day; subsets with --algorithms/--settings/--seeds share the cache):

    python -m benchmarks.accuracy --rounds 20 --local-epochs 1 --seeds 0,1,2 --out benchmarks/results

Quick smoke run (digits, fedavg and repper, one setting, one seed, 2 rounds):

    python -m benchmarks.accuracy --quick --out /tmp/acc

Writes accuracy.json, accuracy.md and accuracy_curves.png to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np


from ._machine import machine_info
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
from .runs import (
    ALGORITHMS,
    NAMES,
    RunCache,
    RunView,
    Setting,
    bench_config,
    line_style,
    listed,
    mean_std,
    pct,
    setup_logging,
    write_outputs,
)

log = logging.getLogger("benchmarks")

RUN_FLAGS = (*RUN_SETTINGS, "grad_clip_norm", "eval_every")
"""The run settings this script takes as flags (`edgepfl simulate`'s; runs with other values than the defaults
are cached apart, and --eval-every N > 1 runs are not shared with communication.py, which needs every round)."""
FULL_SETTINGS = "dir0.1@0.2,dir0.1@1,dir0.5@0.2,dir0.5@1,shards2@0.2,shards2@1,domains@0.2,domains@1"
HEAD_ALGORITHMS = ("fedavg", "lg_fedavg", "fedrep", "repper")
HEAD_KINDS = {"MLP": "mlp_sklearn", "SVM": "svm", "LR": "lr"}
HEAD_HIDDEN = 128
VARYING_STD = 1e-6
"""A feature dimension whose std over a device's examples is at most this carries nothing."""
PERSONAL_BODY = {"lg_fedavg"}
"""Algorithms whose body is personal (read from the device's store, not the checkpoint)."""
TARGET_ALGORITHMS = ("fedper", "fedrep", "repper", "dualfed")
TARGET_MARGIN = 0.05
PFLLIB: dict[str, Any] = {
    "source": "PFLlib benchmark (Zhang et al., JMLR 2025; pfllib.com/benchmark.html), its published table",
    "setting": "Fashion-MNIST, 20 clients, Dirichlet 0.1, 4-layer CNN, 2,000 rounds",
    "accuracy": {"FedAvg": 85.85, "FedPer": 97.44, "FedRep": 97.56, "FedRoD": 97.52, "FedProto": 97.40},
}
PAPERS_NOTE = (
    "None of the five seed papers (RepPer, DualFed, DC-PFL, CD2-pFed, FediOS) reports "
    "Fashion-MNIST. Their nearest tables: RepPer Table 2 (CIFAR-10, 20 clients, C=0.2, E=10, 100 rounds, "
    "ResNet-34): FedAvg 72.58/66.56, FedAvg+FT 72.62/69.41, FedRep 67.04/61.08, LG-FedAvg 75.67/73.62, "
    "RepPer 84.98/81.04 (alpha 1/0.5); RepPer Table 3 (heads on CIFAR-10, MLP/SVM/LR): FedAvg "
    "72.64/68.66/68.79, LG-FedAvg 74.64/59.82/60.05, FedRep 73.03/70.71/71.14, RepPer 86.22/82.67/83.78."
)


# -- arguments -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "digits, fedavg and repper, dir0.5@1, seed 0, 2 rounds, holdout 2")
    add_cache_flags(parser, "other cells left empty", fresh=True)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--settings", default=FULL_SETTINGS,
                        help="comma-separated dir<alpha>|shards<k>|domains|iid, each @<fraction>")
    add_seeds_flag(parser, "0,1,2")
    add_run_flags(parser, RUN_FLAGS, {**PROTOCOL, "rounds": 20})
    parser.add_argument("--no-heads", action="store_true", help="skip the heads table")
    parser.add_argument("--head-settings", help="settings of the heads table (default: every setting run)")
    parser.add_argument("--holdout", type=int, default=5, help="new-client devices (0: skip the experiment)")
    parser.add_argument("--holdout-setting", default="dir0.5@1")
    parser.add_argument("--holdout-algorithms", default="repper,fedavg_ft,fedrep")
    parser.add_argument("--set", action="append", default=[], metavar="ALGORITHM.KEY=VALUE", dest="assignments",
                        help="a hyperparameter of one algorithm for this invocation's runs, as `edgepfl --set` takes "
                             "it (repeatable; e.g. fedrep.momentum=0.5); such runs are cached apart from the defaults'")
    parser.add_argument("--merge", action="append", default=[], metavar="JSON",
                        help="an earlier accuracy.json with the same training settings (other seeds or algorithms, "
                             "e.g. from another machine): its runs and heads join the tables; repeatable. The "
                             "new-client experiment is not merged")
    args = parser.parse_args(argv)
    if args.quick:
        args.dataset, args.clients, args.rounds, args.local_epochs = "digits", 10, 2, 1
        args.algorithms, args.settings, args.seeds = "fedavg,repper", "dir0.5@1", "0"
        args.holdout, args.holdout_setting, args.holdout_algorithms = 2, "dir0.5@1", "repper,fedavg"
    finish_cache_flags(args)
    run_settings(args, RUN_FLAGS)  # a value the run configuration refuses exits here, naming its key
    args.hyper = parse_assignments(args.assignments)
    return args


def parse_assignments(assignments: list[str]) -> dict[str, dict[str, str]]:
    """`--set ALGORITHM.KEY=VALUE` values as algorithm -> {key: value}; exits naming a malformed one, an unknown
    algorithm, or a key or value the algorithm rejects."""
    from coordinator.algorithms import hyperparameters

    hyper: dict[str, dict[str, str]] = {}
    for text in assignments:
        name, equals, value = text.partition("=")
        algorithm, dot, key = name.partition(".")
        if not (equals and dot and algorithm and key):
            raise SystemExit(f"--set {text!r}: expected ALGORITHM.KEY=VALUE, e.g. fedrep.momentum=0.5")
        if algorithm not in ALGORITHMS:
            raise SystemExit(f"--set {text!r}: unknown algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")
        hyper.setdefault(algorithm, {})[key.strip()] = value.strip()
    for algorithm, values in hyper.items():
        try:
            hyperparameters(algorithm, values)
        except ValueError as exc:
            raise SystemExit(f"--set: {exc}") from None
    return hyper


def run_config(args: argparse.Namespace, algorithm: str, setting: Setting, seed: int, **extra: Any):
    return bench_config(algorithm=algorithm, seed=seed, hyper=dict(args.hyper.get(algorithm, {})),
                        **run_settings(args, RUN_FLAGS), **setting.fields(), **extra)


# -- heads on the final body -------------------------------------------------------------------
def device_index(client_id: str) -> int:
    return int(client_id.removeprefix("dev"))


def load_body(view: RunView, client_id: str):
    """The body device `client_id` deploys at the end of the run, BatchNorm statistics as stored."""
    import torch

    from coordinator.run.checkpoint import load as load_checkpoint
    from coordinator.run.folder import RunFolder
    from edge_sdk.models import build_body
    from edge_sdk.store import PersonalStore

    config = view.config
    body, _ = build_body(config.model_name, config.task())
    if config.run.algorithm in PERSONAL_BODY:
        state = PersonalStore(RunFolder(view.out).device_state(client_id), client_id).load()
        if state is None:
            raise FileNotFoundError(f"no personal state for {client_id} in {RunFolder(view.out).state_dir}")
        arrays = state.arrays
    else:
        checkpoint = load_checkpoint(RunFolder(view.out).checkpoint)
        if checkpoint is None:
            raise FileNotFoundError(f"no checkpoint in {view.out}")
        arrays = {k: v for group in checkpoint.state.values() for k, v in group.items()}
    weights = {k.removeprefix("body."): torch.from_numpy(np.array(v))
               for k, v in arrays.items() if k.startswith("body.")}
    missing, unexpected = body.load_state_dict(weights, strict=False)
    not_statistics = [k for k in missing if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    if not_statistics or unexpected:
        raise ValueError(f"{view.out.name}: body of {client_id} lacks {not_statistics} / has extra {unexpected}")
    return body


def varying_fraction(features: np.ndarray) -> float:
    """The fraction of feature dimensions that vary over the examples: a body whose ReLUs have died
    gives constant features (its model can only predict through the head's bias)."""
    return float((features.std(axis=0) > VARYING_STD).mean()) if len(features) > 1 else float("nan")


def fit_heads(view: RunView, client_ids: list[str], kinds: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per device: accuracy of each head kind fitted on its train features of the final body, and
    the fraction of the body's features that vary over its train split ("varying").
    Cached in the run's folder (lite_heads.json) by round, devices and kinds."""
    import torch

    from edge_sdk.algorithms.repper import fit_lite_head
    from edge_sdk.training import predict, recalibrate_batchnorm

    config = view.config
    cache_path = view.out / "lite_heads.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    round_ = view.report["rounds_completed"]
    results: dict[str, dict[str, float]] = {}
    for client_id in client_ids:
        key = f"{round_}/{client_id}"
        done = cache.get(key, {})
        if all(kind in done for kind in [*kinds, "varying"]):
            results[client_id] = {name: done[name] for name in [*kinds, "varying"]}
            continue
        index = device_index(client_id)
        data = config.run.client_data(index, config.training.seed)
        body = load_body(view, client_id)
        train_x, test_x = torch.from_numpy(data.train_x), torch.from_numpy(data.test_x)
        if config.run.algorithm not in PERSONAL_BODY:
            recalibrate_batchnorm(body, train_x)  # BatchNorm statistics are the device's own
        body.eval()
        train_f, test_f = predict(body, train_x).numpy(), predict(body, test_x).numpy()
        done["varying"] = varying_fraction(train_f)
        for name, kind in kinds.items():
            if name in done:
                continue
            head = fit_lite_head(kind, train_f, data.train_y, data.task.num_classes, hidden=HEAD_HIDDEN,
                                 seed=config.training.seed * 1000 + index)
            done[name] = float((head.predict(test_f) == data.test_y).mean()) if len(data.test_y) else float("nan")
        cache[key] = done
        cache_path.write_text(json.dumps(cache, indent=2))
        results[client_id] = {name: done[name] for name in [*kinds, "varying"]}
    return results


# -- the three experiments ---------------------------------------------------------------------
def run_grid(args, cache: RunCache, algorithms, settings, seeds) -> tuple[list[dict], dict[tuple, RunView]]:
    rows, views = [], {}
    total, done = len(algorithms) * len(settings) * len(seeds), 0
    for setting in settings:
        for algorithm in algorithms:
            for seed in seeds:
                done += 1
                view = cache.run(run_config(args, algorithm, setting, seed))
                if view is None:
                    status = "not in cache" if cache.cached_only else "failed"
                    rows.append({"algorithm": algorithm, "setting": setting.name, "seed": seed, "status": status})
                    log.info("[%d/%d] %s %s seed %d: %s", done, total, algorithm, setting.name, seed, status)
                    continue
                views[(algorithm, setting.name, seed)] = view
                accuracy = view.personalized()
                traffic = view.traffic()
                rows.append({
                    "algorithm": algorithm, "setting": setting.name, "seed": seed, "status": "ok",
                    "rounds": view.rounds, "rounds_in_run": view.report["rounds_completed"],
                    "personalized_accuracy": accuracy, "best_mean": view.best_mean(),
                    "global_accuracy": view.global_accuracy(),
                    "mb_up_per_round": traffic["up_train"] / 1e6, "mb_down_per_round": traffic["down_train"] / 1e6,
                    "round_seconds": view.run_seconds(), "wall_seconds": view.seconds,
                    "diverged_updates": view.diverged_updates,
                    "cached": view.cached, "run": view.out.name, "curve": curve(view),
                })
                log.info("[%d/%d] %s %s seed %d: %.4f%s", done, total, algorithm, setting.name, seed,
                         accuracy["mean"] if accuracy["mean"] is not None else float("nan"),
                         " (cached)" if view.cached else f" ({view.seconds:.0f} s)")
    return rows, views


def curve(view: RunView) -> list[list[float]]:
    """[[round, mean personalized accuracy], ...] for every evaluated round (kept in the JSON for plots)."""
    return [[r["round"], r["personalized_accuracy"]["mean"]] for r in view.records if r["personalized_accuracy"]]


def seed_list(seeds: list[int]) -> str:
    """'0, 1, 2', as the tables name seeds."""
    return ", ".join(map(str, seeds))


def seeds_named(seeds: list[int]) -> str:
    """'seeds 0, 1' or 'seed 2'."""
    return f"seed{'s' if len(seeds) > 1 else ''} {seed_list(seeds)}"


def seeded_pct(cell: dict[str, Any] | None, seeds: list[int]) -> str:
    """A table cell; one made of fewer runs than the table's seeds names its own, so that means over
    different seed sets are not read as comparable."""
    text = pct(cell)
    if cell and cell.get("seeds") and cell["seeds"] != seeds:
        text += f" ({seeds_named(cell['seeds'])})"
    return text


def final_by_seed(rows: list[dict]) -> dict[str, dict[str, dict[int, float]]]:
    """setting -> algorithm -> seed -> the mean personalized accuracy at the last round, of the finished runs."""
    final: dict[str, dict[str, dict[int, float]]] = {}
    for row in rows:
        if row["status"] == "ok" and row["personalized_accuracy"]["mean"] is not None:
            final.setdefault(row["setting"], {}).setdefault(row["algorithm"], {})[row["seed"]] = (
                row["personalized_accuracy"]["mean"])
    return final


def table(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """setting -> algorithm -> mean ± std over seeds of the runs' mean accuracy, and those seeds."""
    return {setting: {algorithm: {**mean_std(list(by_seed.values())), "seeds": sorted(by_seed)}
                      for algorithm, by_seed in algorithms.items()}
            for setting, algorithms in final_by_seed(rows).items()}


def over_fedavg(own: dict[int, float], fedavg: dict[int, float]) -> dict[str, Any]:
    """A row minus FedAvg on each seed both ran, and the mean of those differences: seeds differ by several
    points, so a row over fewer seeds is compared with FedAvg on its seeds, never with FedAvg's mean."""
    seeds = sorted(set(own) & set(fedavg))
    deltas = [own[seed] - fedavg[seed] for seed in seeds]
    return {"seeds": seeds, "delta": sum(deltas) / len(deltas) if deltas else None, "deltas": deltas}


def heads_experiment(views: dict[tuple, RunView], settings: list[Setting]) -> list[dict]:
    """One row per run of a HEAD_ALGORITHMS algorithm: the mean test accuracy of each head kind."""
    wanted = {s.name for s in settings}
    per_run = []
    for (algorithm, setting, seed), view in sorted(views.items()):
        if algorithm not in HEAD_ALGORITHMS or setting not in wanted:
            continue
        trainers = [cid for cid, m in view.report["final"]["per_client"].items() if not m.get("holdout")]
        log.info("heads: %s %s seed %d (%d devices)", algorithm, setting, seed, len(trainers))
        try:
            results = fit_heads(view, trainers, HEAD_KINDS)
        except (OSError, ValueError) as exc:
            log.warning("heads: %s %s seed %d: %s", algorithm, setting, seed, exc)
            continue
        means = {name: float(np.nanmean([r[name] for r in results.values()])) for name in HEAD_KINDS}
        varying = float(np.nanmean([r["varying"] for r in results.values()]))
        per_run.append({"algorithm": algorithm, "setting": setting, "seed": seed, "heads": means,
                        "varying_features": varying,
                        "round_of_body": view.report["rounds_completed"], "in_run": view.personalized()["mean"]})
    return per_run


def heads_table(per_run: list[dict]) -> dict[str, Any]:
    """The heads section of the JSON: its rows and setting -> algorithm -> head -> mean ± std over seeds."""
    cells: dict[str, dict[str, dict[str, list]]] = {}
    for row in per_run:
        measures = {**row["heads"], "in_run": row.get("in_run"), "varying": row.get("varying_features")}
        for name, value in measures.items():
            cells.setdefault(row["setting"], {}).setdefault(row["algorithm"], {}).setdefault(name, []).append(value)
    table_ = {s: {a: {n: mean_std(v) for n, v in heads.items()} for a, heads in algs.items()}
              for s, algs in cells.items()}
    return {"kinds": HEAD_KINDS, "hidden": HEAD_HIDDEN, "runs": per_run, "table": table_}


# -- runs of earlier invocations -----------------------------------------------------------------
SHARED_CONFIG = ("dataset", "clients", "rounds", "local_epochs", "batch_size", "lr", "grad_clip_norm", "model",
                 "eval_every", "hyper")
"""Config keys on which two invocations must agree for their runs to share a table cell."""
ADDED_CONFIG = {"hyper": {}, "grad_clip_norm": 0.0}
"""Keys newer than some result files, and the value the runs of a file without them had."""


def load_earlier(path: str, config: dict[str, Any]) -> dict[str, Any]:
    """An earlier accuracy.json whose runs may join this invocation's tables; exits naming the key that differs."""
    try:
        document = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--merge {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("benchmark") != "accuracy":
        raise SystemExit(f"--merge {path}: not a result of accuracy.py (no \"benchmark\": \"accuracy\")")
    for key in SHARED_CONFIG:
        theirs, ours = document.get("config", {}).get(key, ADDED_CONFIG.get(key)), config[key]
        if theirs != ours:
            raise SystemExit(f"--merge {path}: config.{key} is {theirs!r} there and {ours!r} here; only runs "
                             "with the same training settings can share a table")
    return document


def run_key(row: dict) -> tuple[str, str, int]:
    return row["algorithm"], row["setting"], row["seed"]


def merge_runs(rows: list[dict], head_runs: list[dict], earlier: dict[str, dict]) -> tuple[list, list, list]:
    """This invocation's runs and head rows plus those of `earlier` (path -> document) that it did not produce
    itself (its own finished runs win), each marked with its file; and one line per file saying what it added."""
    rows, head_runs, sources = list(rows), list(head_runs), []
    seen, seen_heads = {run_key(r) for r in rows if r["status"] == "ok"}, {run_key(r) for r in head_runs}
    for path, document in earlier.items():
        added = [r for r in document["runs"] if r["status"] == "ok" and run_key(r) not in seen]
        heads = [r for r in (document.get("heads") or {}).get("runs", []) if run_key(r) not in seen_heads]
        seen.update(run_key(r) for r in added)
        seen_heads.update(run_key(r) for r in heads)
        rows += [{**r, "merged_from": path} for r in added]
        head_runs += [{**r, "merged_from": path} for r in heads]
        machine = document.get("machine", {})
        sources.append({"file": path, "date": machine.get("date"), "command": machine.get("command"),
                        "runs": [list(run_key(r)) for r in added], "head_runs": [list(run_key(r)) for r in heads]})
    return rows, head_runs, sources


def holdout_experiment(args, cache: RunCache, seeds: list[int]) -> dict[str, Any]:
    setting = Setting.parse(args.holdout_setting)
    rows: list[dict[str, Any]] = []
    for algorithm in listed(args.holdout_algorithms):
        for seed in seeds:
            view = cache.run(run_config(args, algorithm, setting, seed, holdout_clients=args.holdout))
            if view is None:
                rows.append({"algorithm": algorithm, "seed": seed, "status": "failed"})
                continue
            held = sorted(cid for cid, m in view.report["final"]["per_client"].items() if m.get("holdout"))
            lr_head = None
            if algorithm not in PERSONAL_BODY and held:
                try:
                    results = fit_heads(view, held, {"LR": "lr"})
                    lr_head = float(np.nanmean([r["LR"] for r in results.values()]))
                except (OSError, ValueError) as exc:
                    log.warning("holdout heads: %s seed %d: %s", algorithm, seed, exc)
            reported = view.holdout() or {}
            rows.append({"algorithm": algorithm, "seed": seed, "status": "ok", "holdout_devices": held,
                         "holdout_accuracy": reported.get("mean"), "holdout_lr_head": lr_head,
                         "trainers_accuracy": view.personalized()["mean"], "run": view.out.name})
            log.info("holdout %s seed %d: new clients %.4f (LR head %s), trainers %.4f", algorithm, seed,
                     reported.get("mean") or float("nan"), f"{lr_head:.4f}" if lr_head is not None else "-",
                     view.personalized()["mean"] or float("nan"))
    summary = {}
    for algorithm in listed(args.holdout_algorithms):
        ok = [r for r in rows if r["algorithm"] == algorithm and r["status"] == "ok"]
        summary[algorithm] = {k: mean_std([r[k] for r in ok])
                              for k in ("holdout_accuracy", "holdout_lr_head", "trainers_accuracy")}
    return {"setting": setting.name, "holdout_clients": args.holdout, "clients": args.clients, "rows": rows,
            "table": summary}


def target_check(args, rows: list[dict]) -> dict[str, Any]:
    """Each target row against FedAvg on the seeds both have (merged tables may hold a row for fewer seeds than
    FedAvg's, and seeds differ by several points): the mean over those seeds of (row - FedAvg)."""
    description = ("fmnist, Dirichlet 0.1, 20 devices: FedPer, FedRep, RepPer and DualFed beat FedAvg's "
                   f"personalized accuracy by >= {100 * TARGET_MARGIN:.0f} points at the same round budget "
                   "(mean over the seeds both ran)")
    if args.dataset != "fmnist" or args.clients != 20:
        return {"description": description, "evaluated": False, "why": f"{args.dataset} with {args.clients} devices"}
    results = {}
    for setting, by_algorithm in final_by_seed(rows).items():
        fedavg = by_algorithm.get("fedavg")
        if not setting.startswith("dir0.1@") or not fedavg:
            continue
        fedavg_seeds = sorted(fedavg)
        cells = {}
        for algorithm in TARGET_ALGORITHMS:
            cell = over_fedavg(by_algorithm.get(algorithm, {}), fedavg)
            cells[algorithm] = {**cell, "met": cell["delta"] is not None and cell["delta"] >= TARGET_MARGIN}
        results[setting] = {"fedavg": sum(fedavg.values()) / len(fedavg), "fedavg_seeds": fedavg_seeds,
                            "rows": cells, "met": all(c["met"] for c in cells.values()),
                            "complete": all(c["seeds"] == fedavg_seeds for c in cells.values())}
    if not results:
        return {"description": description, "evaluated": False, "why": "no dir0.1 run of fedavg"}
    return {"description": description, "evaluated": True, "rounds": args.rounds, "by_setting": results,
            "met": all(r["met"] for r in results.values())}


# -- outputs ---------------------------------------------------------------------------------
def target_cell(name: str, row: dict[str, Any], fedavg_seeds: list[int]) -> str:
    """'FedRep +4.91', the mean over the seeds both ran; with several seeds each one's figure, and the seeds
    named when they are fewer than FedAvg's."""
    if row["delta"] is None:
        return f"{name} -"
    text = f"{name} {100 * row['delta']:+.2f}"
    seeds = seed_list(row["seeds"])
    if len(row["deltas"]) > 1:
        text += " (" + ", ".join(f"{100 * d:+.2f}" for d in row["deltas"]) + f" on seeds {seeds})"
    elif row["seeds"] != fedavg_seeds:
        text += f" (seed {seeds} only)"
    return text


def hyper_note(hyper: dict[str, dict[str, str]]) -> str:
    """' Hyperparameters other than the defaults: FedRep momentum=0.5.' (empty when there are none)."""
    if not hyper:
        return ""
    return " Hyperparameters other than the defaults: " + "; ".join(
        f"{NAMES[a]} " + ", ".join(f"{k}={v}" for k, v in values.items()) for a, values in hyper.items()) + "."


def participation_tables(document: dict[str, Any], settings: list[Setting], algorithms: list[str],
                         dataset: str) -> list[str]:
    """One table per participation fraction, two columns per partition: mean ± std over the seeds its header
    names, and the points over FedAvg on the seeds both ran (over_fedavg). The C=1 table ends with PFLlib's
    cited Dirichlet 0.1 figures when it has that column."""
    acc, final = document["table"], final_by_seed(document["runs"])
    lines = []
    for fraction in dict.fromkeys(s.fraction for s in settings):
        columns = [s for s in settings if s.fraction == fraction]
        column_seeds = {s.name: sorted(set().union(*final.get(s.name, {}).values())) for s in columns}
        lines += [f"**C={fraction:g}**", "",
                  "| method (%) | " + " | ".join(f"{s.data_label}, {seeds_named(column_seeds[s.name])} | over FedAvg"
                                                for s in columns) + " |",
                  "|---|" + "---|---|" * len(columns)]
        for algorithm in algorithms:
            cells = []
            for setting in columns:
                by_algorithm = final.get(setting.name, {})
                delta = over_fedavg(by_algorithm.get(algorithm, {}), by_algorithm.get("fedavg", {}))["delta"]
                cells += [seeded_pct(acc.get(setting.name, {}).get(algorithm), column_seeds[setting.name]),
                          "-" if algorithm == "fedavg" or delta is None else f"{100 * delta:+.2f}"]
            lines.append(f"| {NAMES[algorithm]} | " + " | ".join(cells) + " |")
        reference = next((i for i, s in enumerate(columns) if s.partition == "dirichlet" and s.alpha == 0.1), None)
        if fraction == 1.0 and reference is not None and dataset == "fmnist":
            cells = [""] * (2 * len(columns))
            cells[2 * reference] = ", ".join(f"{method} {value:.2f}" for method, value in PFLLIB["accuracy"].items())
            lines.append("| *PFLlib, 2,000 rounds (cited)* | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def heads_rows(heads: dict[str, Any], settings: list[Setting]) -> list[str]:
    """The heads table: a row per body (algorithm and setting) with the seeds its heads were fitted on."""
    seeds: dict[tuple[str, str], set[int]] = {}
    for row in heads["runs"]:
        seeds.setdefault((row["algorithm"], row["setting"]), set()).add(row["seed"])
    lines = ["| body of | seeds | MLP | SVM | LR | in run | varying features |", "|---|---|---|---|---|---|---|"]
    for setting in settings:
        cells = heads["table"].get(setting.name, {})
        for algorithm in (a for a in HEAD_ALGORITHMS if a in cells):
            lines.append(f"| {NAMES[algorithm]}, {setting.label} "
                         f"| {seed_list(sorted(seeds[algorithm, setting.name]))} | "
                         + " | ".join(pct(cells[algorithm][n]) for n in (*HEAD_KINDS, "in_run", "varying")) + " |")
    return lines + [""]


def markdown(args, document: dict[str, Any], settings: list[Setting], algorithms: list[str]) -> str:
    lines = [
        "## Personalized accuracy (RepPer Table 2 layout)",
        "",
        f"{args.dataset}, {args.clients} devices, model {document['config']['model']}, **{args.rounds} rounds x "
        f"{args.local_epochs} local epoch(s)**, batch {args.batch_size}, lr {args.lr}; mean ± std over seeds "
        f"of the mean personalized accuracy over devices (%) at round {args.rounds} (a cell over fewer seeds than "
        "its column names them); 'over FedAvg': the mean over the seeds both ran of the row's accuracy minus "
        "FedAvg's, in points. C = fraction of devices per round. Over MQTT (every byte through the broker)."
        + hyper_note(document["config"].get("hyper", {}))
        + (f" Devices clip each local step's gradients to an L2 norm of {args.grad_clip_norm:g}."
           if args.grad_clip_norm else ""),
        "",
        *participation_tables(document, settings, algorithms, args.dataset),
        f"Cited row: {PFLLIB['source']}; {PFLLIB['setting']}. {PAPERS_NOTE}", "",
    ]

    target = document["target"]
    lines += ["### Target", "", f"{target['description']}: "]
    if not target["evaluated"]:
        lines[-1] += f"not evaluated ({target['why']})."
    else:
        for setting, result in target["by_setting"].items():
            deltas = ", ".join(target_cell(NAMES[a], r, result["fedavg_seeds"]) for a, r in result["rows"].items())
            verdict = "**met**" if result["met"] else ("**not met**" if result["complete"] else "incomplete")
            lines.append(f"- {Setting.parse(setting).label}, {args.rounds} rounds: FedAvg {100 * result['fedavg']:.2f} "
                         f"(seeds {seed_list(result['fedavg_seeds'])}); points over FedAvg: {deltas} "
                         f"-> {verdict}")
    lines.append("")

    heads = document.get("heads")
    if heads and heads["table"]:
        lines += ["## Heads on the final body (RepPer Table 3 layout)", "",
                  "The weak devices' numpy heads fitted on each device's train features of the final body, mean "
                  "test accuracy over devices (%), mean ± std over seeds. MLP: one hidden layer of "
                  f"{HEAD_HIDDEN}; SVM: linear; LR: logistic regression. Global bodies get the device's own "
                  "BatchNorm statistics (recomputed on its train split); LG-FedAvg's body is the device's own. "
                  "'in run' is the algorithm's own personalized accuracy for comparison; 'varying features': "
                  "the share (%) of the body's feature dimensions that vary over a device's train split (a body "
                  "whose ReLUs died has constant features, and its model predicts through the head's bias). Every "
                  "figure of a row is over the seeds it names.", ""]
        later = sorted({r["round_of_body"] for r in heads["runs"] if r["round_of_body"] != args.rounds})
        if later:
            lines += [f"Some bodies come from runs extended past {args.rounds} rounds (rounds {later}): "
                      "their heads sit on a later body than the accuracy table's.", ""]
        lines += heads_rows(heads, settings)

    holdout = document.get("holdout")
    if holdout:
        setting = Setting.parse(holdout["setting"])
        lines += ["## New clients (RepPer Fig. 6)", "",
                  f"{holdout['holdout_clients']} of {holdout['clients']} devices never train (the last ids); "
                  f"{setting.label} among the others, {args.rounds} rounds. 'reported': the run's "
                  "`final.holdout_accuracy` (RepPer fits its personal head, FedAvg+FT fine-tunes the head, FedAvg "
                  "deploys the global model, FedPer and FedRep fit their personal head on the frozen global "
                  "body); 'LR head': a logistic regression the benchmark fits on the final body's features of "
                  "each new device. Mean ± std over seeds (%).", "",
                  "| method | new clients, reported | new clients, LR head | training devices |", "|---|---|---|---|"]
        for algorithm, cells in holdout["table"].items():
            lines.append(f"| {NAMES[algorithm]} | {pct(cells['holdout_accuracy'])} | {pct(cells['holdout_lr_head'])} "
                         f"| {pct(cells['trainers_accuracy'])} |")
        lines.append("")
    without_curve = sum(1 for r in document["runs"] if r["status"] == "ok" and not r.get("curve"))
    if without_curve:
        lines += [f"accuracy_curves.png averages the runs that carry per-round records; {without_curve} merged "
                  "run(s) from before these were kept are not in it.", ""]
    for source in document["merged"]:
        lines += [f"Merged from `{source['file']}` ({source['date']}, command `{source['command']}`): runs "
                  + (", ".join(f"{NAMES[a]} {Setting.parse(s).label} seed {seed}" for a, s, seed in source["runs"])
                     or "none") + f"; {len(source['head_runs'])} heads row(s).", ""]
    diverged = [r for r in document["runs"] if r.get("diverged_updates")]
    if diverged:
        lines += ["Devices whose training diverged (their updates were rejected as non-finite, and each such "
                  "round aggregated the other devices'): " + "; ".join(
                      f"{NAMES[r['algorithm']]} {Setting.parse(r['setting']).label} seed {r['seed']}: "
                      f"{r['diverged_updates']} update(s)" for r in diverged) + ".", ""]
    if document["failures"]:
        lines += ["Failed runs: " + "; ".join(f"{f['run']}: {f['error']}" for f in document["failures"]), ""]
    machine = document["machine"]
    lines += [f"Machine: {machine['cores']} cores, {machine['ram_gib']} GiB, {machine['cpu_model']}; "
              f"torch {machine['torch']}; load average at start {machine['load_average_at_start']}. "
              f"Command: `{machine['command']}`", ""]
    return "\n".join(lines)


def plot_curves(path: Path, rows: list[dict], settings: list[Setting], algorithms: list[str]) -> None:
    """Mean personalized accuracy per round, averaged over the seeds whose rows carry a curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_curve = [r for r in rows if r.get("curve")]
    shown = [s for s in settings if any(r["setting"] == s.name for r in with_curve)]
    if not shown:
        return
    columns = min(4, len(shown))
    grid_rows = (len(shown) + columns - 1) // columns
    fig, axes = plt.subplots(grid_rows, columns, figsize=(4.2 * columns, 3.4 * grid_rows), squeeze=False)
    for ax, setting in zip(axes.flat, shown, strict=False):
        for algorithm in algorithms:
            by_round: dict[int, list[float]] = {}
            for row in with_curve:
                if row["algorithm"] == algorithm and row["setting"] == setting.name:
                    for round_, mean in row["curve"]:
                        by_round.setdefault(round_, []).append(mean)
            if by_round:
                xs = sorted(by_round)
                ax.plot(xs, [float(np.mean(by_round[x])) for x in xs], marker=".", **line_style(algorithm))
        ax.set(title=setting.label, xlabel="round", ylabel="mean personalized accuracy")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    algorithms = listed(args.algorithms)
    unknown = [a for a in algorithms + listed(args.holdout_algorithms) if a not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {', '.join(unknown)}; known: {', '.join(ALGORITHMS)}")
    settings = [Setting.parse(s) for s in listed(args.settings)]
    seeds = [int(s) for s in listed(args.seeds)]
    out = Path(args.out)
    cache = RunCache(args.cache, broker=args.broker, fresh=args.fresh, cached_only=args.cached_only,
                     ledger=args.ledger)
    machine = machine_info()

    model = run_config(args, algorithms[0], settings[0], seeds[0]).model_name
    config = {"dataset": args.dataset, "clients": args.clients, "rounds": args.rounds,
              "local_epochs": args.local_epochs, "batch_size": args.batch_size, "lr": args.lr,
              "grad_clip_norm": args.grad_clip_norm, "model": model,
              "seeds": seeds, "settings": [s.name for s in settings], "algorithms": algorithms,
              "eval_every": args.eval_every, "hyper": args.hyper, "workers": args.workers,
              "aggregation_dtype": args.aggregation_dtype, "broker": args.broker or "embedded amqtt",
              "cache": args.cache,
              "ledger": args.ledger, "quick": args.quick}
    earlier = {path: load_earlier(path, config) for path in args.merge}  # before hours of training, not after

    rows, views = run_grid(args, cache, algorithms, settings, seeds)
    head_settings = [Setting.parse(s) for s in listed(args.head_settings)] if args.head_settings else settings
    head_runs = [] if args.no_heads else heads_experiment(views, head_settings)
    rows, head_runs, merged = merge_runs(rows, head_runs, earlier)
    holdout = holdout_experiment(args, cache, seeds) if args.holdout > 0 else None
    document = {
        "benchmark": "accuracy",
        "machine": machine,
        "config": config,
        "merged": merged,
        "runs": rows,
        "table": table(rows),
        "heads": None if args.no_heads else heads_table(head_runs),
        "holdout": holdout,
        "target": target_check(args, rows),
        "reference": {"pfllib": PFLLIB, "papers": PAPERS_NOTE},
        "failures": cache.failures,
    }
    settings += [Setting.parse(name) for name in dict.fromkeys(r["setting"] for r in rows)
                 if name not in {s.name for s in settings}]
    algorithms += [a for a in dict.fromkeys(r["algorithm"] for r in rows) if a not in algorithms]
    write_outputs(out, "accuracy", document, markdown(args, document, settings, algorithms))
    plot_curves(out / "accuracy_curves.png", rows, settings, algorithms)
    log.info("wrote %s", out / "accuracy.md")
    if cache.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
