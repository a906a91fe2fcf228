import pytest

from tests.multiplex.mux_world import WORLD_SIZE, run_all
from tests.world import run_world


@pytest.fixture(scope="session")
def mux_world() -> list[dict]:
    """Per-rank results of `mux_world.run_all` (one spawn for every multi-rank multiplex test)."""
    return run_world(run_all, WORLD_SIZE, timeout=240)


class _EngineWorlds(dict):
    """{ranks: per-rank results}, each world run on first use: a test that reads one world pays
    for that one inside its own timeout, never for both."""

    def __missing__(self, n: int) -> list[dict]:
        from tests.multiplex.engine_world import run_engine_checks

        self[n] = run_world(run_engine_checks, n, 2, n // 2, timeout=240)
        return self[n]


@pytest.fixture(scope="session")
def engine_worlds() -> dict[int, list[dict]]:
    """Per-rank results of `engine_world.run_engine_checks` at ATP2/ADP1 (2 ranks) and ATP2/ADP2 (4)."""
    return _EngineWorlds()
