"""Fixtures that several integration test files use: `connect` (MQTT clients on a generated
broker setup, closed after the test), for the ACL tests of test_auth.py and test_shard_acl.py."""

from acl_clients import connect  # noqa: F401  (a fixture)
