"""The `[secagg]` settings section: secure aggregation of the shared uploads (edge_sdk.secagg).

Declared once here; flags, TOML keys and the fingerprint follow. The coordinator announces each
round's parameters in its first secure-aggregation stage, so a device needs none of them before.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import ClassVar

from ..secagg.degree import FAILURE, degree_for, failure_bound, lost_of, threshold_of
from ..secagg.graph import effective_degree
from ..settings import DEFINES_IF_SET, RUN_COMMANDS, check, setting

log = logging.getLogger(__name__)


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
                                      "fewer take part); the least degree when --secagg-dropout is above 0")
    secagg_dropout: float = setting(0.0, defines=DEFINES_IF_SET,
                                    help="the fraction of a round's devices that may be lost after sharing their keys, "
                                         "in [0, 0.5): above 0 the degree is raised above --secagg-degree, where "
                                         "needed, to the smallest even degree (at most the complete graph) under "
                                         "which losing that many fails a round with probability at most 1e-6 (0, the "
                                         "default: --secagg-degree as given)")
    secagg_threshold: float = setting(0.6, defines=DEFINES_IF_SET,
                                      help="the fraction of a device's neighbours that must remain to unmask: its "
                                           "secrets are shared t-of-k with t = floor(fraction x k) + 1, above k/2")
    secagg_clip: float = setting(10.0, defines=DEFINES_IF_SET,
                                 help="the L2 bound each device clips its change to before it is quantized (the "
                                      "coordinator cannot check a masked upload's norm)")
    secagg_release_bound: float = setting(1000.0, defines=DEFINES_IF_SET,
                                          help="the bound each value of a release-phase share is clipped to before "
                                               "it is quantized: a trainer's BatchNorm means and E[x^2], a weak "
                                               "device's class means of the released features (pooled securely "
                                               "too)")

    def __post_init__(self) -> None:
        check(self.secagg_degree >= 2, "secagg_degree", "at least 2", self.secagg_degree)
        check(0 <= self.secagg_dropout < 0.5, "secagg_dropout", "in [0, 0.5)", self.secagg_dropout)
        check(0.5 <= self.secagg_threshold < 1, "secagg_threshold", "in [0.5, 1)", self.secagg_threshold)
        check(math.isfinite(self.secagg_clip) and self.secagg_clip > 0, "secagg_clip", "a positive finite norm",
              self.secagg_clip)
        check(math.isfinite(self.secagg_release_bound) and self.secagg_release_bound > 0, "secagg_release_bound",
              "a positive finite bound", self.secagg_release_bound)

    def degree_for(self, count: int) -> int:
        """The degree of a round of `count` devices: --secagg-degree as used (even, at most count - 1),
        or under --secagg-dropout the one derived from it (edge_sdk.secagg.degree) when that is
        larger (a smaller degree would need fewer colluding neighbours to unmask a device), with a
        warning when even the complete graph cannot survive that many lost."""
        configured = effective_degree(count, self.secagg_degree)
        if not self.secagg_dropout:
            return configured
        degree = max(configured, degree_for(count, self.secagg_dropout, self.secagg_threshold))
        lost, tolerated = lost_of(count, self.secagg_dropout), degree - self.threshold_for(degree)
        if failure_bound(count, degree, lost, self.secagg_threshold) > FAILURE:
            log.warning("secagg_dropout %s asks a round of %d devices to survive %d lost, but even the complete "
                        "graph (degree %d, t = %d) survives only %d: %d short", self.secagg_dropout, count, lost,
                        degree, self.threshold_for(degree), tolerated, lost - tolerated)
        return degree

    def threshold_for(self, degree: int) -> int:
        """t for a round whose graph gives each device `degree` neighbours: above degree/2, at most degree."""
        return threshold_of(degree, self.secagg_threshold)
