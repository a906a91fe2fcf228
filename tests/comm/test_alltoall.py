"""AllToAllExchange over P's normal and D's low-latency domains: equality with the single-process
reference (shared worlds), a P dispatch pending while D runs whole rounds, and GPU variants."""
import pytest
import torch

from tests.comm import programs
from tests.comm.worlds import ROUNDS, get, world
from tests.world import run_world


def test_low_latency_d_matches_reference_atp2_adp2_ep4():
    for r in get(world(4), "exchange_atp2"):
        assert len(r["alltoall_D"]) == len(ROUNDS)
        assert max(r["alltoall_D"]) < 1e-5


@pytest.mark.parametrize("name", ["alltoall_P", "alltoall_D"])
def test_matches_reference_atp1_adp2_ep2(name):
    for r in get(world(2), "exchange_atp1"):
        assert len(r[name]) == len(ROUNDS)
        assert max(r[name]) < 1e-5


def test_p_notify_pending_while_d_runs_rounds():
    for r in get(world(4), "pending_p_across_d"):
        assert r["boundary"] == (9, "moe_data")
        # P stays NOTIFIED on its own domain while D goes IDLE -> ... -> IDLE three times.
        assert r["states"] == ["notified"] + [("notified", "idle")] * 3
        assert max(r["d_errors"]) < 1e-5 and len(r["d_errors"]) == 3
        assert r["p_error"] < 1e-5 and r["p_state"] == "idle"
        assert r["seqs"] == (1, 3)  # one P dispatch, three D dispatches, counted apart


@pytest.mark.gpu
def test_nccl_exchanges_on_one_gpu():
    (r,) = run_world(programs.cuda_exchanges, 1, timeout=300, cuda=True)
    for name, errors in r["errors"].items():
        assert len(errors) == len(ROUNDS) and max(errors) < 1e-4, (name, errors)


@pytest.mark.multigpu
def test_nccl_exchanges_on_two_gpus():
    for r in run_world(programs.cuda_exchanges, 2, timeout=300):
        for name, errors in r["errors"].items():
            assert len(errors) == len(ROUNDS) and max(errors) < 1e-4, (name, errors)


@pytest.mark.multigpu
def test_deepep_exchanges_on_two_gpus():
    pytest.importorskip("deep_ep")
    for r in run_world(programs.cuda_exchanges, 2, "deepep", torch.bfloat16, timeout=300):
        for name, errors in r["errors"].items():
            assert len(errors) == len(ROUNDS) and max(errors) < 0.05, (name, errors)
