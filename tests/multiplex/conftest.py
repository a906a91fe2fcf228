import pytest

from tests.multiplex.mux_world import WORLD_SIZE, run_all
from tests.world import run_world


@pytest.fixture(scope="session")
def mux_world() -> list[dict]:
    """Per-rank results of `mux_world.run_all` (one spawn for every multi-rank multiplex test)."""
    return run_world(run_all, WORLD_SIZE, timeout=240)


@pytest.fixture(scope="session")
def engine_worlds() -> dict[int, list[dict]]:
    """Per-rank results of `engine_world.run_engine_checks` at ATP2/ADP1 (2 ranks) and ATP2/ADP2 (4)."""
    from tests.multiplex.engine_world import run_engine_checks

    return {n: run_world(run_engine_checks, n, 2, n // 2, timeout=240) for n in (2, 4)}
