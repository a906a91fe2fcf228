"""The sharded model over DistComm equals the single-process model (same seed) within 1e-5 fp32:
a prefill (phase P) then a decode token per sequence (phase D), replicas with different token
counts, one with none (4-rank world)."""
import pytest

from tests.comm.worlds import get, world


@pytest.mark.parametrize("check, local_qkv_rows, tokens_per_rank", [
    ("model_atp2_adp2", 64, [8, 8, 4, 4]),
    ("model_atp2_adp2_p_alltoall", 64, [8, 8, 4, 4]),  # P through its split-phase all-to-all domain
    ("model_atp1_adp4", 128, [3, 6, 0, 6]),  # replica 2 has no tokens but joins every collective
    ("model_atp4_adp1", 32, [9, 9, 9, 9]),
])
def test_sharded_forward_matches_single_process(check, local_qkv_rows, tokens_per_rank):
    results = get(world(4), check)
    for r, n in zip(results, tokens_per_rank):
        assert r["shapes"][0] == (n, 260)  # prefill logits
        assert max(r["errors"]) < 1e-5
        assert r["local_experts"] == 2  # 8 experts over EP4
        assert r["qkv_rows"] == local_qkv_rows  # 4 groups x (2 q + k + v) x 8 / ATP
