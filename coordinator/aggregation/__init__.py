"""Aggregating updates: the streaming weighted mean, the robust rules, the checks on an update."""
