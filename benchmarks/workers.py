"""Per-device memory of a virtual device hosted by `edgepfl workers`.

    python -m benchmarks.workers [--quick] [--out DIR]

For each setting (cnn8 on digits; Fashion-MNIST with its default model, cnn28) and each device
count N: a Mosquitto, `edgepfl simulate --local-devices none` (the coordinator alone) and
`edgepfl workers --devices 0-(N-1) --workers 1` (every device in one worker process), one round
of one local epoch at fraction 0.1. Reported: what `workers` prints once its devices joined, the
RSS of the process after they joined minus before the first was started, over N; and, between
two N, the slope: what one more device costs (its partition, model, MQTT connection, thread),
the rest being paid once per process (the dataset pool every device's partition is cut from,
first-use allocations). Memory while training (activations, optimizer state) is not in it.
Writes workers.json and workers.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ._brokers import Mosquitto, machine_info

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "cnn8 (digits)": ["--dataset", "digits", "--model", "cnn8"],
    "cnn28 (fmnist)": ["--dataset", "fmnist"],
}
COUNTS = (20, 40)
QUICK_COUNTS = (4, 8)
RUN = ["--rounds", "1", "--local-epochs", "1", "--fraction", "0.1", "--seed", "0", "--workers", "1"]
FOOTPRINT = re.compile(r"(\d+) devices joined in (\d+) worker processes: RSS ([\d.]+) MiB per device .*; "
                       r"(\d+) MiB per process before any device")


def hosted(setting: list[str], devices: int, url: str, workdir: Path) -> dict:
    """Run a coordinator and `workers` hosting `devices` devices; the footprint line's figures."""
    federation = f"mem-{len(list(workdir.iterdir()))}"
    run = [*setting, *RUN, "--clients", str(devices), "--broker", url, "--federation", federation]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "coordinator.cli"]
    workers = subprocess.Popen([*cli, "workers", *run, "--devices", f"0-{devices - 1}", "--start-timeout", "300",
                                "--out", str(workdir / f"{federation}-workers")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    coordinator = subprocess.run([*cli, "simulate", *run, "--local-devices", "none", "--quiet",
                                  "--out", str(workdir / f"{federation}-run")],
                                 capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600)
    stdout, stderr = workers.communicate(timeout=600)
    if coordinator.returncode != 0 or workers.returncode != 0:
        raise RuntimeError(f"the run failed: {coordinator.stderr[-500:]} {stderr[-500:]}")
    match = FOOTPRINT.search(stdout)
    if match is None:
        raise RuntimeError(f"no footprint line in the output of workers: {stdout[-500:]}")
    joined, processes, per_device, baseline = match.groups()
    return {"devices": int(joined), "processes": int(processes), "rss_per_device_mib": float(per_device),
            "rss_added_mib": float(per_device) * int(joined), "rss_before_mib": int(baseline)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="digits only, 4 and 8 devices (a smoke test)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    settings = {"cnn8 (digits)": SETTINGS["cnn8 (digits)"]} if args.quick else SETTINGS
    counts = QUICK_COUNTS if args.quick else COUNTS
    rows = []
    with tempfile.TemporaryDirectory() as scratch, Mosquitto(Path(scratch) / "mosquitto") as broker:
        runs = Path(scratch) / "runs"
        runs.mkdir()
        for name, setting in settings.items():
            measured = [hosted(setting, n, broker.url, runs) for n in counts]
            first, last = measured[0], measured[-1]
            slope = (last["rss_added_mib"] - first["rss_added_mib"]) / (last["devices"] - first["devices"])
            rows.append({"setting": name, "runs": measured, "marginal_mib_per_device": slope,
                         "per_process_mib": first["rss_added_mib"] - slope * first["devices"]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "workers.json").write_text(json.dumps({"rows": rows, "counts": counts, "run": RUN,
                                                  "machine": machine_info()}, indent=2) + "\n")
    lines = ["| model (data) | devices | RSS per device, MiB | RSS added, MiB | one more device, MiB | "
             "once per process, MiB |", "|---|---|---|---|---|---|"]
    for row in rows:
        for run in row["runs"]:
            lines.append(f"| {row['setting']} | {run['devices']} | {run['rss_per_device_mib']:.1f} | "
                         f"{run['rss_added_mib']:.0f} | {row['marginal_mib_per_device']:.1f} | "
                         f"{row['per_process_mib']:.0f} |")
    table = "\n".join(lines)
    (out / "workers.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
