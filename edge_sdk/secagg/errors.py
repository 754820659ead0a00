"""Errors of secure aggregation: one base class, so callers can tell a protocol violation from a bug.

`SecAggError` (a `ValueError`) means a message, a peer or a request broke the protocol; its text
names the field or device at fault. `RoundFailed` means the round cannot produce a sum (too few
shares of some secret survived) and that nothing about any single input was revealed.
"""

from __future__ import annotations


class SecAggError(ValueError):
    """A secure-aggregation input, message or request is invalid; the text names what and who."""


class RoundFailed(SecAggError):
    """The round cannot be completed: fewer than `threshold` shares of a needed secret arrived."""


class Inconsistent(SecAggError):
    """The server's claims contradict each other or what this device knows (a survivor set that
    differs from the one it signed, too few neighbours' signatures on it, shares withheld): the
    device refuses, reveals nothing, and says why (reason `secagg_inconsistent`)."""
