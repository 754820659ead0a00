"""examples/: each script runs as its docstring says and does what it claims."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
WITHOUT_TORCH = """
import importlib.abc, runpy, sys

class Blocked(importlib.abc.MetaPathFinder):  # not installed as far as this process can tell
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "torchvision", "sklearn", "scipy"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocked())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_example(*args: str, timeout: float = 300) -> str:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_federation_in_python_trains_every_device_every_round() -> None:
    out = run_example(str(EXAMPLES / "federation_in_python.py"), "--algorithm", "fedper", "--devices", "3",
                      "--rounds", "2")

    assert re.findall(r"round (\d): (\d) devices replied", out) == [("1", "3"), ("2", "3")]
    final = re.search(r"fedper: final mean personalized accuracy ([0-9.]+) .* over 3 devices", out)
    assert final is not None and float(final.group(1)) >= 0.8, out


def test_weak_device_example_personalizes_a_released_body_without_torch(tmp_path) -> None:
    # Prepare: a body exported as the server would, and a device's own images as an .npz
    from sklearn.datasets import load_digits

    from edge_sdk.data import BUILTIN_TASKS
    from edge_sdk.models import build_body
    from export.onnx_export import export_module

    meta = BUILTIN_TASKS["digits"]
    body, feature_dim = build_body("cnn8", meta)
    export_module(body.eval(), (1, 8, 8), tmp_path / "body.onnx",
                  metadata={"input_shape": [1, 8, 8], "normalization": {"mean": list(meta.mean), "std": list(meta.std)},
                            "feature_dim": feature_dim, "class_names": list(meta.class_names)})
    digits = load_digits()
    np.savez(tmp_path / "local.npz", x=digits.images[:400] / 16.0, y=digits.target[:400])

    # Execute: with torch, torchvision, scikit-learn and scipy unimportable
    out = run_example("-c", WITHOUT_TORCH, str(EXAMPLES / "personalize_weak_device.py"), "--body",
                      str(tmp_path / "body.onnx"), "--data", str(tmp_path / "local.npz"), "--head", "svm",
                      "--out", str(tmp_path / "personal.onnx"))

    # Assert
    accuracy = re.search(r"svm head on 300 images, accuracy ([0-9.]+) on 100 held-out images", out)
    assert accuracy is not None and float(accuracy.group(1)) >= 0.8, out
    personal = onnx.load(str(tmp_path / "personal.onnx"))
    assert [o.name for o in personal.graph.output] == ["label", "probabilities"]


def test_bring_your_model_trains_user_networks_exports_and_personalizes_a_weak_device() -> None:
    out = run_example(str(EXAMPLES / "bring_your_model.py"), "--quick", timeout=600)

    tabular = dict(re.findall(r"tabular (\w+): mean personalized accuracy ([0-9.]+) over 4 devices", out))
    assert set(tabular) == {"fedavg", "fedrep", "repper"}, out
    assert all(float(accuracy) >= 0.7 for accuracy in tabular.values()), out
    weak = re.search(r"tabular repper: .* weak devices ([0-9.]+)", out)
    assert weak is not None and float(weak.group(1)) >= 0.6, out
    exported = re.search(r"tabular repper body: (\d+) bytes int8 .* max \|ONNX - PyTorch\| ([0-9.e+-]+) \(fp32\)", out)
    assert exported is not None and float(exported.group(2)) < 1e-4, out
    assert re.search(r"images 40x32 RGB fedavg: mean personalized accuracy [0-9.]+ over 4 devices", out), out
