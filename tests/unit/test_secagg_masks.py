"""Mask keystreams and pairwise mask seeds."""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from edge_sdk.secagg import SecAggError, expand, pairwise_seed
from edge_sdk.secagg.masks import add_masks, public_raw


def test_expand_is_the_chacha20_keystream_as_little_endian_words():
    # RFC 7539 appendix A.1, test vector 1: all-zero key and nonce, block counter 0
    words = expand(bytes(32), 4)
    assert words.dtype == np.uint32
    assert words.tolist() == [0xADE0B876, 0x903DF1A0, 0xE56A5D40, 0x28BD8653]


def test_expand_goes_on_into_the_next_chacha20_block():
    # RFC 7539 appendix A.1, test vector 2: the same key and nonce, block counter 1 (words 16..)
    assert expand(bytes(32), 20)[16:].tolist() == [0xBEE7079F, 0x7A385155, 0x7C97BA98, 0x0D082D73]


def test_a_long_mask_is_the_keystream_bit_for_bit():
    # Prepare: the keystream as the protocol defines it, made in one piece; lengths around the
    # blocks expand works in, and a digest fixed from the first implementation
    seed = bytes(range(32))
    length = 3 * (1 << 15) + 5
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor().update(bytes(4 * length))

    # Execute
    words = expand(seed, length)

    # Assert
    assert np.array_equal(words, np.frombuffer(stream, dtype="<u4"))
    assert all(np.array_equal(expand(seed, n), words[:n]) for n in (1 << 15, (1 << 15) + 1, 2 * (1 << 15) - 1))
    assert hashlib.sha256(expand(seed, 100_003).tobytes()).hexdigest() == (
        "b092f737a8f22fbcb588b2a27efdb5729cac73198d682f2d7fdf048b67739f32")


@pytest.mark.parametrize("length", [1, 1000, 2 * (1 << 15) + 7])
def test_add_masks_adds_or_subtracts_each_seeds_mask_in_place(length):
    # Prepare
    rng = np.random.default_rng(length)
    total = rng.integers(0, 2**32, length, dtype=np.uint32)
    masks = [(secrets.token_bytes(32), subtract) for subtract in (False, True, True, False)]
    expected = total.copy()
    for seed, subtract in masks:
        expected = expected - expand(seed, length) if subtract else expected + expand(seed, length)

    # Execute
    add_masks(total, masks)

    # Assert
    assert total.dtype == np.uint32 and np.array_equal(total, expected)


def test_add_masks_refuses_what_is_not_a_uint32_vector():
    with pytest.raises(SecAggError, match="uint32"):
        add_masks(np.zeros(4, dtype=np.int32), [(bytes(32), False)])
    with pytest.raises(SecAggError, match="seed"):
        add_masks(np.zeros(4, dtype=np.uint32), [(bytes(31), False)])


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
