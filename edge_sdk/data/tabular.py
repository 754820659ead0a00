"""Read a CSV file with a header row and a label column into float features and label values.

The label column is the declared one, or the column named `label` (or else `y`); every other
column is a float feature. A cell that is not a number is reported by line and column name.
Standard library and numpy only.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

LABEL_COLUMNS = ("label", "y")
"""Column names taken as the label when none is declared, in this order."""


def read_csv(path: Path, label_column: str | None = None) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """(features float32 [N, D], label values as text [N], feature column names) of a CSV file."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = csv.reader(handle)
        header = [name.strip() for name in next(rows, [])]
        if not header:
            raise ValueError(f"{path}: empty file (a CSV needs a header row naming its columns)")
        label_at = _label_index(path, header, label_column)
        features, labels = [], []
        for line, row in enumerate(rows, start=2):
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise ValueError(f"{path}: line {line} has {len(row)} cells, the header {len(header)}")
            labels.append(row[label_at].strip())
            features.append([_number(path, line, header[i], cell) for i, cell in enumerate(row) if i != label_at])
    if not labels:
        raise ValueError(f"{path}: no data rows below the header")
    if len(header) < 2:
        raise ValueError(f"{path}: no feature columns besides the label column {header[label_at]!r}")
    names = tuple(name for i, name in enumerate(header) if i != label_at)
    return np.asarray(features, dtype=np.float32), np.asarray(labels), names


def _label_index(path: Path, header: list[str], label_column: str | None) -> int:
    wanted = (label_column,) if label_column is not None else LABEL_COLUMNS
    for name in wanted:
        if name in header:
            return header.index(name)
    raise ValueError(f"{path}: no label column {' or '.join(repr(w) for w in wanted)} among the columns {header}; "
                     "name it `label`, or declare `label_column` in the [task] table")


def _number(path: Path, line: int, column: str, cell: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise ValueError(f"{path}: line {line}, column {column!r}: {cell!r} is not a number") from None
    if not np.isfinite(value):
        raise ValueError(f"{path}: line {line}, column {column!r}: {cell!r} is not a finite number")
    return value
