"""What one round's secure aggregation withstands at its n devices, degree k and threshold t.

Each device's two secrets (its self-mask seed b and its pairwise-mask key s) are Shamir-shared
t-of-k among its k neighbours on the ring (graph.py; the complete graph when k = n - 1). An honest
device answers one unmask request per round, revealing for each neighbour the share of b (told it
survived) or of s (told it dropped), never both, and only when at least t of its neighbours are
named survivors. On this graph, exactly:

- Confidentiality against the coordinator and the broker, malicious (they can tell each honest
  neighbour of a victim a different story), with c colluding devices among the victim's
  neighbours: rebuilding both of the victim's secrets takes t shares of each, of which the c
  colluders give both and the k - c honest neighbours one each, so it is possible exactly when
  2t <= k + c. It holds when every honest device has c <= 2t - k - 1 colluding neighbours. The
  coordinator draws the graph's seed, so it can place colluders anywhere on the ring: the figure
  that holds whatever the placement is C = 2t - k - 1 colluding devices in the round.
- Against a coordinator that follows the protocol (it asks every device the same, true
  question) the colluders must rebuild a secret alone: C = t - 1.
- The sum unmasks when every device that shared keys keeps t of its neighbours answering the
  unmask stage. Lost devices (and colluders that refuse to answer count as lost) placed next to
  one device on the ring take up to k of its neighbours, so the figure that holds whatever the
  placement is D = k - t; lost at random, the largest number whose union bound on a failed round
  (degree.py) is at most 1e-6 is larger.
Pure integers: no scipy, as degree.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .degree import FAILURE, failure_bound


@dataclass(frozen=True)
class Tolerance:
    """The colluders and losses a round of `devices` devices, degree `degree` and threshold
    `threshold` withstands (the module docstring derives each)."""

    devices: int
    degree: int
    threshold: int
    colluders: int
    """Worst case, against a malicious coordinator and broker: 2t - k - 1 (at least 0)."""
    colluders_protocol_followed: int
    """Worst case, against a coordinator that follows the protocol: t - 1."""
    lost: int
    """Worst case: devices lost after sharing keys (or colluders not answering), k - t."""
    lost_at_random: int
    """Lost uniformly at random: the largest number whose union bound on failing is at most 1e-6."""

    def to_plain(self) -> dict[str, Any]:
        return asdict(self)


def tolerance(devices: int, degree: int, threshold: int, fraction: float) -> Tolerance:
    """The Tolerance of a round of `devices` devices whose graph has `degree` and whose threshold
    is `threshold` (= floor(`fraction` x degree) + 1, as SecAggSettings.threshold_for)."""
    if not 1 <= threshold <= degree < devices:
        raise ValueError(f"need 1 <= threshold <= degree < devices, got t = {threshold}, k = {degree}, n = {devices}")
    worst = degree - threshold
    low, high = worst, devices - 1  # the largest lost with failure_bound <= FAILURE: it grows with lost
    while low < high:
        middle = (low + high + 1) // 2
        if failure_bound(devices, degree, middle, fraction) <= FAILURE:
            low = middle
        else:
            high = middle - 1
    return Tolerance(devices, degree, threshold, max(0, 2 * threshold - degree - 1), threshold - 1, worst, low)
