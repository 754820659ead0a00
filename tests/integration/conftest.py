"""Fixtures that several integration test files use: `connect` (MQTT clients on a generated
broker setup, closed after the test), defined beside the ACL tests of test_auth.py and used by
test_shard_acl.py's too."""

from test_auth import connect  # noqa: F401  (a fixture)
