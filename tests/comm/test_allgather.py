"""AllGatherExchange: boundary placement (one process) and equality with the single-process
reference on ATP2/ADP2/EP4 and ATP1/ADP2/EP2 (the shared worlds)."""
import torch

from megatron_rollout.comm.allgather import AllGatherExchange
from megatron_rollout.comm.exchange import LocalExchange
from megatron_rollout.comm.facade import LocalComm, Shard
from megatron_rollout.model.layers import BoundaryPoint, Site, run_to_end
from megatron_rollout.types import Axis, Phase
from tests.comm.worlds import ROUNDS, experts_pair, get, routed_tokens, world


class RecordingComm(LocalComm):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def all_gather(self, x, axis, phase):
        self.log.append(("all_gather", axis, phase))
        return [x]

    def all_reduce(self, x, axis, phase):
        self.log.append(("all_reduce", axis, phase))
        return x


def test_yields_moe_data_right_before_the_full_all_reduce():
    log = []
    full, _ = experts_pair(Shard())
    x, ids, w = routed_tokens(6, set(), seed=1)
    forward = AllGatherExchange(RecordingComm(log), Phase.P).run(x, ids, w, full, 3)
    point = next(forward)
    log.append(point)
    out = run_to_end(forward)
    assert log == [("all_gather", Axis.ADP, Phase.P), ("all_gather", Axis.ADP, Phase.P),
                   BoundaryPoint(3, Site.MOE_DATA), ("all_reduce", Axis.FULL, Phase.P)]
    assert torch.equal(out, run_to_end(LocalExchange().run(x, ids, w, full, 3)))


def test_matches_reference_atp2_adp2_ep4():
    for r in get(world(4), "exchange_atp2"):
        assert len(r["allgather_P"]) == len(ROUNDS)
        assert max(r["allgather_P"]) < 1e-5


def test_matches_reference_atp1_adp2_ep2():
    for r in get(world(2), "exchange_atp1"):
        assert len(r["allgather_P"]) == len(ROUNDS)
        assert max(r["allgather_P"]) < 1e-5
