"""Real brokers, hosts and clusters for tests and benchmarks.

- `harness.brokers`: Mosquitto on a free port with its own config (or a given config file); in a
  test a missing broker binary fails under CI=true and skips elsewhere.
- `harness.hosts`: several "hosts" on one machine (network namespaces joined to a bridge).
- `harness.nats_cluster`: a NATS cluster with one node per host, MQTT on each node.

Imported by its package name from tests/ and benchmarks/ (both run from the checkout root);
it imports neither, nor pytest until a test skips, and nothing in edge_sdk, coordinator or
export imports it.
"""
