"""GPU smoke tests, where CUDA exists: a trainer device's local round on CUDA with AMP, and
benchmarks/gpu.py --quick (a simulation over MQTT on `--device cuda`, with and without AMP)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from builtin_tasks import digits_client
from coordinator.algorithms.base import ServerContext
from coordinator.algorithms import load as load_server
from edge_sdk.settings import TrainSettings
from edge_sdk.algorithms.base import NoHyper, Task
from edge_sdk.algorithms.fedavg import FedAvgDevice
from edge_sdk.training import mixed_precision, pick_device

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_fedavg_round_on_cuda_with_amp_returns_host_arrays():
    data = digits_client(0, num_clients=2, partition="iid", seed=0)
    settings = TrainSettings(model="cnn8", rounds=1, local_epochs=1, batch_size=32, lr=0.05, seed=0)
    server = load_server("fedavg")(NoHyper(), ServerContext("cnn8", data.task, seed=0, rounds=1, clients=2))
    device = FedAvgDevice(NoHyper(), settings, data, "cuda", client_seed=1)

    with mixed_precision(True):
        result = device.fit(Task(1, server.state, {"selected": ["dev0"]}))
    metrics = device.evaluate(Task(1, server.state, {"selected": ["dev0"]}))

    assert pick_device("auto").type == "cuda"
    assert next(device.model.parameters()).device.type == "cuda"
    assert device.train_x.is_cuda
    assert np.isfinite(result.metrics["loss"])
    assert all(isinstance(a, np.ndarray) and np.isfinite(a).all() for a in result.groups["shared"].values())
    assert 0.0 <= metrics["accuracy"] <= 1.0


def test_the_cuda_benchmark_runs_fedavg_end_to_end_with_and_without_amp(tmp_path):
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--quick", "--out", str(tmp_path)], cwd=root,
                            capture_output=True, text=True, timeout=900, check=False)

    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads((tmp_path / "gpu.json").read_text())
    assert [(row["algorithm"], row["amp"], row["exit"]) for row in sorted(document["paths"], key=lambda r: r["amp"])] \
        == [("fedavg", False, 0), ("fedavg", True, 0)]
    assert all(row["peak_gpu_mb"] > 0 for row in document["throughput"] if row["device"] == "cuda")
