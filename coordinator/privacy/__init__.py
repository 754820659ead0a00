"""Differential privacy of federated runs on the coordinator: the accountant (`accountant`),
the mechanisms' arithmetic (`mechanism`), which runs can be private (`policy`) and one run's DP
as the round loop uses it (`run`). Nothing is imported here: `policy` is read by every
algorithm's server module, and the accountant's dependencies load only when a run is private."""
