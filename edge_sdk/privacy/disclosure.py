"""What a device says of its data in the clear, by the run it registers with or answers.

A plain run hears everything (the coordinator's data report, its weights and its checks read it).
Under DP a device says nothing of its data in HELLO (no DP mechanism covers a count). Under
secure aggregation a device's counts would give away the weights its masked update carries, so
it says only its example count rounded up to a power of two (`examples_bucket`): the round's
weights are then scaled by the largest bucket, a public figure that needs no exact count, and the
weighted mean is still exact (each device weights itself by its own exact count). Its evaluation
replies carry the accuracies and no count. No torch here: weak devices import this package.
"""

from __future__ import annotations

import math
from typing import Any

EXAMPLES_BUCKET = "examples_bucket"
"""HELLO metric under secure aggregation: b with 2^(b-1) < examples <= 2^b (0 for one example)."""

COUNTS = ("num_examples", "num_train", "num_test", "dp_sgd_epsilon")
"""The figures of a device's data that its replies withhold under secure aggregation (DP-SGD's
epsilon is a function of the device's number of examples)."""

FIGURES = "figures"
"""EVALUATE config: False when the devices answer with no figures (under DP, an evaluation the
budget cannot release: they still fit and deploy what they would)."""

MAX_BUCKET = 62
"""The largest bucket a coordinator takes: 2^62 examples, far above any device's."""


def examples_bucket(examples: int) -> int:
    """The power of two that bounds `examples` from above: ceil(log2(examples)), 0 for 0 or 1."""
    return max(0, math.ceil(math.log2(examples))) if examples > 1 else 0


def hello_figures(num_train: int, num_test: int, *, private: bool, secure: bool) -> dict[str, float]:
    """HELLO's metrics: nothing under DP, the example bucket under secure aggregation, else the
    training and test counts."""
    if private:
        return {}
    if secure:
        return {EXAMPLES_BUCKET: examples_bucket(num_train)}
    return {"num_examples": num_train, "num_test": num_test}


def evaluation_figures(metrics: dict[str, float], request: dict[str, Any], *, secure: bool) -> dict[str, float]:
    """An EVAL_RES's metrics for the EVALUATE config `request`: none when it asks for no figures;
    else as measured, less the data's counts under secure aggregation."""
    if request.get(FIGURES) is False:
        return {}
    return {k: v for k, v in metrics.items() if k not in COUNTS} if secure else metrics
