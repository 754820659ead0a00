"""Secure aggregation (SecAgg+, Bell et al. 2020, on Bonawitz et al. 2017): the server learns the
sum of the devices' vectors and nothing else about any one of them, even when devices drop out.

Pure protocol logic (numpy and `cryptography`; no transport): every message is a dataclass with
`to_wire()`/`from_wire()` over plain msgpack-able values. One `RoundContext` (run, round, sorted
participants, threshold t, graph degree k, graph seed, vector length) is shared by all; the
seed is not announced but derived by every party from the advertisements (consistency.py).

Stages, per round:
 1. advertise: each device makes two fresh X25519 key pairs, c (to encrypt shares) and s (for
    pairwise masks), and signs the public halves with its Ed25519 identity key. The server
    forwards all advertisements. It learns: public keys only.
 2. share keys: each device checks every advertisement's signature against the roster (so the
    server cannot substitute keys), derives the graph seed from all of them (so nobody chooses
    its neighbours), draws a self-mask seed b, Shamir-splits b and its s private key t-of-k
    among its neighbours and sends each its two shares, AES-GCM-encrypted under an X25519(c)
    key. The server routes ciphertexts it cannot open.
 3. mask: each device sends y_u = x_u + PRG(b_u) + sum_v +-PRG(s_uv) mod 2**32, over the
    neighbours v that shared keys with it. The server sees vectors that look uniformly random.
 4. confirm: the server shows the survivors (whose masked vectors arrived) the survivor set;
    each signs it once with its identity key.
 5. unmask: the server forwards the set, who dropped and the signatures; a device (once, only for
    the set it signed, and only with valid signatures on it from t of its neighbours) reveals its
    share of b for surviving neighbours and of the s private key for the dropped. The server
    rebuilds those secrets, removes the masks and gets the sum of the survivors' inputs. Because
    each honest device signs once and t > k/2, no survivor sets the server shows, to whomever,
    get it one device's b together with the s keys of those it masked with, nor b and s of one
    device.

The neighbour graph (graph.py) is public and sparse (degree k instead of n - 1), which is what
makes SecAgg+ scale. Floats enter the ring Z_{2^32} through fixedpoint.FixedPoint.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import SecAggClient
    from .context import RoundContext
    from .errors import RoundFailed, SecAggError
    from .fixedpoint import FixedPoint
    from .graph import effective_degree, neighbours
    from .identity import IdentityKey, Roster
    from .masks import expand, pairwise_seed
    from .messages import EncryptedShares, KeyAdvertisement, MaskedInput, UnmaskRequest, UnmaskResponse
    from .server import SecAggServer
    from .shamir import combine, split

_HOMES = {"SecAggClient": "client", "RoundContext": "context", "RoundFailed": "errors", "SecAggError": "errors",
          "FixedPoint": "fixedpoint", "effective_degree": "graph", "neighbours": "graph", "IdentityKey": "identity",
          "Roster": "identity", "expand": "masks", "pairwise_seed": "masks", "EncryptedShares": "messages",
          "KeyAdvertisement": "messages", "MaskedInput": "messages", "UnmaskRequest": "messages",
          "UnmaskResponse": "messages", "SecAggServer": "server", "combine": "shamir", "split": "shamir"}
"""Where each name lives: imported on first use, so that `stages` (which the trainer client and
the coordinator import whether or not a run is secure) needs no `cryptography`."""


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{home}"), name)


__all__ = [
    "EncryptedShares",
    "FixedPoint",
    "IdentityKey",
    "KeyAdvertisement",
    "MaskedInput",
    "RoundContext",
    "RoundFailed",
    "Roster",
    "SecAggClient",
    "SecAggError",
    "SecAggServer",
    "UnmaskRequest",
    "UnmaskResponse",
    "combine",
    "effective_degree",
    "expand",
    "neighbours",
    "pairwise_seed",
    "split",
]
