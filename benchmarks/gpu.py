"""The CUDA paths on a GPU machine: every algorithm end to end on `--device cuda`, with and without
AMP, and one device's local training speed and peak GPU memory beside the CPU's.

    python -m benchmarks.gpu --out benchmarks/results          # needs a CUDA device
    python -m benchmarks.gpu --quick --out /tmp/gpu             # FedAvg alone, batch 32 alone

1. `throughput`: FedAvg's local training of one device in this process (Fashion-MNIST, the
   default cnn28, device 0 of 20 IID: 2,624 images, 2 local epochs; a first fit warms the
   kernels up and is not timed): images per second and `torch.cuda.max_memory_allocated`, at
   batch 32 and 256, on the CPU (`--cpu-threads` threads), on CUDA in fp32 and with AMP.
2. `paths`: `python -m coordinator.cli simulate --device cuda [--amp]` for each of the twelve
   algorithms (Fashion-MNIST, 20 devices, C=0.2, 2 rounds x 1 local epoch, every device evaluated
   after the last, the embedded broker, one worker process), `--jobs` runs at a time: exit status,
   final mean personalized accuracy and wall time. A tensor left on the wrong device fails the
   run; an fp16 overflow that AMP's gradient scaler does not catch shows as a rejected
   (non-finite) update or a NaN accuracy.

Writes gpu.{json,md} to --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any
from collections.abc import Iterator


import torch

from ._machine import machine_info
from .runs import NAMES, setup_logging, write_outputs
from coordinator.algorithms import load as load_server
from coordinator.algorithms.base import ServerContext
from edge_sdk.algorithms.base import NoHyper, Task
from edge_sdk.algorithms.fedavg import FedAvgDevice
from edge_sdk.data import ClientData, load_client_data
from edge_sdk.models import default_model_for
from edge_sdk.settings import TrainSettings
from edge_sdk.training import mixed_precision

log = logging.getLogger("benchmarks")
ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="FedAvg alone, batch 32 alone (a smoke test)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--jobs", type=int, default=12, help="simulate runs side by side in part 2")
    parser.add_argument("--cpu-threads", type=int, default=1, help="torch threads of the CPU row of part 1")
    parser.add_argument("--algorithms", default=",".join(NAMES))
    args = parser.parse_args(argv)
    args.batch_sizes = (32,) if args.quick else (32, 256)
    if args.quick:
        args.algorithms = "fedavg"
    return args


# -- 1. one device's local training ----------------------------------------------------------------
def local_training(data: ClientData, device: str, amp: bool, batch_size: int) -> dict[str, Any]:
    """Images per second of a second FedAvg fit on `data` (the first warms up) and the peak GPU memory."""
    model = default_model_for(data.task)
    settings = TrainSettings(model=model, rounds=1, local_epochs=2, batch_size=batch_size, lr=0.05, seed=0)
    server = load_server("fedavg")(NoHyper(), ServerContext(model, data.task, seed=0, rounds=1, clients=20))
    trainer = FedAvgDevice(NoHyper(), settings, data, device, client_seed=1)
    task = Task(1, server.state, {"selected": ["dev000"]})
    with mixed_precision(amp):
        trainer.fit(task)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        result = trainer.fit(task)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    images = data.num_train * settings.local_epochs
    return {"device": device, "amp": amp, "batch_size": batch_size, "model": model, "images": images,
            "seconds": round(seconds, 3), "images_per_s": round(images / seconds),
            "loss": result.metrics["loss"],
            "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 1e6, 1) if device == "cuda" else None}


def throughput(cpu_threads: int, batch_sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    torch.set_num_threads(cpu_threads)
    data = load_client_data("fmnist", num_clients=20, index=0, partition="iid", seed=0)
    rows = []
    for batch_size in batch_sizes:
        for device, amp in (("cpu", False), ("cuda", False), ("cuda", True)):
            rows.append(local_training(data, device, amp, batch_size))
            log.info("local training %s", rows[-1])
    return rows


# -- 2. every algorithm end to end -----------------------------------------------------------------
def simulate(algorithm: str, amp: bool, folder: Path) -> dict[str, Any]:
    out = folder / f"{algorithm}-{'amp' if amp else 'fp32'}"
    command = [sys.executable, "-m", "coordinator.cli", "simulate", "--algorithm", algorithm, "--dataset", "fmnist",
               "--clients", "20", "--fraction", "0.2", "--rounds", "2", "--eval-every", "2", "--local-epochs", "1",
               "--workers", "1", "--device", "cuda",
               "--out", str(out), *(["--amp"] if amp else [])]
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    row: dict[str, Any] = {"algorithm": algorithm, "amp": amp, "exit": result.returncode,
                           "seconds": round(time.monotonic() - started, 1)}
    report_path = out / "report.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
        row["personalized_accuracy"] = report["final"]["personalized_accuracy"]["mean"]
        row["rejected_updates"] = sum(report.get("rejections", {}).values())
    if result.returncode:
        row["error"] = result.stderr.strip().splitlines()[-3:]
    log.info("simulate %s", row)
    return row


def paths(algorithms: list[str], jobs: int) -> Iterator[dict[str, Any]]:
    """The runs' rows as they end."""
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(jobs) as pool:
        runs = [pool.submit(simulate, algorithm, amp, Path(folder))
                for algorithm in algorithms for amp in (False, True)]
        for run in as_completed(runs):
            yield run.result()


# -- outputs -------------------------------------------------------------------------------------
def markdown(document: dict[str, Any]) -> str:
    machine = document["machine"]
    lines = ["## GPU paths (`gpu.py`)", "",
             f"{machine['gpu']}; {machine['cores']} cores, {machine['cpu_model']}; torch {machine['torch']}.", "",
             "### One device's local training (FedAvg, Fashion-MNIST, 2,624 images x 2 epochs)", "",
             "| device | AMP | batch | images/s | peak GPU memory (MB) | last-epoch loss |",
             "|---|---|---|---|---|---|"]
    for row in document["throughput"]:
        device = "CPU" if row["device"] == "cpu" else "CUDA"
        lines.append(f"| {device} | {'on' if row['amp'] else 'off'} | {row['batch_size']} | {row['images_per_s']:,} | "
                     f"{row['peak_gpu_mb'] if row['peak_gpu_mb'] is not None else '-'} | {row['loss']:.3f} |")
    lines += ["", "### Every algorithm end to end on `--device cuda` (20 devices, C=0.2, 2 rounds x 1 epoch)", "",
              "| algorithm | fp32: exit, accuracy, s | AMP: exit, accuracy, s |", "|---|---|---|"]
    by_run = {(row["algorithm"], row["amp"]): row for row in document["paths"]}
    for algorithm in document["algorithms"]:
        cells = []
        for amp in (False, True):
            row = by_run.get((algorithm, amp))
            if row is None:
                cells.append("not run")
                continue
            accuracy = row.get("personalized_accuracy")
            cells.append(f"{row['exit']}, {100 * accuracy:.2f}, {row['seconds']}" if accuracy is not None
                         else f"{row['exit']}, -, {row['seconds']}")
        lines.append(f"| {NAMES[algorithm]} | " + " | ".join(cells) + " |")
    lines += ["", f"Command: `{machine['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    if not torch.cuda.is_available():
        raise SystemExit("gpu.py needs a CUDA device; torch sees none")
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    document: dict[str, Any] = {"benchmark": "gpu", "machine": machine_info(), "algorithms": algorithms, "paths": []}
    document["throughput"] = throughput(args.cpu_threads, args.batch_sizes)
    write_outputs(Path(args.out), "gpu", document, markdown(document))
    for row in paths(algorithms, args.jobs):  # written after each run: a run cut short keeps what ended
        document["paths"].append(row)
        write_outputs(Path(args.out), "gpu", document, markdown(document))
    log.info("wrote %s", Path(args.out) / "gpu.md")
    failed = [row for row in document["paths"] if row["exit"] or row.get("personalized_accuracy") is None]
    if failed:
        sys.exit(f"{len(failed)} runs failed on CUDA: " + ", ".join(f"{r['algorithm']}{'+amp' if r['amp'] else ''}"
                                                                  for r in failed))


if __name__ == "__main__":
    main()
