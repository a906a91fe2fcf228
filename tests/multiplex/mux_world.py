"""One four-process gloo world for all multi-rank multiplex checks.

Spawning a world and tearing it down costs far more than the checks themselves, so the
rendezvous, turnstile and ordering checks run in one world, in that order (ordering last: its
deadlock variants are the only ones that could leave a stuck thread behind). A part that raises
on a rank returns its traceback text instead, so the other parts still report.
"""
from __future__ import annotations

import traceback

WORLD_SIZE = 4


def run_all(rank: int) -> dict:
    from tests.multiplex import test_ordering, test_rendezvous, test_turnstile

    out: dict = {}
    for name, module in (("rendezvous", test_rendezvous), ("turnstile", test_turnstile), ("ordering", test_ordering)):
        try:
            out[name] = module.rank_checks(rank)
        except Exception:  # noqa: BLE001 - reported to the test that owns the part
            out[name] = f"rank {rank} {name} failed:\n{traceback.format_exc()}"
    return out
