"""Shamir t-of-n secret sharing of 32-byte secrets over GF(p), p = 2**521 - 1 (a Mersenne prime).

A device splits its self-mask seed and its mask private key among its neighbours so the server
can rebuild either one from any `threshold` of them (when that device survives, resp. drops), and
learns nothing from fewer. The field is far larger than the secrets, so a secret is an element
as is; a share's value is written big-endian in a fixed 66 bytes.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence

from .errors import SecAggError

PRIME = 2**521 - 1
SECRET_BYTES = 32
SHARE_BYTES = 66


def _check_threshold(threshold: int) -> None:
    if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 1:
        raise SecAggError(f"threshold must be an int >= 1, got {threshold!r}")


def _check_x(x: object) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or not 1 <= x < PRIME:
        raise SecAggError(f"share x must be an int in 1..p-1, got {x!r}")
    return x


def split(secret: bytes, threshold: int, xs: Sequence[int]) -> dict[int, bytes]:
    """Shares of `secret` at the distinct points `xs`: any `threshold` of them rebuild it."""
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        raise SecAggError(f"secret must be {SECRET_BYTES} bytes")
    _check_threshold(threshold)
    points = [_check_x(x) for x in xs]
    if len(set(points)) != len(points):
        raise SecAggError("share xs must be distinct")
    if len(points) < threshold:
        raise SecAggError(f"{len(points)} shares cannot meet threshold {threshold}")
    coefficients = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    shares = {}
    for x in points:
        y = 0
        for coefficient in reversed(coefficients):
            y = (y * x + coefficient) % PRIME
        shares[x] = y.to_bytes(SHARE_BYTES, "big")
    return shares


def combine(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The secret rebuilt from the first `threshold` shares by x (Lagrange interpolation at 0).

    SecAggError when fewer than `threshold` shares are given, a share is malformed, or the shares
    do not lie on one polynomial of a 32-byte secret (detected whenever the result is too large).
    """
    _check_threshold(threshold)
    if len(shares) < threshold:
        raise SecAggError(f"{len(shares)} shares given, threshold is {threshold}")
    points = []
    for x in sorted(shares)[:threshold]:
        value = shares[x]
        if not isinstance(value, bytes) or len(value) != SHARE_BYTES:
            raise SecAggError(f"share at x={x!r} must be {SHARE_BYTES} bytes")
        y = int.from_bytes(value, "big")
        if y >= PRIME:
            raise SecAggError(f"share at x={x!r} is not a field element")
        points.append((_check_x(x), y))
    secret = 0
    for i, (x_i, y_i) in enumerate(points):
        numerator, denominator = 1, 1
        for j, (x_j, _) in enumerate(points):
            if j != i:
                numerator = numerator * x_j % PRIME
                denominator = denominator * (x_j - x_i) % PRIME
        secret = (secret + y_i * numerator * pow(denominator, -1, PRIME)) % PRIME
    if secret >= 1 << (8 * SECRET_BYTES):
        raise SecAggError("shares are inconsistent: they do not encode a 32-byte secret")
    return secret.to_bytes(SECRET_BYTES, "big")
