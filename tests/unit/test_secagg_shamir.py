"""Shamir t-of-n sharing of 32-byte secrets over GF(2**521 - 1)."""

from __future__ import annotations

import itertools
import secrets

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_sdk.secagg import SecAggError, combine, split
from edge_sdk.secagg.shamir import PRIME, SHARE_BYTES


@settings(max_examples=25, deadline=None)
@given(secret=st.binary(min_size=32, max_size=32), count=st.integers(1, 8), data=st.data())
def test_any_threshold_subset_rebuilds_the_secret(secret, count, data):
    # Prepare
    threshold = data.draw(st.integers(1, count))
    xs = data.draw(st.lists(st.integers(1, 10**6), min_size=count, max_size=count, unique=True))
    shares = split(secret, threshold, xs)

    # Execute
    rebuilt = [combine({x: shares[x] for x in subset}, threshold)
               for subset in itertools.combinations(sorted(shares), threshold)]

    # Assert
    assert all(len(share) == SHARE_BYTES for share in shares.values())
    assert rebuilt and all(value == secret for value in rebuilt)


def test_combine_uses_the_first_threshold_shares_by_x():
    # Prepare: share at x=4 is garbage, but only x=1..3 are used for threshold 3
    secret = secrets.token_bytes(32)
    shares = split(secret, 3, [1, 2, 3, 4])
    shares[4] = bytes(SHARE_BYTES)

    # Execute / Assert
    assert combine(shares, 3) == secret


def test_fewer_than_threshold_shares_do_not_give_the_secret():
    # Prepare
    secret = secrets.token_bytes(32)
    shares = split(secret, 4, [1, 2, 3, 4, 5])
    too_few = {x: shares[x] for x in (1, 2, 3)}

    # Execute / Assert: refused at the real threshold, wrong (or refused) at a lowered one
    with pytest.raises(SecAggError, match="3 shares given, threshold is 4"):
        combine(too_few, 4)
    try:
        assert combine(too_few, 3) != secret
    except SecAggError as error:
        assert "inconsistent" in str(error)


@pytest.mark.parametrize(("secret", "threshold", "xs", "field"), [
    (bytes(31), 2, [1, 2], "secret"),
    (bytes(32), 0, [1, 2], "threshold"),
    (bytes(32), 2, [0, 2], "x"),
    (bytes(32), 2, [1, PRIME], "x"),
    (bytes(32), 2, [1, 1], "distinct"),
    (bytes(32), 3, [1, 2], "threshold 3"),
])
def test_split_rejects_bad_input(secret, threshold, xs, field):
    with pytest.raises(SecAggError, match=field):
        split(secret, threshold, xs)


def test_combine_rejects_malformed_shares():
    shares = split(bytes(32), 2, [1, 2])
    with pytest.raises(SecAggError, match="66 bytes"):
        combine({1: shares[1], 2: shares[2][:-1]}, 2)
    with pytest.raises(SecAggError, match="not a field element"):
        combine({1: shares[1], 2: b"\xff" * SHARE_BYTES}, 2)
