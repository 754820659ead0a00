"""Mask generation: a seed's uint32 keystream, and the seed two devices share for a pairwise mask.

A mask is the ChaCha20 keystream under the 32-byte seed, read as little-endian uint32 words, and
is added to a vector mod 2**32 (numpy's uint32 arithmetic wraps). The nonce is fixed at zero on
purpose: every seed is fresh for the round (a random self-mask seed, or HKDF of a Diffie-Hellman
secret between keys generated for this round and bound to its context), and each seed expands
exactly one mask, so a (key, nonce) pair is never used for two different streams.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import SecAggError

SEED_BYTES = 32
PUBLIC_KEY_BYTES = 32
MASK_INFO = b"edgepfl-secagg-mask"
_ZERO_NONCE = bytes(16)
# ChaCha20's 32-bit block counter covers 2**32 blocks of 64 bytes: 2**36 words.
MAX_WORDS = 1 << 36
_BLOCK_WORDS = 1 << 15
"""Words of keystream made at a time: a block and the slice it is added to stay in the cache."""
_ZEROS = memoryview(bytes(4 * _BLOCK_WORDS))


def _keystream(seed: bytes) -> CipherContext:
    """The ChaCha20 encryptor (zero nonce) whose output on zero bytes is `seed`'s keystream."""
    if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
        raise SecAggError(f"mask seed must be {SEED_BYTES} bytes")
    return Cipher(algorithms.ChaCha20(seed, _ZERO_NONCE), mode=None).encryptor()


def _check_length(length: int) -> None:
    if not isinstance(length, int) or not 0 <= length < MAX_WORDS:
        raise SecAggError(f"mask length must be an int in 0..2**36-1, got {length!r}")


def _next_words(keystream: CipherContext, out: np.ndarray) -> None:
    """Fill the uint32 block `out` (at most _BLOCK_WORDS) with the keystream's next words, read
    little-endian: written in place, no bytes object in between."""
    keystream.update_into(_ZEROS[:4 * out.size], out.data.cast("B"))
    if sys.byteorder == "big":
        out.byteswap(inplace=True)


def expand(seed: bytes, length: int) -> np.ndarray:
    """`length` pseudo-random uint32 words from `seed` (ChaCha20 keystream, zero nonce)."""
    keystream = _keystream(seed)
    _check_length(length)
    words = np.empty(length, dtype=np.uint32)
    for start in range(0, length, _BLOCK_WORDS):
        _next_words(keystream, words[start:start + _BLOCK_WORDS])
    return words


def add_masks(total: np.ndarray, masks: Sequence[tuple[bytes, bool]]) -> None:
    """For each (seed, subtract): total -= expand(seed, len(total)) if subtract, else +=, mod 2**32,
    in place. A block of each mask at a time, so no mask is ever held whole: what masking and
    unmasking a vector of millions of words against dozens of seeds costs is the keystream."""
    if not isinstance(total, np.ndarray) or total.dtype != np.uint32 or total.ndim != 1:
        raise SecAggError("masks are added to a 1-D uint32 numpy array")
    _check_length(total.size)
    keystreams = [(_keystream(seed), subtract) for seed, subtract in masks]
    block = np.empty(min(total.size, _BLOCK_WORDS), dtype=np.uint32)
    for start in range(0, total.size, _BLOCK_WORDS):
        part = total[start:start + _BLOCK_WORDS]
        words = block[:part.size]
        for keystream, subtract in keystreams:
            _next_words(keystream, words)
            if subtract:
                part -= words
            else:
                part += words


def shared_secret(private: X25519PrivateKey, peer_public: bytes) -> bytes:
    """X25519(private, peer_public); SecAggError for a malformed or low-order peer key."""
    if not isinstance(peer_public, bytes) or len(peer_public) != PUBLIC_KEY_BYTES:
        raise SecAggError(f"peer public key must be {PUBLIC_KEY_BYTES} bytes")
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as error:
        raise SecAggError(f"key agreement failed: {error}") from error


def derive_key(secret: bytes, info: bytes) -> bytes:
    """A 32-byte key from a Diffie-Hellman secret: HKDF-SHA256, no salt, the given info."""
    return HKDF(algorithm=hashes.SHA256(), length=SEED_BYTES, salt=None, info=info).derive(secret)


def pairwise_seed(private: X25519PrivateKey, peer_public: bytes, context: bytes) -> bytes:
    """The seed u and v both derive for their pairwise mask: HKDF of X25519(s_u, s_v), info binds the round."""
    return derive_key(shared_secret(private, peer_public), MASK_INFO + context)


def public_raw(private: X25519PrivateKey) -> bytes:
    """The 32 raw bytes of an X25519 private key's public key."""
    return private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def private_raw(private: X25519PrivateKey) -> bytes:
    """The 32 raw bytes of an X25519 private key (what is secret-shared for dropout recovery)."""
    return private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                 serialization.NoEncryption())
