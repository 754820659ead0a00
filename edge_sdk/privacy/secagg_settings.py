"""The `[secagg]` settings section: secure aggregation of the shared uploads (edge_sdk.secagg).

Declared once here; flags, TOML keys and the fingerprint follow. The coordinator announces each
round's parameters in its first secure-aggregation stage, so a device needs none of them before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ..settings import DEFINES_IF_SET, RUN_COMMANDS, check, setting


@dataclass(frozen=True)
class SecAggSettings:
    """Secure aggregation of a run (`[secagg]`); off by default."""

    commands: ClassVar[tuple[str, ...]] = RUN_COMMANDS

    secure_aggregation: bool = setting(False, defines=DEFINES_IF_SET,
                                       help="SecAgg+: the coordinator learns only the sum of each round's shared "
                                            "uploads (masked on the devices; devices lost mid-round are recovered "
                                            "while --secagg-threshold of a device's neighbours remain)")
    secagg_degree: int = setting(16, defines=DEFINES_IF_SET,
                                 help="neighbours of each device in the round's masking graph (all the others when "
                                      "fewer take part)")
    secagg_threshold: float = setting(0.6, defines=DEFINES_IF_SET,
                                      help="the fraction of a device's neighbours that must remain to unmask: its "
                                           "secrets are shared t-of-k with t = floor(fraction x k) + 1, above k/2")
    secagg_clip: float = setting(10.0, defines=DEFINES_IF_SET,
                                 help="the L2 bound each device clips its change to before it is quantized (the "
                                      "coordinator cannot check a masked upload's norm)")

    def __post_init__(self) -> None:
        check(self.secagg_degree >= 2, "secagg_degree", "at least 2", self.secagg_degree)
        check(0.5 <= self.secagg_threshold < 1, "secagg_threshold", "in [0.5, 1)", self.secagg_threshold)
        check(math.isfinite(self.secagg_clip) and self.secagg_clip > 0, "secagg_clip", "a positive finite norm",
              self.secagg_clip)

    def threshold_for(self, degree: int) -> int:
        """t for a round whose graph gives each device `degree` neighbours: above degree/2, at most degree."""
        return min(degree, math.floor(self.secagg_threshold * degree) + 1)
