"""Mask keystreams and pairwise mask seeds."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from edge_sdk.secagg import SecAggError, expand, pairwise_seed
from edge_sdk.secagg.masks import public_raw


def test_expand_is_the_chacha20_keystream_as_little_endian_words():
    # RFC 7539 appendix A.1, test vector 1: all-zero key and nonce, block counter 0
    words = expand(bytes(32), 4)
    assert words.dtype == np.uint32
    assert words.tolist() == [0xADE0B876, 0x903DF1A0, 0xE56A5D40, 0x28BD8653]


def test_expand_is_deterministic_per_seed_and_differs_across_seeds():
    seed = secrets.token_bytes(32)
    assert np.array_equal(expand(seed, 1000), expand(seed, 1000))
    assert np.array_equal(expand(seed, 1000)[:10], expand(seed, 10))
    assert not np.array_equal(expand(seed, 1000), expand(secrets.token_bytes(32), 1000))


def test_both_ends_derive_the_same_pairwise_seed_bound_to_the_context():
    # Prepare
    u, v = X25519PrivateKey.generate(), X25519PrivateKey.generate()

    # Execute
    seeds = [pairwise_seed(u, public_raw(v), b"round 1"), pairwise_seed(v, public_raw(u), b"round 1"),
             pairwise_seed(u, public_raw(v), b"round 2")]

    # Assert
    assert seeds[0] == seeds[1] != seeds[2] and len(seeds[0]) == 32


def test_bad_seeds_and_keys_are_rejected():
    with pytest.raises(SecAggError, match="seed"):
        expand(bytes(16), 4)
    with pytest.raises(SecAggError, match="length"):
        expand(bytes(32), -1)
    with pytest.raises(SecAggError, match="32 bytes"):
        pairwise_seed(X25519PrivateKey.generate(), bytes(31), b"")
    with pytest.raises(SecAggError, match="key agreement"):
        pairwise_seed(X25519PrivateKey.generate(), bytes(32), b"")  # a low-order point
