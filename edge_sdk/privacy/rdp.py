"""The Renyi orders of every RDP accountant of edgepfl, the coordinator's and DP-SGD's on devices.

dp_accounting's default orders without the fractional ones below 3 (2 kept): at those orders the
RDP of a Poisson-sampled Gaussian may fail to converge, and dp_accounting then logs a warning and
skips the order. They matter only for epsilons above about 14 at delta 1e-5, where leaving them
out gives a slightly larger epsilon, never a smaller one. dp_accounting is imported when asked.
"""

from __future__ import annotations


def rdp_orders() -> tuple[float, ...]:
    """The orders, ascending."""
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    return (2.0, *(float(order) for order in DEFAULT_RDP_ORDERS if order >= 3))
