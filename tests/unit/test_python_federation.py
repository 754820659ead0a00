"""`Federation(...).run()` (coordinator/federation.py) refuses what it cannot host before it starts anything."""

from __future__ import annotations

import pytest

from coordinator.federation import Federation
from edge_sdk.config import ConfigError


def test_a_sharded_federation_that_would_host_its_aggregators_is_refused_naming_the_key(tmp_path):
    # Prepare: 2 shards, the aggregators left at their default (hosted here), which a Federation cannot do
    federation = Federation(dataset="digits", clients=2, rounds=1, shards=2, out=str(tmp_path / "run"))

    # Execute / Assert: refused at once, nothing written
    with pytest.raises(ConfigError, match="local_aggregators: a Federation hosts no shard aggregators"):
        federation.run()
    assert not (tmp_path / "run").exists()
