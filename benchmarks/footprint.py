"""Device footprint: peak memory of a weak device and of a trainer, and the size of `edgepfl[lite]`.

1. Weak device (`edgepfl lite-client`, a real subprocess): it personalizes a released body (embeds
   its own data, fits each head, writes the personalized ONNX model) while this script plays the
   coordinator's side over a Mosquitto on a free port (WELCOME, the retained RELEASE, the
   ARTIFACT it FETCHes, EVALUATE, then STATUS finished). Bodies: a fresh cnn8 on the 1,797 8x8
   digits (all there are) and a fresh cnn28 on 2,000 Fashion-MNIST images (the device's own .npz,
   uint8 pixels), exported with `export.onnx_export.export_module`. Untrained weights cost the
   same memory as trained ones.
2. Trainer (`edgepfl client`, CPU): one FedAvg round on the same 2,000 Fashion-MNIST images as its
   own data (`--data`, one device), cnn28 and mobilenet_v3_small, against `edgepfl coordinator`.
3. Install size: `pip install ".[lite]"` from the checkout into a fresh venv; the size of its
   site-packages, and of each distribution in it.

Peak RSS is the device process's own VmHWM (the kernel's high-water mark of its resident
memory), which it writes as it exits (`MEASURED`). With `--limit-mb` each weak device runs in a
memory cgroup of that size
(cgroup v2 `memory.max`, else v1 `memory.limit_in_bytes`; root needed): a device that needs more
is killed, and the run fails. Where no memory cgroup can be created the limit is recorded as
"none" and only the peak is measured. Writes footprint.json and footprint.md to --out:

    python -m benchmarks.footprint --limit-mb 256 --out benchmarks/results

`--quick`: the Fashion-MNIST-shaped weak device only (cnn28, 2,000 seeded random images, `svm`
head), no trainer, no install: what the test suite runs under a 256 MB limit.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import venv
from pathlib import Path
from typing import Any, NamedTuple
from collections.abc import Iterator

import numpy as np

from ._brokers import mosquitto
from ._machine import machine_info
from edge_sdk.channel import Channel
from edge_sdk.protocol import COORDINATOR, Envelope, Kind, Topics
from edge_sdk.transport import MqttSettings, MqttTransport

ROOT = Path(__file__).resolve().parents[1]
FEDERATION = "footprint"
RUN = "run-footprint"
HEADS = ("svm", "lr", "mlp", "ncm")
LOCAL_IMAGES = 2000
CGROUPS = (("cgroup-v2", Path("/sys/fs/cgroup"), "", "memory.max", "memory.swap.max", "memory.peak"),
           ("cgroup-v1", Path("/sys/fs/cgroup/memory"), "memory", "memory.limit_in_bytes",
            "memory.memsw.limit_in_bytes", "memory.max_usage_in_bytes"))
"""Where a memory cgroup may be created: (kind, hierarchy, the controller's name in
/proc/self/cgroup, the limit's file, the memory+swap limit's file, the peak charge's file)."""
DEVICE_TIMEOUT = 300.0


# -- memory limit and peak -------------------------------------------------------------------
def _own_cgroup(hierarchy: Path, controller: str) -> Path | None:
    """This process's cgroup in `hierarchy` (v2: the line `0::/path`; v1: `N:memory:/path`)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers.split(",") == [controller] or (controller and controller in controllers.split(",")):
            return hierarchy / path.lstrip("/")
    return None


class MemoryCgroup(NamedTuple):
    """A memory cgroup made for one process: processes enter by writing their pid to `procs`;
    `peak` holds the most memory charged to it (its anonymous memory and the page cache it
    brought in first; shared libraries already cached elsewhere are not charged)."""

    kind: str
    procs: Path | None
    peak: Path | None


@contextlib.contextmanager
def memory_cgroup(limit_bytes: int | None) -> Iterator[MemoryCgroup]:
    """A fresh memory cgroup limited to `limit_bytes`, swap included, of kind "cgroup-v2" or
    "cgroup-v1"; kind "none" (no paths) when no limit is asked or no memory cgroup can be
    created (not root, or no memory controller)."""
    for kind, hierarchy, controller, limit_file, swap_file, peak_file in CGROUPS if limit_bytes is not None else ():
        parent = _own_cgroup(hierarchy, controller)
        if parent is None or not (parent / limit_file).exists() and not (parent / "memory.current").exists():
            continue
        group = parent / f"edgepfl-footprint-{os.getpid()}"
        try:
            group.mkdir()
            (group / limit_file).write_text(str(limit_bytes))
            if (group / swap_file).exists():
                (group / swap_file).write_text("0" if kind == "cgroup-v2" else str(limit_bytes))
        except OSError:
            with contextlib.suppress(OSError):
                group.rmdir()
            continue
        try:
            yield MemoryCgroup(kind, group / "cgroup.procs", group / peak_file)
        finally:
            with contextlib.suppress(OSError):
                group.rmdir()
        return
    yield MemoryCgroup("none", None, None)


MEASURED = """
import atexit, os, runpy, sys

def record_peak():
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    with open(os.environ["EDGEPFL_PEAK_FILE"], "w") as out:
        out.write(peak)

atexit.register(record_peak)
sys.argv = ["edgepfl", *sys.argv[1:]]
runpy.run_module("coordinator.cli", run_name="__main__")
"""
"""`edgepfl ARGS` that writes its process's VmHWM (peak RSS, kB) to $EDGEPFL_PEAK_FILE as it exits.
The kernel's high-water mark of this process alone: `ru_maxrss` from wait4 would also count
the pages the child shared with this (torch-laden) script between fork and exec."""


def measured_peak_mb(peak_file: Path) -> float | None:
    """The peak RSS in MB that MEASURED wrote to `peak_file` (kB), None when the process did not exit by itself."""
    return int(peak_file.read_text()) / 1024 if peak_file.exists() else None


def run_measured(arguments: list[str], log_path: Path, procs: Path | None, timeout: float) -> tuple[int, float | None]:
    """Run `edgepfl ARGUMENTS` (inside the cgroup whose `cgroup.procs` is `procs`, if any) with its
    output in `log_path`; returns (exit status, peak RSS in MB, None when it did not exit by
    itself). Killed after `timeout` seconds."""
    def enter_cgroup() -> None:
        if procs is not None:
            procs.write_text(str(os.getpid()))

    peak_file = log_path.with_suffix(".peak")
    env = {**os.environ, "EDGEPFL_PEAK_FILE": str(peak_file),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-c", MEASURED, *arguments], cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env=env, preexec_fn=enter_cgroup)
    try:
        status = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        status = process.wait()
    peak = measured_peak_mb(peak_file)
    return status, peak


# -- the coordinator's side of a release, played by hand -------------------------------------
class ReleaseStandIn:
    """Welcomes one device, releases `body`, answers its FETCH, asks it to evaluate, ends the run."""

    def __init__(self, url: str, federation: str, body: bytes):
        self.topics = Topics(federation)
        self.transport = MqttTransport(f"{federation}.{COORDINATOR}", MqttSettings(url=url))
        self.transport.connect()
        self.transport.subscribe(self.topics.all_up())
        self.channel = Channel(self.transport, self.topics)
        self.body, self.sha = body, hashlib.sha256(body).hexdigest()

    def send(self, kind: Kind, to: str | None = None, *, retain: bool = False, **fields: Any) -> None:
        topic = self.topics.broadcast(kind) if to is None else self.topics.down(to, kind)
        self.channel.send(topic, Envelope(kind, COORDINATOR, run_id=RUN, **fields), retain=retain)

    def expect(self, kind: Kind, sender: str, deadline: float) -> Envelope:
        while time.monotonic() < deadline:
            received = self.channel.receive(timeout=1.0)
            if received is not None and (received.envelope.kind, received.envelope.sender) == (kind, sender):
                return received.envelope
        raise TimeoutError(f"no {kind.value} from {sender}")

    def personalize(self, device: str, timeout: float) -> Envelope:
        """The device's EVAL_RES, after the whole release protocol."""
        deadline = time.monotonic() + timeout
        self.expect(Kind.HELLO, device, deadline)
        self.send(Kind.WELCOME, device, config={"settings": {}, "hyper": {}})
        self.send(Kind.RELEASE, retain=True, round=1,
                  config={"sha256": self.sha, "size": len(self.body), "format": "onnx", "metadata": {}})
        self.expect(Kind.FETCH, device, deadline)
        self.send(Kind.ARTIFACT, device, round=1, config={"sha256": self.sha},
                  groups={"artifact": {"onnx": np.frombuffer(self.body, dtype=np.uint8)}})
        self.send(Kind.EVALUATE, round=1, config={"selected": [device]})
        reply = self.expect(Kind.EVAL_RES, device, deadline)
        self.send(Kind.STATUS, retain=True, round=1, config={"state": "finished"})
        return reply

    def close(self) -> None:
        self.transport.close()


# -- bodies and data -------------------------------------------------------------------------
def write_body(dataset: str, model: str, path: Path) -> None:
    """A freshly initialized `model` body for `dataset`'s task, exported as a representation."""
    import torch

    from edge_sdk.data import BUILTIN_TASKS
    from edge_sdk.models import build_body
    from export.onnx_export import export_module

    task = BUILTIN_TASKS[dataset]
    torch.manual_seed(0)
    body, feature_dim = build_body(model, task)
    metadata = {"input_shape": list(task.input_shape), "feature_dim": feature_dim,
                "normalization": {"mean": list(task.mean), "std": list(task.std)},
                "class_names": list(task.class_names), "dataset": dataset, "model": model}
    export_module(body.eval(), task.input_shape, path, metadata=metadata)


def write_images(dataset: str, path: Path, count: int, synthetic: bool) -> int:
    """`count` images of `dataset` (the first ones; random ones with `synthetic`) as a device's
    own .npz (uint8 pixels [N, H, W], labels); returns how many were written."""
    if synthetic:
        rng = np.random.default_rng(0)
        x, y = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8), np.arange(count) % 10
    else:
        from edge_sdk.data import load_dataset

        pool = load_dataset(dataset)
        count = min(count, len(pool.y))
        pixels = pool.task.denormalize(pool.x[:count])[:, 0]
        x, y = np.round(pixels * 255).astype(np.uint8), pool.y[:count]
    np.savez(path, x=x, y=y)
    return count


# -- measurements -----------------------------------------------------------------------------
def weak_device(url: str, body: Path, data: Path, head: str, work: Path, limit_mb: int | None) -> dict[str, Any]:
    """One `edgepfl lite-client` personalization (a federation of its own, so nothing retained
    from another run reaches it): exit status, peak RSS, the reply's accuracy."""
    device = f"lite-{body.stem}-{head}"
    federation = f"{FEDERATION}-{body.stem}-{head}"
    stand_in = ReleaseStandIn(url, federation, body.read_bytes())
    arguments = ["lite-client", "--client-id", device, "--data", str(data),
               "--head", head, "--broker", url, "--federation", federation, "--state-dir", str(work / device)]
    result: dict[str, Any] = {}

    def coordinate() -> None:
        try:
            result["accuracy"] = stand_in.personalize(device, DEVICE_TIMEOUT).metrics["accuracy"]
        except TimeoutError as exc:
            result["error"] = str(exc)

    thread = threading.Thread(target=coordinate, daemon=True)
    thread.start()
    log = work / f"{device}.log"
    with memory_cgroup(limit_mb * 2**20 if limit_mb else None) as cgroup:
        try:
            status, peak = run_measured(arguments, log, cgroup.procs, DEVICE_TIMEOUT)
        finally:
            thread.join(timeout=DEVICE_TIMEOUT)
            stand_in.close()
        charged = int(cgroup.peak.read_text()) / 2**20 if cgroup.peak is not None and cgroup.peak.exists() else None
    model = work / device / f"personalized-{device}.onnx"
    return {"head": head, "limit": cgroup.kind, "exit_status": status, "peak_rss_mb": peak and round(peak, 1),
            "cgroup_peak_mb": charged and round(charged, 1), "accuracy": result.get("accuracy"),
            "model_bytes": model.stat().st_size if model.exists() else None,
            "log_tail": None if status == 0 else log.read_text()[-2000:]}


def trainer(url: str, data: Path, model: str, work: Path) -> dict[str, Any]:
    """One FedAvg round of `edgepfl client` (CPU) on `data`; its peak RSS and the round's time."""
    common = ["--data", str(data), "--broker", url, "--federation", f"{FEDERATION}-{model}"]
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "coordinator", *common, "--clients", "1", "--model", model,
         "--algorithm", "fedavg", "--rounds", "1", "--local-epochs", "1", "--registration-timeout", "120",
         "--out", str(work / f"run-{model}")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    started = time.perf_counter()
    try:
        status, peak = run_measured(["client", "--client-id", "trainer", "--device", "cpu",
                                     "--state-dir", str(work / "trainer"), *common], work / f"trainer-{model}.log",
                                    None, 1800.0)
        with contextlib.suppress(subprocess.TimeoutExpired):
            coordinator.wait(timeout=120)
    finally:
        coordinator.kill()
        coordinator.wait()
    return {"model": model, "exit_status": status, "peak_rss_mb": peak and round(peak, 1),
            "seconds": round(time.perf_counter() - started, 1)}


def install_size(work: Path) -> dict[str, Any]:
    """`pip install ".[lite]"` from the checkout into a fresh venv: site-packages MB, per distribution."""
    target = work / "venv-lite"
    venv.create(target, with_pip=True)
    python = target / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"{ROOT}[lite]"], check=True, timeout=1800)
    site = next((target / "lib").glob("python*/site-packages"))
    sizes: dict[str, float] = {}
    for entry in site.iterdir():
        name = entry.name.split("-")[0].split(".")[0].lower()
        if entry.name in ("pip", "_distutils_hack") or name in ("pip", "setuptools", "__pycache__"):
            continue
        if entry.is_dir():
            size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        else:
            size = entry.stat().st_size
        sizes[name] = sizes.get(name, 0.0) + size / 2**20
    return {"total_mb": round(sum(sizes.values()), 1),
            "by_package_mb": {k: round(v, 1) for k, v in sorted(sizes.items(), key=lambda kv: -kv[1]) if v >= 0.1}}


def markdown(document: dict[str, Any]) -> str:
    lines = [f"Weak device (`edgepfl lite-client`), memory limit {document['limit_mb'] or 'none'} MB:", "",
             "| body | local images | head | peak RSS (MB) | cgroup peak (MB) | limit | exit | accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for body in document["weak_device"]:
        for row in body["runs"]:
            accuracy = "-" if row["accuracy"] is None else f"{row['accuracy']:.3f}"
            lines.append(f"| {body['model']} ({body['dataset']}) | {body['images']:,} | {row['head']} | "
                         f"{row['peak_rss_mb']} | {row['cgroup_peak_mb'] or '-'} | {row['limit']} | "
                         f"{row['exit_status']} | {accuracy} |")
    if document.get("trainer"):
        lines += ["", "Trainer (`edgepfl client --device cpu`, one FedAvg round, 2,000 Fashion-MNIST images):", "",
                  "| model | peak RSS (MB) | exit | seconds |", "|---|---|---|---|"]
        lines += [f"| {row['model']} | {row['peak_rss_mb']} | {row['exit_status']} | {row['seconds']} |"
                  for row in document["trainer"]]
    if document.get("install"):
        install = document["install"]
        parts = ", ".join(f"{k} {v}" for k, v in install["by_package_mb"].items())
        lines += ["", f"`pip install \".[lite]\"` site-packages: {install['total_mb']} MB ({parts})"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit-mb", type=int, help="run each weak device in a memory cgroup of this size")
    parser.add_argument("--quick", action="store_true", help="the Fashion-MNIST-shaped weak device only, svm head")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bodies = [("fmnist", "cnn28")] if args.quick else [("digits", "cnn8"), ("fmnist", "cnn28")]
    heads = ("svm",) if args.quick else HEADS
    document: dict[str, Any] = {"machine": machine_info(), "weak_device": []}
    with tempfile.TemporaryDirectory() as scratch, mosquitto(Path(scratch)) as broker:
        work = Path(scratch)
        document["limit_mb"] = args.limit_mb
        for dataset, model in bodies:
            body, data = work / f"{model}.onnx", work / f"{dataset}.npz"
            write_body(dataset, model, body)
            images = write_images(dataset, data, LOCAL_IMAGES, synthetic=args.quick)
            runs = [weak_device(broker.url, body, data, head, work, args.limit_mb) for head in heads]
            document["weak_device"].append({"dataset": dataset, "model": model, "images": images,
                                            "synthetic": args.quick, "runs": runs})
        if not args.quick:
            data = work / "fmnist.npz"
            document["trainer"] = [trainer(broker.url, data, model, work) for model in ("cnn28", "mobilenet_v3_small")]
            document["install"] = install_size(work)
    (out / "footprint.json").write_text(json.dumps(document, indent=2))
    (out / "footprint.md").write_text(markdown(document))
    sys.stdout.write(markdown(document))


if __name__ == "__main__":
    main()
