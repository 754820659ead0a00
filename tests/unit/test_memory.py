"""Unit tests for coordinator.memory (glibc's mmap threshold) and the broker's queue settings."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from coordinator.brokers.mosquitto import QUEUE_SETTINGS, render_config
from coordinator.memory import return_freed_buffers


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_the_mmap_threshold_is_fixed_on_glibc():
    assert return_freed_buffers() is True


def test_broker_config_lets_the_broker_queue_a_round_of_uploads(tmp_path: Path):
    config = render_config(tmp_path, 1883, "127.0.0.1", "mosquitto", tls=False).splitlines()

    assert "max_queued_messages 0" in config and "max_queued_bytes 0" in config
    assert all(line in config for line in QUEUE_SETTINGS)
