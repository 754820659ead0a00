"""A weak device personalizes within 256 MB: benchmarks/footprint.py --quick --limit-mb 256.

`edgepfl lite-client` runs as a real subprocess and personalizes a cnn28 body (Fashion-MNIST's
28x28 shape, 512 features) on 2,000 local images: it embeds them, fits an svm head and writes its
ONNX model. Where this test runs as root with a memory cgroup (v2 `memory.max`, else v1
`memory.limit_in_bytes`) the device runs inside one of 256 MB, swap included, and is killed if it
needs more; everywhere, its own peak RSS (VmHWM, which counts shared libraries the cgroup may
not charge) must stay within 256 MB too. `prlimit --as` is not used: onnxruntime and OpenBLAS
reserve far more address space than they touch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
LIMIT_MB = 256


def test_a_weak_device_personalizes_a_fashion_mnist_body_within_256_mb(tmp_path):
    # Prepare
    command = [sys.executable, "-m", "benchmarks.footprint", "--quick", "--limit-mb", str(LIMIT_MB),
               "--out", str(tmp_path)]

    # Execute
    result = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})

    # Assert
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    document = json.loads((tmp_path / "footprint.json").read_text())
    (body,) = document["weak_device"]
    assert (body["model"], body["images"]) == ("cnn28", 2000)
    (run,) = body["runs"]
    assert run["exit_status"] == 0, run["log_tail"]
    limited = os.geteuid() == 0 and Path("/sys/fs/cgroup/memory").is_dir()  # as root with cgroup v1's memory
    assert run["limit"] in (("cgroup-v2", "cgroup-v1") if limited else ("cgroup-v2", "cgroup-v1", "none"))
    assert run["peak_rss_mb"] is not None and 0 < run["peak_rss_mb"] <= LIMIT_MB
    assert run["model_bytes"] > 0 and 0.0 <= run["accuracy"] <= 1.0
