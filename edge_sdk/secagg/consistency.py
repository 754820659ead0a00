"""What makes the devices of a round agree, whatever the coordinator tells them: the graph seed
that nobody chooses, and the signed survivor set that every reveal rests on.

Graph seed. It is SHA-256 over the announced context and every forwarded advertisement (id,
both public keys, signature, in id order). Each device draws fresh keys for its advertisement
and checks every advertisement's identity signature, so the seed depends on randomness of every
advertising device and the coordinator cannot forge an entry to redraw it; a device forwarded a
different set computes another seed, another context, and its shares fail to decrypt.

Survivor set (Bonawitz et al. 2017, ConsistencyCheck, on SecAgg+'s sparse graph). After masking,
every survivor is shown the round's survivor set X (the devices whose masked vector arrived,
one set for the whole group) and signs it once, with its identity key, if it is in X. It reveals
shares only for the set it signed, and only once it holds valid signatures on that set from at
least `threshold` of its neighbours. Then no honest device's update can be rebuilt: its
self-mask seed needs `threshold` revealing neighbours under a set where it survived; they
include one of the neighbours it masked with (at least `threshold` of its neighbours, more than
half), whose mask key would need `threshold` revealing neighbours under a set where that one
dropped, and those, with the `threshold` that signed the first set, would be more signers than
that neighbour has neighbours, each signing once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping

from .context import RoundContext, canonical
from .messages import KeyAdvertisement

GRAPH_SEED_DOMAIN = b"edgepfl-secagg-graph-seed"
SURVIVORS_DOMAIN = b"edgepfl-secagg-survivors"


def graph_seed(context: RoundContext, adverts: Mapping[str, KeyAdvertisement]) -> bytes:
    """SHA-256(lp(domain) lp(announced ctx) then, by id, lp(id) lp(c_pk) lp(s_pk) lp(signature))."""
    parts = [GRAPH_SEED_DOMAIN, context.announced_bytes()]
    for device in sorted(adverts):
        advert = adverts[device]
        parts += [device.encode(), advert.c_public, advert.s_public, advert.signature]
    return hashlib.sha256(canonical(*parts)).digest()


def survivor_set_bytes(survivors: Collection[str]) -> bytes:
    """The survivor set as signed: lp(id) for each id, sorted."""
    return canonical(*(device.encode() for device in sorted(survivors)))


def survivors_payload(context: RoundContext, signer: str, survivor_set: bytes) -> bytes:
    """The bytes a survivor signature covers: lp(domain) lp(ctx) lp(signer) lp(`survivor_set_bytes`)."""
    return canonical(SURVIVORS_DOMAIN, context.bytes(), signer.encode(), survivor_set)
