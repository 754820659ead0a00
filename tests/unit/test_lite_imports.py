"""What a weak device loads before it writes a model: onnxruntime and numpy, not onnx.

`onnx` costs about 15 MB of resident memory; the lite client imports it only to write the
personalized model, after embedding and fitting, so it does not add to the peak of those
steps (benchmarks/docs/devices.md, device footprint).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import edge_sdk.lite, json, sys; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"


def test_importing_the_lite_client_loads_onnxruntime_but_not_onnx_or_torch():
    # Prepare
    command = [sys.executable, "-c", PROBE]

    # Execute
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)

    # Assert
    loaded = set(json.loads(result.stdout))
    assert "onnxruntime" in loaded and "numpy" in loaded
    assert not loaded & {"onnx", "torch", "sklearn", "scipy"}


def test_a_head_writes_its_onnx_model_when_asked():
    # Prepare
    import numpy as np

    from edge_sdk.lite import fit_head

    rng = np.random.default_rng(0)
    features, labels = rng.normal(size=(40, 6)).astype(np.float32), np.arange(40) % 4

    # Execute
    model = fit_head("lr", features, labels, num_classes=4).to_onnx(6)

    # Assert
    assert [output.name for output in model.graph.output] == ["label", "probabilities"]
