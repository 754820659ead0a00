"""The run ledger: the finished benchmark runs' records, kept in the repository.

Not a benchmark itself (imported as `ledger` by `runs`). The run cache (`runs.RunCache`) keeps
whole run folders: checkpoints and every device's personal state, too big to commit and lost with
the machine that trained them. A protocol such as fair.py's needs more machine time than one
session has, so its runs come from several machines and sessions; the ledger is what they leave
behind: one JSON file per finished, clean run, named like the run's cache folder (its settings and
fingerprint), holding the run's settings, the machine that trained it and its report (per-round
metrics and traffic: nothing of any model). The tables read a run from the ledger when its cache
folder is absent, so `--cached-only` rebuilds them on a fresh checkout; a run can not be extended
from the ledger (no checkpoint), only reused up to the rounds it ran.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEFAULT_LEDGER = "benchmarks/results/ledger"
"""The ledger committed with the benchmarks' tables."""

ENTRY_KEYS = ("run", "config", "machine", "report")


class LedgerError(ValueError):
    """A ledger entry that is not a run record of this ledger (names its file and what is wrong)."""


class RunLedger:
    """Finished runs' records under `root`, one `<run folder name>.json` each."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def get(self, name: str) -> dict[str, Any] | None:
        """The entry of run `name`, or None when the ledger has none; LedgerError when its file is
        not a record of that run."""
        path = self.path(name)
        if not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise LedgerError(f"{path}: not JSON ({exc})") from exc
        if not isinstance(entry, dict):
            raise LedgerError(f"{path}: a run record is a JSON object, got {type(entry).__name__}")
        absent = [key for key in ENTRY_KEYS if key not in entry]
        if absent:
            raise LedgerError(f"{path}: lacks {', '.join(absent)}")
        if entry["run"] != name:
            raise LedgerError(f"{path}: records run {entry['run']!r}, not {name!r}")
        report = entry["report"]
        if not isinstance(report, dict) or not isinstance(report.get("rounds_completed"), int):
            raise LedgerError(f"{path}: report.rounds_completed is not a number of rounds")
        return entry

    def record(self, name: str, config: dict[str, Any], machine: dict[str, Any] | None,
               report: dict[str, Any]) -> bool:
        """Write run `name`'s record unless the ledger holds the same one (or a longer run of the
        same settings); True when it wrote. The file is replaced whole (a reader never sees half)."""
        current = self.get(name)
        if current is not None and current["report"]["rounds_completed"] > report["rounds_completed"]:
            return False
        entry = {"run": name, "config": config, "machine": machine, "report": report}
        text = json.dumps(entry, indent=1, sort_keys=True, default=str) + "\n"
        path = self.path(name)
        if path.exists() and path.read_text() == text:
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)
        return True
