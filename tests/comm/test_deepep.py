"""The DeepEP backend without DeepEP installed: an install hint, before any collective.
(The 2-GPU DeepEP run is in test_alltoall.py, marked multigpu.)"""
import importlib.util

import pytest

from megatron_rollout.comm import deepep
from tests.comm.worlds import get, world

needs_no_deep_ep = pytest.mark.skipif(importlib.util.find_spec("deep_ep") is not None, reason="deep_ep is installed")


@needs_no_deep_ep
def test_require_deep_ep_gives_install_hint():
    with pytest.raises(ImportError, match=r"needs DeepEP with its V1 API .*CommConfig\(backend='alltoall'\)"):
        deepep.require_deep_ep()


@needs_no_deep_ep
def test_dist_comm_with_deepep_backend_fails_with_hint_on_every_rank():
    for r in get(world(2), "deepep_missing"):
        assert r.startswith("ImportError: CommConfig(backend='deepep') needs DeepEP")
        assert "No module named 'deep_ep'" in r
