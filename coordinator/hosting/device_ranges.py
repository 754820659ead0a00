"""Device and shard index ranges as the command line writes them: `0-99`, `100-149,200`, `none`.

`edgepfl simulate --local-devices` and `edgepfl workers --devices` name a share of a run's
`clients` devices by index (device i is `dev` + i, as `client_id_for` names it, and holds
partition i of the dataset); `simulate --local-aggregators` names the shards (of `shards`) whose
aggregators it hosts, the same way or `all`. A range that is malformed, empty, reversed,
repeated or past the run's devices (shards) is refused with a message naming the flag.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from edge_sdk.config import ConfigError

_PIECE = re.compile(r"^(\d+)(?:-(\d+))?$")
NONE = "none"
"""The empty share (`simulate --local-devices none`: every device on other hosts)."""
ALL = "all"
"""Every shard (`simulate --local-aggregators all`, the default)."""


def client_id_for(index: int) -> str:
    """The id of device `index` of a simulated run: `dev000`, `dev001`, ..."""
    return f"dev{index:03d}"


def parse_devices(text: str, clients: int, flag: str, *, allow_none: bool = False) -> tuple[int, ...]:
    """The device indices `text` names (ascending), each below `clients`; `flag` names the flag
    in errors. `none` is the empty share where `allow_none`."""
    return _parse_indices(text, clients, flag, ("device", "devices", "--clients"), (NONE,) if allow_none else ())


def parse_shards(text: str, shards: int, flag: str) -> tuple[int, ...]:
    """The shard indices `text` names (ascending), each below `shards`: ranges as `parse_devices`
    takes them, `all` (every shard) or `none`; `flag` names the flag (or key) in errors."""
    if text.strip() == ALL:
        return tuple(range(shards))
    return _parse_indices(text, shards, flag, ("shard", "shards", "--shards"), (ALL, NONE))


def _parse_indices(text: str, count: int, flag: str, noun: tuple[str, str, str],
                   words: tuple[str, ...]) -> tuple[int, ...]:
    """The indices below `count` that `text` names (ascending); `noun` is (one, several, the flag
    that sets `count`) for errors; `none` is the empty share where `words` has it."""
    one, several, count_flag = noun
    text = text.strip()
    if NONE in words and text == NONE:
        return ()
    indices: list[int] = []
    for piece in text.split(","):
        match = _PIECE.match(piece.strip())
        if match is None:
            expected = "ranges like 0-99 or 100-149,200" + "".join(f", or {word}" for word in words)
            raise ConfigError(f"{flag} {text!r}: {piece.strip()!r} is not a {one} index or range; expected {expected}")
        first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if last < first:
            raise ConfigError(f"{flag} {text!r}: range {first}-{last} runs backwards")
        if last >= count:
            raise ConfigError(f"{flag} {text!r}: {one} {last} does not exist; the run has {count} {several} "
                              f"({count_flag})" + (f", indices 0-{count - 1}" if count else ""))
        indices.extend(range(first, last + 1))
    repeated = [index for index, times in Counter(indices).items() if times > 1]
    if repeated:
        raise ConfigError(f"{flag} {text!r}: {several} {describe_indices(repeated)} are named twice")
    return tuple(sorted(indices))


def describe_indices(indices: Sequence[int]) -> str:
    """Device (shard) indices as ranges: `0-3, 7, 9-10`."""
    ranges: list[list[int]] = []
    for index in sorted(indices):
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)
