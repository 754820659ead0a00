"""benchmarks/scale.py's tables when a device count failed: the failure is shown, not hidden
behind an error of the table's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks
from benchmarks import scale as scale_module

BENCHMARKS = Path(benchmarks.__file__).parent


@pytest.fixture(scope="module")
def scale():
    return scale_module


def test_a_failed_device_count_is_a_row_of_its_own_and_the_table_still_names_the_model(scale):
    # Prepare: the published results, with a first device count that failed (a run record of its error alone)
    result = json.loads((BENCHMARKS / "results" / "scale.json").read_text())
    params = result["runs"][0]["model_params"]
    result["runs"].insert(0, {"devices": 50, "error": "TimeoutError: 3 devices did not register within 60 s"})

    markdown = scale.markdown(result)

    assert "| 50 | failed: TimeoutError: 3 devices did not register within 60 s |" in markdown
    assert f"({params} parameters)" in markdown


def test_when_every_device_count_failed_the_table_says_so(scale):
    result = json.loads((BENCHMARKS / "results" / "scale.json").read_text())
    result["runs"] = [{"devices": 50, "error": "RuntimeError: broker exited"}]
    result["targets"]["largest_devices"] = None

    markdown = scale.markdown(result)

    assert "(? parameters)" in markdown and "failed: RuntimeError: broker exited" in markdown
    assert "- no run completed" in markdown
