"""The stop of a run whose privacy budget is spent: raised by the accountant's check (run.py),
caught by the round loop; its own module, so that the policy and the run's DP import it from
neither of each other."""


class BudgetSpent(RuntimeError):
    """The next round would spend more than the run's privacy budget: the run stops."""
