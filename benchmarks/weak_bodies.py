"""Which body should a weak device get? Every algorithm that can release a body, with every weak-device head.

For each algorithm whose global state holds a whole body (those `--release` exports), the run
trains with the release on; then, for every device of the run as a weak device would: the
released ONNX body (the global body with the BatchNorm statistics the trainers pooled) computes
the device's features through ONNX Runtime, and each weak-device head (`edge_sdk.lite.heads`:
svm, lr, mlp, ncm on the device's own class means) is fitted on its training split and scored on
its test split. Same data, rounds and seeds for every algorithm; runs are cached as accuracy.py's.
`--jobs N` trains N runs side by side and fits each run's heads in its own process. The heads
need each run's folder, so runs are read from the cache, not the run ledger (they are recorded
there as every benchmark's runs are). The tables
read only the last round, so `--eval-every` (default 1, as the digits table ran) can skip the
evaluations between.

    python -m benchmarks.weak_bodies --rounds 15 --settings dir0.1@1,domains@1 --seeds 0 --eval-every 15 --jobs 13
    python -m benchmarks.weak_bodies --quick --out /tmp/weak-bodies      # digits, 2 rounds

Writes weak_bodies.json and weak_bodies.md to --out.
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
from .runs import (ALGORITHMS, NAMES, RunCache, RunPool, RunView, Setting, bench_config, listed, mean_std, pct,
                    setup_logging, write_outputs)

log = logging.getLogger("benchmarks")

HEADS = ("svm", "lr", "mlp", "ncm")
"""The weak devices' heads (edge_sdk.lite.heads.HEADS), in the tables' order."""

SETTINGS = (*RUN_SETTINGS, "eval_every")
"""The run settings this script takes as flags: the learning benchmarks' and how often to evaluate."""


def releasable(algorithm_ids: tuple[str, ...] | list[str], args: argparse.Namespace) -> list[str]:
    """The algorithms whose global state holds a whole body (`ServerAlgorithm.shares_body`)."""
    from coordinator import algorithms
    from coordinator.algorithms.base import ServerContext

    config = bench_config(algorithm="fedavg", **run_settings(args, SETTINGS))
    context = ServerContext(config.model_name, config.task(), 0, 1, config.run.clients, config.aggregation)
    return [a for a in algorithm_ids
            if algorithms.load(a)(algorithms.hyperparameters(a, {}), context).shares_body()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "digits, fedavg and fedrep, dir0.5@1, seed 0, 2 rounds")
    add_cache_flags(parser, "other cells left empty", jobs=True)
    parser.add_argument("--algorithms", help="comma-separated (default: every algorithm that can release a body)")
    parser.add_argument("--settings", default="dir0.1@1,domains@1",
                        help="comma-separated dir<alpha>|shards<k>|domains|iid, each @<fraction>")
    add_seeds_flag(parser, "0")
    add_run_flags(parser, SETTINGS, {**PROTOCOL, "rounds": 15})
    args = parser.parse_args(argv)
    if args.quick:
        args.dataset, args.clients, args.rounds, args.local_epochs = "digits", 6, 2, 1
        args.algorithms, args.settings, args.seeds = "fedavg,fedrep", "dir0.5@1", "0"
    finish_cache_flags(args)
    if args.jobs < 1:
        raise SystemExit("--jobs: at least 1")
    run_settings(args, SETTINGS)  # a value the run configuration refuses exits here, naming its key
    wanted = listed(args.algorithms) if args.algorithms else list(ALGORITHMS)
    unknown = [a for a in wanted if a not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"--algorithms: unknown {', '.join(unknown)}; known: {', '.join(ALGORITHMS)}")
    args.algorithm_list = releasable(wanted, args)
    refused = [a for a in wanted if a not in args.algorithm_list]
    if args.algorithms and refused:
        raise SystemExit(f"--algorithms: {', '.join(refused)} keep(s) part of the body personal: no body to release")
    return args


def device_heads(view: RunView, index: int) -> dict[str, float]:
    """Device `index`'s test accuracy with each head on the run's released body (cached in the
    run's folder, weak_heads.json)."""
    from coordinator.run.folder import RunFolder
    from edge_sdk.lite.features import FeatureExtractor
    from edge_sdk.lite.heads import fit_head

    cache_path = view.out / "weak_heads.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    key = f"{view.report['rounds_completed']}/dev{index:03d}"
    if all(kind in cache.get(key, {}) for kind in HEADS):
        return {kind: cache[key][kind] for kind in HEADS}
    config = view.config
    data = config.run.client_data(index, config.training.seed)
    extractor = FeatureExtractor(RunFolder(view.out).release)
    train, test = extractor.embed(data.train_x), extractor.embed(data.test_x)
    scores = {}
    for kind in HEADS:
        head = fit_head(kind, train, data.train_y, num_classes=data.task.num_classes,
                        seed=config.training.seed * 1000 + index)
        scores[kind] = float((head.predict(test) == data.test_y).mean()) if len(data.test_y) else float("nan")
    cache[key] = scores
    cache_path.write_text(json.dumps(cache, indent=2))
    return scores


def fit_all_heads(view: RunView) -> None:
    """Every device's heads on `view`'s release (a `RunPool` child's work after its run)."""
    for index in range(view.config.run.clients):
        device_heads(view, index)


def run_configs(args: argparse.Namespace) -> list[tuple[Setting, str, int, Any]]:
    """(setting, algorithm, seed, run configuration) of every run the tables read."""
    return [(setting, algorithm, seed,
             bench_config(algorithm=algorithm, seed=seed, release=True, **run_settings(args, SETTINGS),
                          **setting.fields()))
            for setting in (Setting.parse(text) for text in listed(args.settings))
            for algorithm in args.algorithm_list
            for seed in (int(s) for s in listed(args.seeds))]


def train_side_by_side(args: argparse.Namespace, cache: RunCache) -> None:
    """`--jobs`: every run and its heads, `args.jobs` at a time; the tables then read the cache."""
    pool = RunPool(cache, args.jobs, then=fit_all_heads)
    for *_, config in run_configs(args):
        pool.submit(config)
    pool.run_all()


def measure(args: argparse.Namespace, cache: RunCache) -> list[dict[str, Any]]:
    """One row per (setting, algorithm, seed): the devices' mean accuracy with each head."""
    rows = []
    for setting, algorithm, seed, config in run_configs(args):
        view = cache.run(config)
        if view is None:
            rows.append({"algorithm": algorithm, "setting": setting.name, "seed": seed, "status": "missing"})
            continue
        per_device = [device_heads(view, index) for index in range(config.run.clients)]
        heads = {kind: float(np.nanmean([d[kind] for d in per_device])) for kind in HEADS}
        rows.append({"algorithm": algorithm, "setting": setting.name, "seed": seed, "status": "ok",
                     "heads": heads, "in_run": view.personalized()["mean"], "run": view.out.name})
        log.info("%s %s seed %d: %s", algorithm, setting.name, seed,
                 ", ".join(f"{k} {v:.4f}" for k, v in heads.items()))
    return rows


def markdown(rows: list[dict[str, Any]], settings: list[str], algorithms: list[str]) -> str:
    """A table per setting: each head's mean accuracy over the devices (mean ± std over seeds)."""
    lines = []
    for setting in settings:
        label = Setting.parse(setting).label
        lines += [f"### {label}", "", "| body of | seeds | " + " | ".join(h.upper() for h in HEADS) + " | in run |",
                  "|---|---|" + "---|" * (len(HEADS) + 1)]
        for algorithm in algorithms:
            done = [r for r in rows if r["algorithm"] == algorithm and r["setting"] == setting and r["status"] == "ok"]
            if not done:
                continue
            seeds = ", ".join(str(r["seed"]) for r in done)
            cells = [pct(mean_std([r["heads"][kind] for r in done])) for kind in HEADS]
            lines.append(f"| {NAMES[algorithm]} | {seeds} | " + " | ".join(cells)
                         + f" | {pct(mean_std([r['in_run'] for r in done]))} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    # The heads need each run's folder (its release), which a ledger record does not hold: runs are
    # recorded in the ledger but read from the cache only.
    cache = RunCache(args.cache, broker=args.broker, cached_only=args.cached_only, ledger=args.ledger,
                     from_ledger=False)
    if args.jobs > 1 and not args.cached_only:
        train_side_by_side(args, cache)
    rows = measure(args, cache)
    settings = [Setting.parse(s).name for s in listed(args.settings)]
    document = {"benchmark": "weak_bodies", "machine": machine_info(),
                "config": {**run_settings(args, SETTINGS), "settings": settings, "seeds": listed(args.seeds),
                           "algorithms": args.algorithm_list, "heads": list(HEADS)},
                "runs": rows, "failures": cache.failures}
    write_outputs(Path(args.out), "weak_bodies", document, markdown(rows, settings, args.algorithm_list))
    log.info("wrote %s", Path(args.out) / "weak_bodies.md")
    if cache.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
