"""Fixtures the unit test modules share."""

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Single-threaded torch for one module's tests, which ask for it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`: their tiny models only lose time to
    threading. torch is imported here, not at the top, so that modules without it stay without it."""
    from edge_sdk import training

    with training.one_thread():
        yield
