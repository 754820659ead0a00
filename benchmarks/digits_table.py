"""All algorithms on digits (10 devices, Dirichlet 0.5, 15 rounds, seed 0) over MQTT: docs/ALGORITHMS.md's table.

Each row is one `edgepfl simulate` command, run as a separate process so wall time includes
everything a user waits for. Writes digits_table.json and digits_table.md to --out.

    python -m benchmarks.digits_table [--quick] [--broker mqtt://127.0.0.1:1883] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from coordinator.run.folder import RunFolder
from edge_sdk.algorithms import in_table_order, load

from .flags import add_output_flags, add_run_flags

def run(algorithm: str, rounds: int, broker: str | None, out: Path) -> dict:
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--algorithm", algorithm, "--dataset", "digits",
               "--clients", "10", "--partition", "dirichlet", "--alpha", "0.5", "--rounds", str(rounds),
               "--seed", "0", "--out", str(out / algorithm), "--quiet"]
    if broker:
        command += ["--broker", broker]
    started = time.monotonic()
    subprocess.run(command, check=True, capture_output=True, text=True)
    report = json.loads(RunFolder(out / algorithm).report.read_text())
    final = report["final"]
    return {
        "algorithm": algorithm,
        "mean": final["personalized_accuracy"]["mean"],
        "std": final["personalized_accuracy"]["std"],
        "min": final["personalized_accuracy"]["min"],
        "global": final["global_accuracy"],
        "mb_up": report["communication"]["bytes_up"] / 1e6,
        "mb_down": report["communication"]["bytes_down"] / 1e6,
        "up_per_round_per_device": report["communication"]["by_kind"]["up"].get("train_res", 0) / rounds / 10,
        "wall_seconds": time.monotonic() - started,
        "paper": load(algorithm).citation or "-",
    }


def markdown(rows: list[dict], rounds: int) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [
        f"digits, 10 devices, Dirichlet alpha 0.5, {rounds} rounds, seed 0, cnn8; wall time of the whole command",
        "",
        "| algorithm | personalized acc. mean | std | min | global acc. | MB up | MB down "
        "| KB up per device-round | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['algorithm']} | {fmt(r['mean'])} | {fmt(r['std'])} | {fmt(r['min'])} | {fmt(r['global'])} "
                     f"| {r['mb_up']:.2f} | {r['mb_down']:.2f} | {r['up_per_round_per_device'] / 1e3:.1f} "
                     f"| {r['wall_seconds']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_flags(parser, "2 rounds")
    parser.add_argument("--algorithms", default=",".join(cls.id for cls in in_table_order()))
    add_run_flags(parser, (), {})
    args = parser.parse_args()
    rounds = 2 if args.quick else 15
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [run(a, rounds, args.broker, out / "digits_table") for a in args.algorithms.split(",")]
    (out / "digits_table.json").write_text(json.dumps(rows, indent=2))
    (out / "digits_table.md").write_text(markdown(rows, rounds))
    print(markdown(rows, rounds))


if __name__ == "__main__":
    main()
