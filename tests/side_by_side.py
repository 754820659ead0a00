"""Commands run side by side: started together, then waited for, each one's output kept apart."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence


def start(command: Sequence[str]) -> subprocess.Popen:
    """`command` started in the background, its output captured, torch on one thread."""
    return subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def finished(*started: subprocess.Popen, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """The commands `started`, once all ended (each within `timeout` s), in their order."""
    results = []
    for process in started:
        stdout, stderr = process.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results
