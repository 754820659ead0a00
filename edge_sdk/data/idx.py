"""A small reader for the idx file format (MNIST, Fashion-MNIST), numpy and gzip only.

Devices without torchvision still need to read Fashion-MNIST from the Debian package or a
`--data-dir`, so we parse the format ourselves instead of relying on torchvision.
"""

from __future__ import annotations

import gzip
import math
import struct
from pathlib import Path

import numpy as np

# The third magic byte names the element type; multi-byte types are big-endian.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one idx file (gzip-compressed when its name ends in `.gz`) into a native-endian array.

    Raises ValueError on a bad magic number, an unknown element type or a size that does not
    match the header, so a truncated download is reported instead of silently reshaped.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path}: not an idx file (bad magic number)")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown idx element type 0x{code:02x}")
    dtype = _IDX_DTYPES[code]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: truncated idx header")
    dims = struct.unpack(f">{ndim}I", data[4:header])
    count = math.prod(dims)
    if len(data) - header != count * dtype.itemsize:
        raise ValueError(
            f"{path}: idx header says {dims} ({count * dtype.itemsize} bytes of data), "
            f"file has {len(data) - header}"
        )
    array = np.frombuffer(data, dtype=dtype, count=count, offset=header).reshape(dims)
    return array.astype(dtype.newbyteorder("="))
