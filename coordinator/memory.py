"""glibc's malloc set up so that the coordinator's memory follows what it holds.

glibc gives allocations of 128 KiB or more mappings of their own, unmapped when freed, but
after the first such free it raises that threshold (up to 32 MiB) to save system calls: from
then on the multi-megabyte buffers of a round (a received update, the broadcast's frames) come
from its heaps, which keep freed space for reuse, per thread. The process then stays about a
model larger than what it holds (benchmarks/docs/scale.md, Scale). Fixing the threshold keeps such
buffers in mappings of their own. Elsewhere than on glibc nothing is changed.
"""

from __future__ import annotations

import ctypes
import platform

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
DEFAULT_THRESHOLD = 128 << 10  # glibc's own initial value


def return_freed_buffers(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process; False without glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
