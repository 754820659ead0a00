"""A weak device on arm64, emulated on this x86-64 machine: install size, peak memory, ONNX parity.

Needs root and Debian's package tools (it installs what it needs):
1. `debootstrap` and `qemu-user-static` (apt-get); binfmt_misc mounted and `qemu-aarch64-static`
   registered with the F flag, so arm64 binaries run in a chroot without a copy of qemu inside;
2. a Debian bookworm arm64 root filesystem with python3 and venv, built once and cached under
   `--cache` (default ~/.cache/edgepfl-arm64; `.complete` marks a finished one);
3. the checkout copied into it and `pip install ".[lite]"` into a venv there (aarch64 wheels
   from the package index; the host's CA bundle and resolver are copied in); its site-packages
   size is measured;
4. on the host: a Mosquitto, a fresh cnn8 digits body and the 1,797 digits as the device's .npz
   (`footprint.write_body`, `write_images`); for each head, `edgepfl lite-client` runs in the
   chroot (it shares the host's loopback) against `footprint.ReleaseStandIn`, writing its
   personalized model and its peak RSS (VmHWM, under emulation: qemu's own memory counts too);
5. the same personalization on x86-64 (a host lite-client), and both personalized models run by
   the host's onnxruntime on the device's test split (`parity`: the whole pipeline); and the
   arm64 model run by arm64's onnxruntime in the chroot and by the host's on the same samples
   (`inference_parity`: the deployed model); predictions equal, probabilities within 1e-5;
6. with `--trainer`: `pip install ".[train]"` with torch pinned (`TRAIN_PINS`) into a second venv in
   the chroot, and one FedAvg round (2 local epochs) of `edgepfl client` (cnn8, the same digits) there and on
   x86-64, each against an `edgepfl coordinator` on the host: install size, peak RSS, accuracy.
Emulated times are not device times; the JSON records them only as how long the run took.
Writes arm64.json to --out (benchmarks/docs/devices.md tabulates it):

    sudo python -m benchmarks.arm64 --out benchmarks/results --trainer
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from ._brokers import mosquitto
from ._machine import machine_info
from .footprint import HEADS, MEASURED, ROOT, ReleaseStandIn, measured_peak_mb, write_body, write_images

SUITE, MIRROR = "bookworm", "http://deb.debian.org/debian"
PACKAGES = "python3,python3-venv,python3-pip,ca-certificates"
QEMU = Path("/usr/bin/qemu-aarch64-static")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
AARCH64_MAGIC = r"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00"
AARCH64_MASK = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff"
DEVICE_TIMEOUT = 1800.0
TRAIN_PINS = ("torch==2.9.1", "torchvision==0.24.1")
"""The trainer's torch on aarch64, pinned: the package index's cp311 aarch64 wheel of torch 2.9.1 is
the CPU build (99 MB); from 2.11 on the index's aarch64 wheels weigh 400-432 MB, which a
Raspberry Pi class board should not download."""
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"
"""chroot lives in /usr/sbin, which the chroot's own PATH does not search from the host."""


def run(command: list[str], timeout: float, **options: Any) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, timeout=timeout, **options)


def ensure_tools() -> None:
    """debootstrap and qemu-user-static installed, qemu registered for aarch64 binaries."""
    if shutil.which("debootstrap") is None or not QEMU.exists():
        run(["apt-get", "install", "-y", "-q", "debootstrap", "qemu-user-static"], 1800,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if not (BINFMT / "register").exists():
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], 60)
    if not (BINFMT / "qemu-aarch64").exists():
        (BINFMT / "register").write_text(f":qemu-aarch64:M::{AARCH64_MAGIC}:{AARCH64_MASK}:{QEMU}:F")


def ensure_rootfs(rootfs: Path) -> None:
    """A Debian arm64 root filesystem with python3 at `rootfs`, built once."""
    if (rootfs / ".complete").exists():
        return
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    run(["debootstrap", "--arch=arm64", f"--include={PACKAGES}", SUITE, str(rootfs), MIRROR], 5400)
    (rootfs / ".complete").write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def mounted(rootfs: Path) -> list[Path]:
    """/proc and /dev bound into the chroot; returns what to unmount. Not /sys: there onnxruntime's
    cpuinfo finds the host's x86-64 CPUs and the arm64 lite-client died of a segmentation fault
    (without it, cpuinfo warns that it cannot read the CPU list and goes on)."""
    points = []
    for name in ("proc", "dev"):
        point = rootfs / name
        if subprocess.run(["mountpoint", "-q", str(point)]).returncode != 0:
            run(["mount", "--bind", f"/{name}", str(point)], 60)
            points.append(point)
    return points


def chroot(rootfs: Path, command: list[str], timeout: float, **options: Any) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/root", "PIP_CERT": "/etc/ssl/certs/host-ca.crt",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return run([CHROOT, str(rootfs), *command], timeout, env=env, **options)


def copy_checkout(rootfs: Path) -> None:
    """The checkout's files (tracked and untracked, not ignored) in /opt/edgepfl-src of the chroot,
    and the host's resolver and CA bundle, so pip inside reaches the package index."""
    shutil.copy("/etc/resolv.conf", rootfs / "etc" / "resolv.conf")
    shutil.copy("/etc/ssl/certs/ca-certificates.crt", rootfs / "etc" / "ssl" / "certs" / "host-ca.crt")
    source = rootfs / "opt" / "edgepfl-src"
    shutil.rmtree(source, ignore_errors=True)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)


def install_extra(rootfs: Path, venv_name: str, extra: str, pins: tuple[str, ...] = ()) -> dict[str, Any]:
    """`pip install "/opt/edgepfl-src[EXTRA]" PINS` into /opt/VENV_NAME of the chroot: its
    site-packages MB (pip and setuptools left out) and the emulated install time."""
    started = time.perf_counter()
    if not (rootfs / "opt" / venv_name / "bin" / "python").exists():
        chroot(rootfs, ["python3", "-m", "venv", f"/opt/{venv_name}"], 600)
    chroot(rootfs, [f"/opt/{venv_name}/bin/pip", "install", "--quiet", f"/opt/edgepfl-src[{extra}]", *pins], 5400)
    site = next((rootfs / "opt" / venv_name / "lib").glob("python*/site-packages"))
    skipped = ("pip", "setuptools", "pkg_resources", "_distutils_hack")
    total = sum(f.stat().st_size for entry in site.iterdir() if entry.name.split("-")[0] not in skipped
                for f in ([entry] if entry.is_file() else entry.rglob("*")) if f.is_file())
    return {"site_packages_mb": round(total / 2**20, 1),
            "install_seconds_emulated": round(time.perf_counter() - started),
            "pins": list(pins)}


def personalize(url: str, body: Path, head: str, side: str, arguments: list[str], runner: list[str], log: Path,
                peak_file: Path, env: dict[str, str]) -> dict[str, Any]:
    """One lite-client run (`runner` + MEASURED + `arguments`) against a stand-in coordinator, in
    a federation of its own (`side`: arm64 or x86_64)."""
    federation = f"arm64-{side}-{head}"
    device = f"dev-{head}"
    stand_in = ReleaseStandIn(url, federation, body.read_bytes())
    reply: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: reply.update(stand_in.personalize(device, DEVICE_TIMEOUT).metrics),
                              daemon=True)
    thread.start()
    started = time.perf_counter()
    with open(log, "w") as out:
        status = subprocess.run([*runner, "-c", MEASURED, "lite-client", "--client-id", device, "--head", head,
                                 "--broker", url, "--federation", federation, *arguments], stdout=out,
                                stderr=subprocess.STDOUT, env=env, timeout=DEVICE_TIMEOUT, cwd="/").returncode
    thread.join(timeout=60)
    stand_in.close()
    peak = measured_peak_mb(peak_file)
    return {"exit_status": status, "peak_rss_mb": peak and round(peak, 1), "accuracy": reply.get("accuracy"),
            "seconds": round(time.perf_counter() - started, 1)}


def train_round(url: str, side: str, runner: list[str], data: tuple[Path, str], work: Path,
                env: dict[str, str]) -> dict[str, Any]:
    """One FedAvg round of 2 local epochs of one `edgepfl client` (`runner` + MEASURED, CPU, cnn8)
    on the digits .npz (`data`: its host path for the coordinator, its path as the client sees it)
    against an `edgepfl coordinator` on the host: exit status, the device's peak RSS, the round's
    wall time and the final accuracy the coordinator recorded. Both sides use the same client id:
    a device's seed, and so its batch order, derives from it. (With 1 epoch the round's accuracy
    hung on that order: 19% for the id 'trainer', 71% and 88% for two others; 94% with 2.)"""
    host_data, client_data = data
    federation, out = f"arm64-train-{side}", work / f"train-{side}"
    shutil.rmtree(out, ignore_errors=True)
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "coordinator", "--data", str(host_data), "--broker", url,
         "--federation", federation, "--clients", "1", "--model", "cnn8", "--algorithm", "fedavg", "--rounds", "1",
         "--local-epochs", "2", "--registration-timeout", str(DEVICE_TIMEOUT), "--round-timeout", str(DEVICE_TIMEOUT),
         "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    peak_file = work / f"train-{side}.peak"
    started = time.perf_counter()
    try:
        with open(work / f"train-{side}.log", "w") as log:
            status = subprocess.run([*runner, "-c", MEASURED, "client", "--client-id", "trainer", "--device",
                                     "cpu", "--data", client_data, "--broker", url, "--federation", federation,
                                     "--state-dir", f"{Path(client_data).parent}/trainer-{side}"],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, timeout=DEVICE_TIMEOUT,
                                    cwd="/").returncode
        coordinator.wait(timeout=120)
    finally:
        coordinator.kill()
        coordinator.wait()
    report = out / "report.json"
    final = json.loads(report.read_text())["final"] if report.exists() else None
    peak = measured_peak_mb(peak_file)
    return {"exit_status": status, "peak_rss_mb": peak and round(peak, 1),
            "accuracy": final and final["personalized_accuracy"], "seconds": round(time.perf_counter() - started, 1)}


def parity(arm_model: Path, x86_model: Path, samples: np.ndarray) -> dict[str, Any]:
    """Both personalized models on the host's onnxruntime: label agreement, largest probability gap.
    The two sides personalize independently, so this compares the whole pipeline (embedding, head
    fit, composition): an iteratively fitted head (mlp) carries every last-bit difference of its
    hundreds of steps into its weights."""
    import onnxruntime as ort

    outputs = [ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        ["label", "probabilities"], {"input": samples}) for path in (arm_model, x86_model)]
    (arm_labels, arm_probabilities), (x86_labels, x86_probabilities) = outputs
    return {"labels_equal": bool(np.array_equal(arm_labels, x86_labels)),
            "max_probability_difference": float(np.abs(arm_probabilities - x86_probabilities).max())}


INFER = """
import sys, numpy as np, onnxruntime as ort
model, samples, out = sys.argv[1:]
labels, probabilities = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(
    ["label", "probabilities"], {"input": np.load(samples)})
np.savez(out, labels=labels, probabilities=probabilities)
"""
"""Runs a model on samples with the chroot's own (aarch64) onnxruntime."""


def inference_parity(rootfs: Path, arm_model: Path, samples: np.ndarray, work: Path) -> dict[str, Any]:
    """The arm64 device's model run by arm64's onnxruntime (in the chroot) and by the host's, on
    the same samples: the deployed model computes the same on both architectures."""
    import onnxruntime as ort

    np.save(work / "samples.npy", samples)
    paths = [arm_model, work / "samples.npy", work / "arm-inference.npz"]
    chroot(rootfs, ["/opt/edgepfl-venv/bin/python", "-c", INFER, *("/" + str(p.relative_to(rootfs)) for p in paths)],
           600)
    arm = np.load(work / "arm-inference.npz")
    labels, probabilities = ort.InferenceSession(str(arm_model), providers=["CPUExecutionProvider"]).run(
        ["label", "probabilities"], {"input": samples})
    return {"labels_equal": bool(np.array_equal(arm["labels"], labels)),
            "max_probability_difference": float(np.abs(arm["probabilities"] - probabilities).max())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "edgepfl-arm64"))
    parser.add_argument("--heads", default=",".join(HEADS), help="weak-device heads to run ('' for none)")
    parser.add_argument("--trainer", action="store_true",
                        help=f"also `pip install .[train]` ({' '.join(TRAIN_PINS)}) in the chroot and run one "
                             "FedAvg round of a trainer device there and on x86-64")
    args = parser.parse_args()
    out, rootfs = Path(args.out), Path(args.cache) / "rootfs"
    out.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {"machine": machine_info(), "emulated": "qemu-aarch64-static (user mode)"}
    ensure_tools()
    started = time.perf_counter()
    ensure_rootfs(rootfs)
    document["rootfs_seconds"] = round(time.perf_counter() - started)
    unmount = mounted(rootfs)
    try:
        copy_checkout(rootfs)
        document["install"] = install_extra(rootfs, "edgepfl-venv", "lite")
        work = rootfs / "opt" / "edgepfl-work"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        body, data = work / "cnn8.onnx", work / "digits.npz"
        write_body("digits", "cnn8", body)
        write_images("digits", data, 2000, synthetic=False)
        document["runs"] = []
        with tempfile.TemporaryDirectory() as scratch, mosquitto(Path(scratch)) as broker:
            for head in filter(None, args.heads.split(",")):
                arm = personalize(broker.url, body, head, "arm64",
                                  ["--data", "/opt/edgepfl-work/digits.npz",
                                   "--state-dir", f"/opt/edgepfl-work/arm-{head}"],
                                  [CHROOT, str(rootfs), "/opt/edgepfl-venv/bin/python"], work / f"arm-{head}.log",
                                  work / f"arm-{head}.peak",
                                  {"PATH": "/usr/bin:/bin", "EDGEPFL_PEAK_FILE": f"/opt/edgepfl-work/arm-{head}.peak"})
                x86 = personalize(broker.url, body, head, "x86_64",
                                  ["--data", str(data), "--state-dir", str(work / f"x86-{head}")],
                                  [sys.executable], work / f"x86-{head}.log", work / f"x86-{head}.peak",
                                  {**os.environ, "PYTHONPATH": str(ROOT),
                                   "EDGEPFL_PEAK_FILE": str(work / f"x86-{head}.peak")})
                row = {"head": head, "arm64": arm, "x86_64": x86}
                models = [work / f"{side}-{head}" / f"personalized-dev-{head}.onnx" for side in ("arm", "x86")]
                if all(model.exists() for model in models):
                    from edge_sdk.data import load_folder_data

                    samples = load_folder_data(str(data)).test_x
                    arm_model, x86_model = models
                    row["parity"] = parity(arm_model, x86_model, samples)
                    row["inference_parity"] = inference_parity(rootfs, models[0], samples, work)
                document["runs"].append(row)
                (out / "arm64.json").write_text(json.dumps(document, indent=2))
            if args.trainer:
                document["train_install"] = install_extra(rootfs, "edgepfl-train-venv", "train", TRAIN_PINS)
                document["trainer"] = {
                    "arm64": train_round(broker.url, "arm64",
                                         [CHROOT, str(rootfs), "/opt/edgepfl-train-venv/bin/python"],
                                         (data, "/opt/edgepfl-work/digits.npz"), work,
                                         {"PATH": "/usr/bin:/bin",
                                          "EDGEPFL_PEAK_FILE": "/opt/edgepfl-work/train-arm64.peak"}),
                    "x86_64": train_round(broker.url, "x86_64", [sys.executable], (data, str(data)), work,
                                          {**os.environ, "PYTHONPATH": str(ROOT),
                                           "EDGEPFL_PEAK_FILE": str(work / "train-x86_64.peak")})}
    finally:
        for point in reversed(unmount):
            subprocess.run(["umount", str(point)], check=False)
    (out / "arm64.json").write_text(json.dumps(document, indent=2))
    sys.stdout.write(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
