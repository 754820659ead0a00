"""Buffered asynchronous aggregation against synchronous rounds, on a fleet that is half online and 10x apart in speed.

    python -m benchmarks.async --out benchmarks/results
    python -m benchmarks.async --quick --out /tmp/async      # digits, 12 devices, 2 rounds, a smoke test

For each algorithm (FedAvg and FedRep by default), two runs of `edgepfl simulate` with the same
devices, data, seed and fleet: each device online half of the time (`--availability
random:0.5:PERIOD`, seeded per device, the same schedule in both runs) and 1 to 10 times slower
than the machine (`--speed-spread 10`, the same factor in both runs). The synchronous run plays
`--rounds` rounds, each waiting for every online device it selected (all of them); the
asynchronous run (`--mode async`) folds every `--buffer` arrivals into a new state with at most
`--concurrency` devices training, for as many steps as give the same number of trainings
(rounds x the devices online on average / buffer). Both evaluate about as often per training.

Measured, from the first round's start (registration left out), on the coordinator's clock:
the personalized accuracy after each evaluation, the time and the MB (up, plus down as the broker
delivered it: what crosses the devices' links) until it first reached each target, and the
async run's staleness histogram. Writes async.json and async.md to --out.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from ._brokers import broker, machine_info
from .runs import bench_config, setup_logging, write_outputs

log = logging.getLogger("benchmarks")

FULL = {"dataset": "fmnist", "clients": 100, "alpha": 0.1, "rounds": 15, "period": 60.0, "buffer": 10,
        "concurrency": 25, "targets": (0.6, 0.7, 0.8, 0.9)}
QUICK = {"dataset": "digits", "clients": 12, "alpha": 0.5, "rounds": 2, "period": 8.0, "buffer": 3,
         "concurrency": 4, "targets": (0.5, 0.8)}
ONLINE_SHARE = 0.5
SPEED_SPREAD = 10.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="digits, 12 devices, 2 rounds (a smoke test)")
    parser.add_argument("--out", default="benchmarks/results", help="folder of the tables")
    parser.add_argument("--algorithms", default="fedavg,fedrep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--broker", default="mosquitto", help="mosquitto (started here), amqtt or mqtt://host:port")
    parser.add_argument("--workers", type=int, default=2)
    return parser.parse_args(argv)


def run_one(plan: dict[str, Any], algorithm: str, mode: str, args: argparse.Namespace, url: str,
            protocol: str, out: Path) -> dict[str, Any]:
    """One simulated run; its evaluations on the coordinator's clock from the first round's start."""
    from coordinator.events import DevicesRegistered, RoundEnded
    from coordinator.hosting.simulate import run_simulation

    trainings = plan["rounds"] * plan["clients"] * ONLINE_SHARE
    steps = plan["rounds"] if mode == "sync" else max(1, round(trainings / plan["buffer"]))
    every = 1 if mode == "sync" else max(1, round(plan["clients"] * ONLINE_SHARE / plan["buffer"]))
    fields: dict[str, Any] = dict(
        algorithm=algorithm, dataset=plan["dataset"], partition="dirichlet", alpha=plan["alpha"],
        clients=plan["clients"], rounds=steps, local_epochs=1, seed=args.seed, eval_every=every,
        workers=args.workers, broker=url, mqtt_protocol=protocol, out=str(out),
        availability=f"random:{ONLINE_SHARE}:{plan['period']}", speed_spread=SPEED_SPREAD, mode=mode,
        round_timeout=600.0, quorum_grace=600.0)
    if mode == "async":
        fields.update(buffer=plan["buffer"], concurrency=plan["concurrency"])
    started: list[float] = []
    points: list[dict[str, Any]] = []

    def on_event(event: Any) -> None:
        if isinstance(event, DevicesRegistered):
            started.append(time.monotonic())
        elif isinstance(event, RoundEnded):
            record = event.record
            points.append({"round": record["round"], "seconds": time.monotonic() - started[0],
                           "mb": (record["bytes_up"] + record["bytes_down_delivered"]) / 1e6,
                           "accuracy": (record["personalized_accuracy"] or {}).get("mean")})

    log.info("%s %s: %d %s", algorithm, mode, steps, "rounds" if mode == "sync" else "steps")
    report = run_simulation(bench_config(**fields), on_event=on_event)
    total = 0.0
    for point in points:
        total += point["mb"]
        point["mb"] = total
    evaluated = [p for p in points if p["accuracy"] is not None]
    return {"algorithm": algorithm, "mode": mode, "steps": steps, "eval_every": every, "curve": evaluated,
            "final_accuracy": report["final"]["personalized_accuracy"]["mean"],
            "seconds": points[-1]["seconds"] if points else None, "mb": total,
            "to_target": {str(t): first_reaching(evaluated, t) for t in plan["targets"]},
            "asynchronous": report.get("asynchronous"),
            "participation": [r["participants"] for r in report["rounds"]]}


def first_reaching(curve: list[dict[str, Any]], target: float) -> dict[str, float] | None:
    """Seconds and MB at the first evaluation whose mean accuracy reached `target` (None: never)."""
    for point in curve:
        if point["accuracy"] >= target:
            return {"seconds": point["seconds"], "mb": point["mb"]}
    return None


def markdown(document: dict[str, Any]) -> str:
    plan, runs = document["plan"], document["runs"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    lines = ["## Asynchronous (FedBuff) against synchronous rounds\n",
             f"{plan['dataset']}, Dirichlet {plan['alpha']}, {plan['clients']} devices, each online "
             f"{ONLINE_SHARE:.0%} of the time (spells of {plan['period']:g} s on and off together on average) and 1 to "
             f"{SPEED_SPREAD:g}x slower than the machine (log-uniform), the same devices in both modes; seed "
             f"{document['seed']}. Sync: {plan['rounds']} rounds, each waiting for every online device; async: buffer "
             f"{plan['buffer']}, concurrency {plan['concurrency']}, max staleness 10, staleness weight (1 + t)^-0.5, "
             "as many steps as give the same number of trainings. Seconds from the first round's start; MB up plus "
             "down as delivered to the devices.\n"]
    header = "| algorithm | mode | final accuracy (%) | seconds | MB | " + " | ".join(
        f"to {t:.0%}: s / MB" for t in plan["targets"]) + " |"
    lines += [header, "|" + "---|" * (5 + len(plan["targets"]))]
    for run in runs:
        reached = [run["to_target"][str(t)] for t in plan["targets"]]
        cells = [fmt(r["seconds"], ".0f") + " / " + fmt(r["mb"], ".0f") if r else "not reached" for r in reached]
        lines.append(f"| {run['algorithm']} | {run['mode']} | {fmt(100 * run['final_accuracy'], '.2f')} | "
                     f"{fmt(run['seconds'], '.0f')} | {fmt(run['mb'], '.0f')} | " + " | ".join(cells) + " |")
    lines.append("\n**Staleness of the updates folded (async)**\n")
    lines += ["| algorithm | steps | arrivals | trainings asked | refused too stale | staleness: count |",
              "|---|---|---|---|---|---|"]
    for run in runs:
        summary = run["asynchronous"]
        if summary:
            histogram = ", ".join(f"{k}: {v}" for k, v in summary["staleness"].items())
            lines.append(f"| {run['algorithm']} | {summary['steps']} | {summary['arrivals']} | "
                         f"{summary['dispatched']} | {summary['too_stale']} | {histogram} |")
    machine = document["machine"]
    lines.append(f"\nMachine: {machine['cores']} cores, {machine['ram_gib']} GiB, {machine['cpu_model']}; torch "
                 f"{machine['torch']}; load average at start {machine['load_average_at_start']}; broker "
                 f"{document['broker']}. Command: `{machine['command']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    plan: dict[str, Any] = QUICK if args.quick else FULL
    machine = machine_info()  # the load before the runs
    runs = []
    with tempfile.TemporaryDirectory(prefix="edgepfl-async-") as work, broker(args.broker, Path(work)) as running:
        for algorithm in args.algorithms.split(","):
            for mode in ("sync", "async"):
                out = Path(work) / f"{algorithm}-{mode}"
                runs.append(run_one(plan, algorithm, mode, args, running.url, running.protocol, out))
                log.info("%s %s: accuracy %.4f after %.0f s", algorithm, mode, runs[-1]["final_accuracy"] or 0,
                         runs[-1]["seconds"] or 0)
    document = {"plan": {**plan, "targets": list(plan["targets"])}, "seed": args.seed, "broker": args.broker,
                "runs": runs, "machine": machine}
    write_outputs(Path(args.out), "async", document, markdown(document))
    log.info("wrote %s", Path(args.out) / "async.md")


if __name__ == "__main__":
    main()
