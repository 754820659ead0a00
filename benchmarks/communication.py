"""Communication of every algorithm over MQTT: bytes per round, MB to a target accuracy, upload codecs, DC-PFL
statistics.

Measures, with `coordinator.hosting.simulate.run_simulation` (embedded amqtt broker unless --broker), from
each run's report.json (`rounds[].bytes_up/bytes_down`, `communication.by_kind`):
1. Bytes per round of every algorithm with the default model, on digits (10 devices, 2 rounds)
   and Fashion-MNIST (the runs of part 2): uploads (TRAIN_RES), the TRAIN broadcast as the
   coordinator publishes it and as the broker delivers it to every device, and evaluation.
2. DualFed's Table 8 layout: rounds and MB until the mean personalized accuracy first reaches
   --target (0.90) on Fashion-MNIST, Dirichlet 0.1, 20 devices, full participation; MB = uploads
   + the TRAIN broadcasts delivered to the 20 devices (evaluation traffic left out); or "not
   reached in N rounds". The target: RepPer and DualFed reach 90% with fewer MB than FedAvg.
3. Upload codecs (`RunConfig.upload_codec`: fp32, fp16, int8, q4, q2, topk on the change from the broadcast)
   on --codec-algorithms: MB up per round and the accuracy they cost.
4. DC-PFL's statistics (`--set covariance=full|diag|lowrank:8`, `transport=fp32|fp16`): bytes up
   per device and round, and accuracy.
5. With --over-seeds ACCURACY_JSON: part 2 for every seed of an accuracy.py result, from its
   runs' per-round curves and bytes, training nothing (a seed's runs cost an hour; the curves
   are already there).
6. With --grid, instead of parts 1-5: upload codecs x personalization algorithms in --setting
   (benchmarks/codec_grid.py): MB up and down to 95% of each algorithm's fp32 accuracy, encode
   CPU, and whether a cell reaches FedAvg+FT's accuracy with a tenth of FedAvg's MB. The run of
   benchmarks/docs/communication.md, on a 6000 + 2000 image Fashion-MNIST (`fmnist_subset`):

    python -m benchmarks.communication --grid --data-dir /tmp/fmnist-8k --setting dir0.5@1 --rounds 10 \
        --cache /tmp/codec-cache --ledger none --out benchmarks/results

   Quick: `--grid --quick` (digits, FedAvg and DC-PFL, fp32 and topk, 2 rounds).

Runs are cached by fingerprint in --cache (shared with accuracy.py: with the same rounds and local
epochs, part 2 reuses accuracy.py's dir0.1@1 runs of --seed). The run of benchmarks/docs/communication.md
(107 minutes on a quiet 2-core machine; --algorithms and friends run subsets against the same cache):

    python -m benchmarks.communication --rounds 15 --local-epochs 1 --codec-algorithms fedavg \
        --dc-modes full/fp32,diag/fp16,lowrank:8/fp16 --over-seeds benchmarks/results/accuracy-fmnist-15rounds.json

Quick smoke run (digits, fedavg and repper, 2 rounds, int8 uploads, two DC-PFL modes):

    python -m benchmarks.communication --quick --out /tmp/comm

Writes communication.json, communication.md and communication_curves.png to --out; with --grid,
communication-codecs-<setting>.json/.md/.png (--name: another stem).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any


from .flags import (PROTOCOL, RUN_SETTINGS, add_cache_flags, add_output_flags, add_run_flags, finish_cache_flags,
                     run_settings)
from . import codec_grid
from ._machine import machine_info
from .runs import (
    ALGORITHMS,
    NAMES,
    RunCache,
    RunView,
    Setting,
    bench_config,
    has_field,
    line_style,
    listed,
    mean_std,
    setup_logging,
    write_outputs,
)

log = logging.getLogger("benchmarks")

CODECS = ("fp32", "fp16", "int8", "q4", "q2", "topk")
DC_MODES = [("full", "fp32"), ("full", "fp16"), ("diag", "fp32"), ("diag", "fp16"), ("lowrank:8", "fp32"),
            ("lowrank:8", "fp16")]
TARGET_ALGORITHMS = ("repper", "dualfed")
DUALFED_TABLE8 = ("DualFed paper Table 8 (MB to a target accuracy; PACS 85%, DomainNet 75%, Office-Home 70%): "
                  "FedAvg 1920.93/2008.52/2538.72, FedPer 1658.47/1658.47/2007.62, FedRep 2705.92/3316.94/3753.37, "
                  "DualFed 611.21/873.27/1225.59.")


RUN_FLAGS = (*RUN_SETTINGS, "seed")
"""The run settings this script takes as flags (`edgepfl simulate`'s); --dataset, --clients and --rounds are
those of parts 2-4 (part 1's digits runs have their own)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "digits only, fedavg and repper, 2 rounds")
    add_cache_flags(parser, "other rows left out", fresh=True)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--setting", default="dir0.1@1", help="data setting of parts 2-4")
    add_run_flags(parser, RUN_FLAGS, {**PROTOCOL, "rounds": 20})
    parser.add_argument("--target", type=float, default=0.90, help="mean personalized accuracy to reach")
    parser.add_argument("--digits-rounds", type=int, default=2, help="rounds of the short digits runs of part 1")
    parser.add_argument("--codec-algorithms", default="fedavg,repper,dualfed")
    parser.add_argument("--codecs", default=",".join(CODECS), help="upload codecs to compare (fp32 is the baseline)")
    parser.add_argument("--over-seeds", metavar="ACCURACY_JSON",
                        help="also tabulate rounds and MB to --target for every seed of this accuracy.py result")
    parser.add_argument("--dc-modes", default=",".join(f"{c}/{t}" for c, t in DC_MODES),
                        help="DC-PFL covariance/transport pairs ('' to skip)")
    parser.add_argument("--grid", action="store_true", help="only part 6: codecs x algorithms in --setting")
    parser.add_argument("--grid-algorithms", default=",".join(codec_grid.GRID_ALGORITHMS))
    parser.add_argument("--grid-codecs", default=",".join(codec_grid.GRID_CODECS))
    parser.add_argument("--name", help="output file stem of --grid (default communication-codecs-<setting>)")
    args = parser.parse_args(argv)
    if args.quick and args.grid:
        args.dataset, args.clients, args.setting, args.rounds, args.local_epochs = "digits", 10, "dir0.5@1", 2, 1
        args.grid_algorithms, args.grid_codecs = "fedavg,dc_pfl", "fp32,topk"
    elif args.quick:
        args.dataset, args.clients, args.setting, args.rounds, args.local_epochs = "digits", 10, "dir0.5@1", 2, 1
        args.algorithms, args.target, args.digits_rounds = "fedavg,repper", 0.5, 2
        args.codec_algorithms, args.codecs, args.dc_modes = "fedavg", "fp32,int8", "full/fp32,lowrank:4/fp16"
    finish_cache_flags(args)
    run_settings(args, RUN_FLAGS)  # a value the run configuration refuses exits here, naming its key
    return args


def config_for(args, algorithm: str, *, dataset: str | None = None, clients: int | None = None,
               setting: str | None = None, rounds: int | None = None, **extra: Any):
    fields = {**run_settings(args, RUN_FLAGS), "dataset": dataset or args.dataset, "clients": clients or args.clients,
              "rounds": rounds or args.rounds}
    return bench_config(algorithm=algorithm, **fields, **Setting.parse(setting or args.setting).fields(), **extra)


def traffic_row(algorithm: str, view: RunView) -> dict[str, Any]:
    traffic = view.traffic()
    return {
        "algorithm": algorithm, "model": view.config.model_name, "clients": view.config.run.clients,
        "rounds": view.report["rounds_completed"],
        "mb_up_per_round": traffic["up_train"] / 1e6,
        "kb_up_per_device_round": traffic["up_train_per_device"] / 1e3,
        "mb_down_per_round": traffic["down_train"] / 1e6,
        "mb_down_delivered_per_round": traffic["down_train_delivered"] / 1e6,
        "mb_eval_per_evaluation": traffic["eval_per_round"] / 1e6,
        "mb_total_up_per_round": traffic["total_up"] / 1e6,
        "mb_total_down_per_round": traffic["total_down"] / 1e6,
        "by_kind": view.report["communication"]["by_kind"],
        "run": view.out.name,
    }


# -- the four parts ----------------------------------------------------------------------------
def per_round(args, cache: RunCache, algorithms: list[str], main_views: dict[str, RunView]) -> dict[str, list]:
    tables: dict[str, list] = {"digits": []}
    for algorithm in algorithms:
        view: RunView | None
        if args.dataset == "digits" and algorithm in main_views:
            view = main_views[algorithm]
        else:
            view = cache.run(config_for(args, algorithm, dataset="digits", clients=10, setting="dir0.5@1",
                                        rounds=args.digits_rounds))
        if view is not None:
            tables["digits"].append(traffic_row(algorithm, view))
            log.info("per round, digits: %s %.3f MB up", algorithm, tables["digits"][-1]["mb_up_per_round"])
    if args.dataset != "digits":
        tables[args.dataset] = [traffic_row(a, v) for a, v in main_views.items()]
    return tables


def to_target(args, views: dict[str, RunView]) -> dict[str, Any]:
    rows = []
    for algorithm, view in views.items():
        reached = view.rounds_to(args.target)
        rows.append({"algorithm": algorithm, **reached, "final_accuracy": view.personalized()["mean"],
                     "rounds_run": view.rounds, "run": view.out.name})
    by = {r["algorithm"]: r for r in rows}
    check: dict[str, Any] = {
        "description": f"RepPer and DualFed reach {100 * args.target:.0f}% with fewer MB than FedAvg "
                       f"({args.dataset}, {Setting.parse(args.setting).label}, {args.clients} devices)",
        "evaluated": args.dataset == "fmnist" and args.clients == 20 and args.setting.startswith("dir0.1"),
    }
    if "fedavg" in by and all(a in by for a in TARGET_ALGORITHMS):
        fedavg = by["fedavg"]
        verdicts = {}
        for algorithm in TARGET_ALGORITHMS:
            row = by[algorithm]
            if not row["reached"]:
                verdicts[algorithm] = False
            elif not fedavg["reached"]:
                verdicts[algorithm] = True  # FedAvg did not get there within the budget at all
            else:
                verdicts[algorithm] = row["mb_total"] < fedavg["mb_total"]
        check.update({"by_algorithm": verdicts, "met": all(verdicts.values()),
                      "fedavg_reached": fedavg["reached"]})
    else:
        check.update({"met": None, "why": "fedavg, repper or dualfed not run"})
    return {"target": args.target, "setting": args.setting, "dataset": args.dataset, "clients": args.clients,
            "rounds": args.rounds, "local_epochs": args.local_epochs, "rows": rows, "check": check}


def to_target_over_seeds(args, path: Path) -> dict[str, Any]:
    """Part 2 for every seed of an accuracy.py result, in --setting: the first round whose mean
    personalized accuracy (its curve) reaches --target within --rounds, and the training MB until
    then, rounds x (MB up per round + the broadcast as delivered to every device); participation
    and payloads are the same every round, so this equals what `RunView.rounds_to` sums."""
    document = json.loads(path.read_text())
    clients = document["config"]["clients"]
    runs = [r for r in document["runs"] if r["status"] == "ok" and r["setting"] == args.setting and r.get("curve")]
    if not runs:
        raise SystemExit(f"{path}: no finished runs of setting {args.setting} with per-round curves")
    rows: dict[str, dict[str, Any]] = {}
    for run in sorted(runs, key=lambda r: r["seed"]):
        mb_per_round = run["mb_up_per_round"] + run["mb_down_per_round"] * clients
        reached = next((round_ for round_, mean in run["curve"] if round_ <= args.rounds and mean >= args.target),
                       None)
        best = max(mean for round_, mean in run["curve"] if round_ <= args.rounds)
        row = rows.setdefault(run["algorithm"], {"algorithm": run["algorithm"], "seeds": {}})
        row["seeds"][run["seed"]] = {"round": reached, "mb_total": None if reached is None else reached * mb_per_round,
                                     "best": best}
    for row in rows.values():
        totals = [seed["mb_total"] for seed in row["seeds"].values() if seed["mb_total"] is not None]
        row["reached_on"] = len(totals)
        row["mb_total"] = mean_std(totals)
    return {"source": str(path), "code": document["machine"].get("code"), "target": args.target,
            "setting": args.setting, "rounds": args.rounds, "clients": clients,
            "rows": [rows[a] for a in NAMES if a in rows]}


def codecs(args, cache: RunCache, main_views: dict[str, RunView]) -> dict[str, Any]:
    if not has_field("upload_codec"):
        return {"available": False, "rows": [],
                "note": "this checkout has no upload codec (RunConfig.upload_codec): not implemented"}
    rows: list[dict[str, Any]] = []
    for algorithm in listed(args.codec_algorithms):
        baseline: dict[str, Any] | None = None
        for codec in ["fp32"] + [c for c in listed(args.codecs) if c != "fp32"]:
            view = main_views.get(algorithm) if codec == "fp32" else None
            view = view or cache.run(config_for(args, algorithm, upload_codec=codec))
            if view is None:
                rows.append({"algorithm": algorithm, "codec": codec, "status": "failed"})
                continue
            traffic = view.traffic()
            accuracy = view.personalized()["mean"]
            row: dict[str, Any] = {"algorithm": algorithm, "codec": codec, "status": "ok",
                   "mb_up_per_round": traffic["up_train"] / 1e6,
                   "kb_up_per_device_round": traffic["up_train_per_device"] / 1e3,
                   "accuracy": accuracy, "run": view.out.name}
            if codec == "fp32":
                baseline = row
            if baseline is not None and row is not baseline:
                row["up_ratio"] = row["mb_up_per_round"] / baseline["mb_up_per_round"]
                row["accuracy_delta"] = None if accuracy is None else accuracy - baseline["accuracy"]
            rows.append(row)
            log.info("codec %s %s: %.3f MB up per round, accuracy %.4f", algorithm, codec, row["mb_up_per_round"],
                     accuracy if accuracy is not None else float("nan"))
    return {"available": True, "rows": rows}


def dc_pfl_modes(args, cache: RunCache, main_views: dict[str, RunView]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for mode in listed(args.dc_modes):
        covariance, _, transport = mode.partition("/")
        transport = transport or "fp32"
        default = covariance == "full" and transport == "fp32"
        view = main_views.get("dc_pfl") if default else None
        hyper = {} if default else {"covariance": covariance, "transport": transport}
        view = view or cache.run(config_for(args, "dc_pfl", hyper=hyper))
        if view is None:
            rows.append({"covariance": covariance, "transport": transport, "status": "failed"})
            continue
        traffic = view.traffic()
        rows.append({"covariance": covariance, "transport": transport, "status": "ok",
                     "kb_up_per_device_round": traffic["up_train_per_device"] / 1e3,
                     "mb_up_per_round": traffic["up_train"] / 1e6,
                     "mb_down_per_round": traffic["down_train"] / 1e6,
                     "accuracy": view.personalized()["mean"], "run": view.out.name})
        log.info("dc_pfl %s/%s: %.1f KB up per device-round, accuracy %.4f", covariance, transport,
                 rows[-1]["kb_up_per_device_round"], rows[-1]["accuracy"] or float("nan"))
    return rows


# -- outputs ----------------------------------------------------------------------------------
def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(args, document: dict[str, Any]) -> str:
    setting = Setting.parse(args.setting)
    lines = ["## Bytes per round (default models)", "",
             "Measured at the coordinator from report.json. 'up': TRAIN_RES per round (all participants); "
             "'down, published': the TRAIN broadcast the coordinator publishes once per round; 'down, delivered': "
             "that broadcast times the devices subscribed (what the broker sends out; every device receives it, "
             "selected or not); 'eval': EVALUATE + EVAL_RES per evaluation (a benchmark cost, every round here).", ""]
    for dataset, rows in document["per_round"].items():
        if not rows:
            continue
        first = rows[0]
        source = (f"short runs, {args.digits_rounds} rounds, Dir(0.5), C=1" if dataset == "digits"
                  else f"the runs of the next table, {setting.label}")
        lines += [f"**{dataset}**, {first['clients']} devices, model {first['model']} ({source})", "",
                  "| method | MB up / round | KB up / device-round | MB down / round, published | "
                  "MB down / round, delivered | MB eval / evaluation |", "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {NAMES[r['algorithm']]} | {fmt(r['mb_up_per_round'])} "
                         f"| {fmt(r['kb_up_per_device_round'], 1)} "
                         f"| {fmt(r['mb_down_per_round'])} | {fmt(r['mb_down_delivered_per_round'])} "
                         f"| {fmt(r['mb_eval_per_evaluation'])} |")
        lines.append("")

    target = document["to_target"]
    lines += [f"## MB until {100 * args.target:.0f}% personalized accuracy (DualFed Table 8 layout)", "",
              f"{args.dataset}, {setting.label}, {args.clients} devices, {args.local_epochs} local epoch(s), seed "
              f"{args.seed}, budget **{args.rounds} rounds**. MB = uploads + TRAIN broadcasts as delivered to every "
              "device, summed until the first round whose mean personalized accuracy over devices reaches the "
              "target (evaluation traffic left out).", "",
              "| method | rounds to target | MB up | MB down (delivered) | MB total | accuracy at the budget |",
              "|---|---|---|---|---|---|"]
    for r in target["rows"]:
        if r["reached"]:
            lines.append(f"| {NAMES[r['algorithm']]} | {r['round']} | {fmt(r['mb_up'], 1)} | {fmt(r['mb_down'], 1)} "
                         f"| {fmt(r['mb_total'], 1)} | {fmt(r['final_accuracy'], 4)} |")
        else:
            best = r["accuracy"]
            lines.append(f"| {NAMES[r['algorithm']]} | not reached in {r['rounds_run']} rounds (best {fmt(best, 4)}) "
                         f"| - | - | - | {fmt(r['final_accuracy'], 4)} |")
    check = target["check"]
    verdict = ("not evaluated" if not check["evaluated"] else
               "**met**" if check.get("met") else "**not met**" if check.get("met") is False else "incomplete")
    lines += ["", f"Target: {check['description']}: {verdict}"
              + (f" ({', '.join(f'{NAMES[a]}: {v}' for a, v in check.get('by_algorithm', {}).items())}; "
                 f"FedAvg reached it: {check.get('fedavg_reached')})" if "by_algorithm" in check else "")
              + ".", "", f"For scale: {DUALFED_TABLE8} Those count ResNet-sized models; ours are the small CNNs.", ""]

    if document.get("to_target_over_seeds"):
        lines += over_seeds_markdown(document["to_target_over_seeds"])

    codec = document["codecs"]
    if not codec["available"]:
        lines += ["## Upload codecs", "", codec["note"], ""]
    elif codec["rows"]:
        lines += ["## Upload codecs", "",
                  "`--upload-codec`: fp16, int8 (per-tensor scale), q4 and q2 (stochastic, per block of 256) and "
                  "topk (the largest 1%, with error feedback) encode the change from the broadcast; "
                  f"{args.dataset}, {setting.label}, {args.rounds} rounds.", "",
                  "| method | codec | MB up / round | KB up / device-round | vs fp32 | accuracy | accuracy vs fp32 |",
                  "|---|---|---|---|---|---|---|"]
        for r in codec["rows"]:
            if r["status"] != "ok":
                lines.append(f"| {NAMES[r['algorithm']]} | {r['codec']} | failed | | | | |")
                continue
            ratio = r.get("up_ratio")
            delta = r.get("accuracy_delta")
            lines.append(f"| {NAMES[r['algorithm']]} | {r['codec']} | {fmt(r['mb_up_per_round'])} "
                         f"| {fmt(r['kb_up_per_device_round'], 1)} | {'-' if ratio is None else f'{ratio:.2f}x'} "
                         f"| {fmt(r['accuracy'], 4)} | {'-' if delta is None else f'{100 * delta:+.2f} pts'} |")
        lines.append("")

    if document["dc_pfl"]:
        lines += ["## DC-PFL class statistics", "",
                  f"Uploads are class counts, means and covariances for every class (`--set covariance=...`, "
                  f"`--set transport=...`); {args.dataset}, {setting.label}, {args.rounds} rounds.", "",
                  "| covariance | transport | KB up / device-round | MB up / round | accuracy |",
                  "|---|---|---|---|---|"]
        for r in document["dc_pfl"]:
            if r["status"] != "ok":
                lines.append(f"| {r['covariance']} | {r['transport']} | failed | | |")
                continue
            lines.append(f"| {r['covariance']} | {r['transport']} | {fmt(r['kb_up_per_device_round'], 1)} "
                         f"| {fmt(r['mb_up_per_round'])} | {fmt(r['accuracy'], 4)} |")
        lines.append("")
    if document["failures"]:
        lines += ["Failed runs: " + "; ".join(f"{f['run']}: {f['error']}" for f in document["failures"]), ""]
    machine = document["machine"]
    lines += [f"Machine: {machine['cores']} cores, {machine['ram_gib']} GiB, {machine['cpu_model']}; "
              f"torch {machine['torch']}; load average at start {machine['load_average_at_start']}. "
              f"Command: `{machine['command']}`", ""]
    return "\n".join(lines)


def over_seeds_markdown(table: dict[str, Any]) -> list[str]:
    seeds = sorted({seed for row in table["rows"] for seed in row["seeds"]})
    lines = [f"## MB until {100 * table['target']:.0f}% over seeds {', '.join(map(str, seeds))}", "",
             f"From the per-round curves of `{table['source']}` (code {table['code']}), "
             f"{Setting.parse(table['setting']).label}, {table['clients']} devices, budget {table['rounds']} rounds; "
             "MB as above. A dash: not reached (best mean in brackets).", "",
             "| method | " + " | ".join(f"seed {s}: round, MB" for s in seeds) + " | MB to target, mean ± std |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for row in table["rows"]:
        cells = []
        for seed in seeds:
            cell = row["seeds"].get(seed)
            if cell is None:
                cells.append("not run")
            elif cell["round"] is None:
                cells.append(f"- ({100 * cell['best']:.2f})")
            else:
                cells.append(f"{cell['round']}, {cell['mb_total']:.2f}")
        summary, runs = row["mb_total"], len(row["seeds"])
        total = "-" if summary["mean"] is None else f"{summary['mean']:.2f} ± {summary['std']:.2f}"
        if 0 < row["reached_on"] < runs:
            total += f" ({row['reached_on']} of {runs} seeds)"
        lines.append(f"| {NAMES[row['algorithm']]} | " + " | ".join(cells) + f" | {total} |")
    return lines + [""]


def plot(path: Path, views: dict[str, RunView], target: float) -> None:
    """Mean personalized accuracy against cumulative training MB (uploads + delivered broadcasts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for algorithm, view in views.items():
        traffic = view.traffic()
        participants = sum(r["participants"] for r in view.report["rounds"]) or 1
        per_device = view.report["communication"]["by_kind"]["up"].get("train_res", 0) / participants
        xs, ys, total = [], [], 0.0
        for record in view.records:
            total += record["participants"] * per_device + traffic["down_train_delivered"]
            mean = (record["personalized_accuracy"] or {}).get("mean")
            if mean is not None:
                xs.append(total / 1e6)
                ys.append(mean)
        ax.plot(xs, ys, marker=".", **line_style(algorithm))
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set(xlabel="cumulative MB (uploads + delivered TRAIN broadcasts)", ylabel="mean personalized accuracy",
           xscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def grid_name(args) -> str:
    """communication-codecs-<dataset, or the data dir's name>-<partition>-<rounds>rounds."""
    data = Path(args.data_dir).name if args.data_dir else args.dataset
    return f"communication-codecs-{data}-{Setting.parse(args.setting).partition_name}-{args.rounds}rounds"


def run_grid(args) -> None:
    """Part 6 alone (--grid)."""
    algorithms, codec_names = listed(args.grid_algorithms), listed(args.grid_codecs)
    unknown = [a for a in algorithms if a not in ALGORITHMS] + [c for c in codec_names if c not in CODECS]
    if unknown:
        raise SystemExit(f"unknown algorithm(s) or codec(s): {', '.join(unknown)}")
    cache = RunCache(args.cache, broker=args.broker, fresh=args.fresh, cached_only=args.cached_only,
                     ledger=args.ledger)
    machine = machine_info()
    table = codec_grid.grid(cache, lambda algorithm, **extra: config_for(args, algorithm, **extra),
                            algorithms, codec_names)
    setting = (f"{args.dataset}{' from ' + args.data_dir if args.data_dir else ''}, {Setting.parse(args.setting).label}"
               f", {args.clients} devices, {args.rounds} rounds x {args.local_epochs} local epoch(s), seed {args.seed}")
    document = {"benchmark": "communication-codecs", "machine": machine, "setting": setting,
                "config": {"dataset": args.dataset, "data_dir": args.data_dir, "clients": args.clients,
                           "setting": args.setting, "seed": args.seed, "rounds": args.rounds,
                           "local_epochs": args.local_epochs, "cache": args.cache, "quick": args.quick},
                "grid": table, "failures": cache.failures}
    lines = codec_grid.markdown(document, setting)
    lines += [f"Machine: {machine['cores']} cores, {machine['ram_gib']} GiB, {machine['cpu_model']}; torch "
              f"{machine['torch']}; load average at start {machine['load_average_at_start']}. "
              f"Command: `{machine['command']}`", ""]
    if cache.failures:
        lines += ["Failed runs: " + "; ".join(f"{f['run']}: {f['error']}" for f in cache.failures), ""]
    name = args.name or grid_name(args)
    out = Path(args.out)
    write_outputs(out, name, document, "\n".join(lines))
    codec_grid.plot(out / f"{name}.png", document)
    log.info("wrote %s", out / f"{name}.md")
    if cache.failures:
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    if args.grid:
        run_grid(args)
        return
    algorithms = listed(args.algorithms)
    unknown = [a for a in algorithms + listed(args.codec_algorithms) if a not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {', '.join(unknown)}; known: {', '.join(ALGORITHMS)}")
    bad_codecs = [c for c in listed(args.codecs) if c not in CODECS]
    if bad_codecs:
        raise SystemExit(f"unknown codec(s) {', '.join(bad_codecs)}; known: {', '.join(CODECS)}")
    over_seeds = to_target_over_seeds(args, Path(args.over_seeds)) if args.over_seeds else None  # before training
    out = Path(args.out)
    cache = RunCache(args.cache, broker=args.broker, fresh=args.fresh, cached_only=args.cached_only,
                     ledger=args.ledger)
    machine = machine_info()

    main_views: dict[str, RunView] = {}
    for algorithm in algorithms:
        view = cache.run(config_for(args, algorithm))
        if view is not None:
            main_views[algorithm] = view
            log.info("%s %s: %.4f after %d rounds%s", algorithm, args.setting, view.personalized()["mean"] or 0,
                     view.rounds, " (cached)" if view.cached else f" ({view.seconds:.0f} s)")
    document = {
        "benchmark": "communication",
        "machine": machine,
        "config": {"dataset": args.dataset, "clients": args.clients, "setting": args.setting, "seed": args.seed,
                   "rounds": args.rounds, "local_epochs": args.local_epochs, "batch_size": args.batch_size,
                   "lr": args.lr, "target": args.target, "algorithms": algorithms, "workers": args.workers,
                   "broker": args.broker or "embedded amqtt", "cache": args.cache,
                   "ledger": args.ledger, "quick": args.quick},
        "per_round": per_round(args, cache, algorithms, main_views),
        "to_target": to_target(args, main_views),
        "codecs": codecs(args, cache, main_views),
        "dc_pfl": dc_pfl_modes(args, cache, main_views),
        "to_target_over_seeds": over_seeds,
        "reference": {"dualfed_table8": DUALFED_TABLE8},
    }
    document["failures"] = cache.failures
    write_outputs(out, "communication", document, markdown(args, document))
    if main_views:
        plot(out / "communication_curves.png", main_views, args.target)
    log.info("wrote %s", out / "communication.md")
    if cache.failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
