"""The same FedAvg run with the coordinator aggregating alone and with 2 shard aggregators.

digits, 50 devices, 5 rounds, float64 aggregation (`--aggregation-dtype float64`), over one
Mosquitto started here (or `--broker`), through `edgepfl simulate`'s path (`run_simulation`):
the devices in its worker processes and, with shards, its 2 shard aggregator processes beside
them (started with them, before the coordinator, which waits for them to register). Records
each run's wall time (the report's `wall_seconds`: registration to report; the registration
alone, until every device and aggregator registered; the sum of the rounds' seconds,
evaluation included), the rounds' participation and lost shards, the aggregators that
registered, and compares the two final global states (bit for bit, and the largest absolute
difference). `--repeats N` plays the pair N times, alternating, and the ratios are those of the
medians (the wall times of a shared machine vary from run to run).
Writes shards.json and shards.md to --out.

    python -m benchmarks.shards [--quick] [--repeats N] [--broker mqtt://127.0.0.1:1883] [--out DIR]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from ._brokers import broker, machine_info
from .flags import add_output_flags, add_run_flags
from .runs import setup_logging, write_outputs
from coordinator.config.run_config import RunConfig
from coordinator.events import DevicesRegistered
from coordinator.hosting.simulate import run_simulation
from coordinator.run import checkpoint
from coordinator.run.folder import RunFolder

log = logging.getLogger(__name__)


def one_run(url: str, workdir: Path, shards: int, clients: int, rounds: int, workers: int) -> dict[str, Any]:
    federation = f"bench-shards{shards}-{uuid.uuid4().hex[:6]}"
    out = workdir / f"shards{shards}"
    config = RunConfig.of(algorithm="fedavg", dataset="digits", clients=clients, rounds=rounds, seed=0,
                          aggregation_dtype="float64", shards=shards, broker=url, federation=federation,
                          workers=workers, out=str(out), round_timeout=300)
    registered: list[float] = []
    report = run_simulation(config, on_event=lambda e: registered.append(e.seconds)
                            if isinstance(e, DevicesRegistered) else None)
    saved = checkpoint.load(RunFolder(out).checkpoint)
    if saved is None:
        raise RuntimeError(f"the run in {out} left no checkpoint")
    state = saved.state
    rounds_ = report["rounds"]
    log.info("shards %d: %.1f s, participants %s", shards, report["wall_seconds"], [r["participants"] for r in rounds_])
    return {"shards": shards, "wall_seconds": report["wall_seconds"], "registration_seconds": registered[0],
            "round_seconds": sum(r["seconds"] for r in rounds_),
            "participants": [r["participants"] for r in rounds_],
            "lost_shards": [r.get("lost_shards", []) for r in rounds_],
            "rejections": report["rejections"],
            "personalized_accuracy": report["final"]["personalized_accuracy"]["mean"],
            "bytes_up": report["communication"]["bytes_up"], "state": state,
            "aggregators": sorted(e["device"] for e in report["event_log"]
                                  if e.get("event") == "registered" and e["device"].startswith("aggregator-"))}


def compare(first: dict, second: dict) -> dict[str, Any]:
    """Whether two states hold the same arrays bit for bit, and their largest absolute difference."""
    identical, largest = True, 0.0
    for group, arrays in first.items():
        for key, value in arrays.items():
            other = second[group][key]
            identical &= value.dtype == other.dtype and np.array_equal(value, other)
            largest = max(largest, float(np.max(np.abs(value.astype(np.float64) - other.astype(np.float64)),
                                                initial=0.0)))
    return {"bit_identical": bool(identical), "max_abs_difference": largest}


def markdown(document: dict[str, Any]) -> str:
    runs, parameters = document["runs"], document["parameters"]
    lines = [f"# Single coordinator vs 2 shard aggregators: FedAvg on digits, {parameters['clients']} devices, "
             f"{parameters['rounds']} rounds, float64 aggregation", "",
             "| aggregation | wall s (registration to report) | registration s | rounds s | participants per round | "
             "lost shards | personalized accuracy |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        label = "coordinator alone" if run["shards"] == 0 else f"{run['shards']} shard aggregators (processes)"
        lines.append(f"| {label} | {run['wall_seconds']:.1f} | {run['registration_seconds']:.1f} | "
                     f"{run['round_seconds']:.1f} | {run['participants']} | "
                     f"{sum(len(x) for x in run['lost_shards'])} | {run['personalized_accuracy']:.4f} |")
    same = document["comparison"]
    lines += ["", f"Final global state, every pair: bit-identical {same['bit_identical']}, largest absolute "
                  f"difference {same['max_abs_difference']:.3g}. Medians over {parameters['repeats']} pair(s): "
                  f"wall-time ratio (2 shards / alone) {document['wall_time_ratio']:.2f}, rounds-time ratio "
                  f"{document['round_time_ratio']:.2f}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "6 devices, 2 rounds")
    parser.add_argument("--broker", default="mosquitto", help="mosquitto (started here) or mqtt://host:port")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternating (default 1)")
    add_run_flags(parser, ("workers",), {"workers": 2}, broker=False)
    args = parser.parse_args()
    setup_logging()
    clients, rounds = (6, 2) if args.quick else (50, 5)
    runs = []
    with tempfile.TemporaryDirectory() as scratch, broker(args.broker, Path(scratch)) as running:
        for repeat in range(args.repeats):
            for shards in (0, 2):
                runs.append(one_run(running.url, Path(scratch) / f"pair{repeat}", shards, clients, rounds,
                                    args.workers))
    pairs = [compare(alone.pop("state"), sharded.pop("state"))
             for alone, sharded in zip(runs[::2], runs[1::2], strict=True)]
    comparison = {"bit_identical": all(p["bit_identical"] for p in pairs),
                  "max_abs_difference": max(p["max_abs_difference"] for p in pairs)}

    def median(shards: int, key: str) -> float:
        return statistics.median(run[key] for run in runs if run["shards"] == shards)

    document = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "machine": machine_info(),
                "parameters": {"algorithm": "fedavg", "dataset": "digits", "clients": clients, "rounds": rounds,
                               "aggregation_dtype": "float64", "workers": args.workers, "broker": args.broker,
                               "repeats": args.repeats},
                "runs": runs, "comparison": comparison,
                "wall_time_ratio": median(2, "wall_seconds") / median(0, "wall_seconds"),
                "round_time_ratio": median(2, "round_seconds") / median(0, "round_seconds")}
    write_outputs(Path(args.out), "shards" if not args.quick else "shards-quick", document, markdown(document))
    print(markdown(document))


if __name__ == "__main__":
    main()
