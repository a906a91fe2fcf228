import pytest

from tests.multiplex.mux_world import WORLD_SIZE, run_all
from tests.world import run_world


@pytest.fixture(scope="session")
def mux_world() -> list[dict]:
    """Per-rank results of `mux_world.run_all` (one spawn for every multi-rank multiplex test)."""
    return run_world(run_all, WORLD_SIZE, timeout=240)
