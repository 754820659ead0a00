"""The benchmark scripts (benchmarks/<name>.py) imported by tests as the scripts import each other."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py as the module NAME, its own imports (`_runs`, `_machine`, ...) found in
    benchmarks/ while it loads. benchmarks/ then leaves sys.path again, the scripts' own insertions
    included: its user_models.py would shadow tests/user_models.py."""
    saved = sys.path[:]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved
