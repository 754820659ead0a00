"""Sharded aggregation: a device's shard, the shard aggregator process, the coordinator's side."""
