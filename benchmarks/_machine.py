"""What every benchmark result records about where and how it ran; no hostname.

Not a benchmark itself: a module of the benchmarks package the scripts share. The CPU line
names the family and the vector extensions, because the same model name ("AMD EPYC") has
covered machines 2-3x apart in speed, and int8 kernels behave differently with and without
VNNI (benchmarks/docs/devices.md, Edge path).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

VECTOR_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "asimd", "sve")
"""The /proc/cpuinfo flags that change how fast (and, for int8, how exactly) the kernels run."""


def cpu_description() -> str | None:
    """E.g. `AMD EPYC (family 26, model 2; avx2 avx512f avx512_vnni avx_vnni avx512_bf16)`."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or None
    name = fields.get("model name") or fields.get("Model") or platform.processor() or "unknown CPU"
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    family = f"family {fields['cpu family']}, model {fields.get('model', '?')}; " if "cpu family" in fields else ""
    return f"{name} ({family}{' '.join(f for f in VECTOR_FLAGS if f in flags) or 'no listed vector flags'})"


def ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def code_version() -> str | None:
    """The checkout's commit, with `+changes` when tracked files differ from it (None outside git)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("+changes" if dirty else "")


def gpu_name() -> str | None:
    """The first CUDA device, when torch is already imported and sees one."""
    torch = sys.modules.get("torch")
    try:
        return torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001  (a broken driver is recorded as no GPU)
        return None


def command_line() -> str:
    """How this process was started, as one would type it again: `python -m benchmarks.NAME ...` for
    a script run as a module of the package (its argv[0] is then the file's full path)."""
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    script = ["-m", main_spec.name] if main_spec is not None and main_spec.name else sys.argv[:1]
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *script, *sys.argv[1:]])


def machine_info(packages: tuple[str, ...] = ("torch", "onnxruntime", "numpy")) -> dict[str, Any]:
    """Date, hardware, the versions of `packages`, load, the command line and the code's commit."""
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "ram_gib": ram_gib(),
        "cpu_model": cpu_description(),
        "gpu": gpu_name(),
        "system": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        **{name.replace("-", "_"): package_version(name) for name in packages},
        "load_average_at_start": load,
        "command": command_line(),
        "code": code_version(),
    }
