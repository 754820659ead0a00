"""Operator observability of a run: a Prometheus endpoint and experiment trackers, fed by the
coordinator's events (`observing` wraps a run; see docs/OPERATING.md). Light to import: the
libraries load only when a setting turns them on."""
