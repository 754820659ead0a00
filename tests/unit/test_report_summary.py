"""The report's summary over devices (mean, std, min): the same figures whatever order the
devices' results arrived in, so a rerun's report repeats bit for bit."""

from __future__ import annotations

import math
import random

from coordinator.run.report_files import summarize


def test_the_summary_does_not_depend_on_the_order_of_the_devices():
    # Prepare: twenty devices' accuracies (fractions of their test sets), in fifty arrival orders
    rng = random.Random(0)
    accuracies = [rng.randrange(1, 700) / rng.randrange(700, 900) for _ in range(20)]
    orders = [rng.sample(accuracies, len(accuracies)) for _ in range(50)]

    # Execute
    summaries = {tuple((summarize(order) or {}).items()) for order in orders}

    # Assert: one summary, and it is the exact one
    [summary] = summaries
    mean = math.fsum(accuracies) / 20
    assert dict(summary) == {"mean": mean, "std": math.sqrt(math.fsum((a - mean) ** 2 for a in accuracies) / 20),
                             "min": min(accuracies), "count": 20}


def test_missing_and_nan_results_are_left_out_and_none_leaves_no_summary():
    assert summarize([0.5, None, float("nan"), 1.0]) == {"mean": 0.75, "std": 0.25, "min": 0.5, "count": 2}
    assert summarize([None, float("nan")]) is None
